"""Does multi-process JAX on CPU (gloo) survive two threads running collective programs at
once on disjoint device sets? Async GRPO's producer and learner would (producer.py, "Taking
turns"). Starts 2 processes x 4 CPU devices; in each, one thread loops a sharded
matmul-and-sum over 2 of its devices and another over the other 2 (`--threads`), or runs the
same loops one after the other (`--sequential`). Prints what finished within --timeout.

    .venv/bin/python tools/gloo_two_threads.py [--sequential] [--timeout 60]

Seen with jax 0.12 on a 2-core VM: --sequential finishes in seconds; two threads hang (no loop
of 300 calls finishes), so the queue takes turns on CPU.
"""

import argparse
import os
import socket
import subprocess
import sys
import threading


def child(pid: int, port: int, sequential: bool, calls: int) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
  per = {}
  for d in jax.devices():
    per.setdefault(d.process_index, []).append(d)
  halves = ([d for ds in per.values() for d in ds[:2]], [d for ds in per.values() for d in ds[2:]])

  def loop(devices, name, n):
    mesh = Mesh(np.array(devices), ("x",))
    f = jax.jit(lambda a: (a @ a.T).sum() + a.sum(0), out_shardings=NamedSharding(mesh, P()))
    x = jax.make_array_from_callback((256, 64), NamedSharding(mesh, P("x")),
                                     lambda idx: np.ones((256, 64), np.float32)[idx])
    for _ in range(n):
      f(x).block_until_ready()
    print(f"process {pid}: {name} finished {n} calls", flush=True)

  for i, h in enumerate(halves):  # each clique's gloo context made first, one at a time
    loop(h, f"warm-up {i}", 1)
  if sequential:
    for i, h in enumerate(halves):
      loop(h, f"half {i}", calls)
  else:
    threads = [threading.Thread(target=loop, args=(h, f"thread {i}", calls), daemon=True)
               for i, h in enumerate(halves)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sequential", action="store_true")
  ap.add_argument("--timeout", type=float, default=60.0)
  ap.add_argument("--calls", type=int, default=300)
  ap.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
  ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child >= 0:
    child(args.child, args.port, args.sequential, args.calls)
    return
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, __file__, "--port", str(port), "--calls", str(args.calls)]
  cmd += ["--sequential"] * args.sequential
  procs = [subprocess.Popen(cmd + ["--child", str(i)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True) for i in range(2)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=args.timeout)[0])
    except subprocess.TimeoutExpired:
      p.kill()
      outs.append(p.communicate()[0] + f"(killed after {args.timeout:.0f} s)\n")
  print("".join(outs), end="")


if __name__ == "__main__":
  main()
