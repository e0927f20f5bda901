"""Does a small sampler-like program run beside a learner-like one on fake CPU devices of one
process? XLA's CPU client gang-schedules every program over more than one device behind the
previous such launch (PjRtCpuLoadedExecutable::Execute), with or without collectives; a
one-device program runs on its caller's thread. Async GRPO's producer decodes beside the
learner, so this decides its placement on CPU (docs/design.md, "Async generation on CPU").

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python tools/cpu_gang_schedule.py

For a "learner" of 4 devices (a sharded matmul loop, ~0.1 s a call) and a "sampler" of 4, 2 and
1 devices (16 small matmuls in one program, no collective), prints the sampler's milliseconds
a call alone and while another thread loops the learner, and the learner's. Seen with jax 0.12
on a 2-core VM (two runs): sampler on 4 devices 0.5 -> 58-68 ms a call, on 2 devices 0.5 ->
53-71 ms, on 1 device 0.7 -> 2.2-3.9 ms; the learner ~100 ms a call either way.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def learner_program(devices):
  mesh = Mesh(np.array(devices), ("d",))
  w = jax.device_put(jnp.full((512, 512), 1e-3), NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((4096, 512)), NamedSharding(mesh, P("d")))
  f = jax.jit(lambda w, x: jax.lax.fori_loop(0, 20, lambda i, c: jnp.tanh(c @ w), x).sum())
  return lambda: f(w, x).block_until_ready()


def sampler_program(devices):
  mesh = Mesh(np.array(devices), ("d",))
  w = jax.device_put(jnp.full((256, 256), 1e-3), NamedSharding(mesh, P()))
  h = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("d")))
  f = jax.jit(lambda w, h: jax.lax.fori_loop(0, 16, lambda i, c: jnp.tanh(c @ w), h))
  return lambda: f(w, h).block_until_ready()


def ms_per_call(fn, calls: int) -> float:
  t = time.perf_counter()
  for _ in range(calls):
    fn()
  return (time.perf_counter() - t) / calls * 1e3


def main():
  devices = jax.devices()
  if len(devices) < 8:
    raise SystemExit(f"{len(devices)} devices: run with "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=8")
  learn = learner_program(devices[:4])
  learn()
  for n in (4, 2, 1):
    sample = sampler_program(devices[4:4 + n])
    sample()
    alone, learn_alone = ms_per_call(sample, 20), ms_per_call(learn, 5)
    stop, times = threading.Event(), []

    def loop():
      while not stop.is_set():
        t = time.perf_counter()
        learn()
        times.append(time.perf_counter() - t)
    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.3)
    beside = ms_per_call(sample, 40)
    stop.set()
    thread.join()
    print(f"sampler on {n} device(s): {alone:6.2f} ms a call alone, {beside:6.2f} ms beside the "
          f"learner; learner {learn_alone:5.1f} ms alone, {np.median(times) * 1e3:5.1f} ms beside")


if __name__ == "__main__":
  main()
