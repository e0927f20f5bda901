"""Where a GRPO step's time goes, kernel by kernel: a `jax.profiler` trace of real steps,
summed per compiled program and per XLA:CPU kernel.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 .venv/bin/python benchmarks/profile_step.py
    ... benchmarks/profile_step.py --shape demo --steps 4 --top 20

Runs `jaxrl grpo` on one of benchmarks/grpo_step.py's shapes (default: the peer anchor) under
the profiler and prints, per GRPO step:
  * each program (the update's train step, the reference forward, the decode loop, prefill,
    ...): how many times it ran and the summed time of its kernels;
  * each program's kernels by kind: YNNPACK dot fusions, YNNPACK reductions, XLA's own
    (Eigen) dots, and the rest (elementwise and reduction fusions, copies, scatters);
  * the --top kernels of each of the three big programs, with their result shape and the jax
    operation they came from (read from XLA's dump of the optimised programs). A decode
    loop's `while` entry is the loop thunk's own event, outside its body's kernels (the
    per-iteration condition and dispatch): half the demo shape's tiny decode loop, ~2% of the
    anchor's.
Times are the kernels' own event durations. XLA:CPU runs independent kernels of one program
concurrently and a YNNPACK kernel spans both cores, so per-program sums can exceed the wall
time: compare kernels within a program, and programs by their share, not against a clock.
Each program's row also gives its wall time (first kernel start to last kernel end, summed
over its runs) and the part of it no kernel event covers. XLA's own (Eigen) dots run
asynchronously: their event ends when the product is handed to the thread pool (a
[4032, 256] x [256, 688] product's event lasts ~0.2 ms, the product ~11 ms), so with the
learner on Eigen dots (jaxrl.backends.cpu.dots) their compute is the uncovered time, not
their events. benchmarks/grpo_step.py gives the wall-clock split. The warm-up step is included
(its programs run as every later step's do; compiling is not a kernel).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
  # Profile the process benchmarks/grpo_step.py times (tcmalloc preloaded, as the jaxrl command
  # runs; jaxrl/backends/cpu/allocator.py). Under glibc malloc the update's kernels absorb the
  # page faults of its fresh temporaries: 1,201 against 686 ms/step of kernel events
  # (2026-12-01).
  from jaxrl.backends.cpu import allocator
  allocator.ensure()
DUMP = tempfile.mkdtemp(prefix="jaxrl_profile_")
# XLA reads its flags once, at backend start: the dump of the optimised programs (for shapes
# and source lines) must be asked for before jax initialises.
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={DUMP}", "--xla_dump_hlo_pass_re=^$",
    "--xla_dump_hlo_module_re=.*(step_fn|logprobs|_fn).*"])

import jax  # noqa: E402

sys.path.insert(0, ROOT)
from benchmarks.grpo_step import SHAPES, shape_config  # noqa: E402
from jaxrl.algorithms import grpo  # noqa: E402

BIG = ("jit_step_fn", "jit_logprobs", "jit__steps_fn")  # update, reference forward, decode loop
NAMES = {"jit_step_fn": "update (train step)", "jit_logprobs": "reference forward",
         "jit__steps_fn": "decode loop", "jit__prefill_fn": "prefill",
         "jit__insert_fn": "insert", "jit__grow_fn": "grow cache window", "jit_init": "init"}


def kind(op: str, has_dot: bool) -> str:
  """A kernel's kind: YNNPACK fusions also run reductions (e.g. log-softmax's max)."""
  if op.startswith("ynn_fusion"):
    return "dot, YNNPACK" if has_dot else "YNNPACK reduction"
  if op.startswith(("dot", "dot_general")):
    return "dot, XLA/Eigen"
  return "other (elementwise, copies, scatters)"


def hlo_ops(dump: str) -> dict[tuple[str, str], tuple[str, str, bool]]:
  """(program id, op) -> (result shape, the jax operation it came from, whether it computes a
  dot, itself or in the fused computation it calls), from XLA's dump."""
  out = {}
  for path in glob.glob(os.path.join(dump, "module_*.cpu_after_optimizations.txt")):
    pid = str(int(os.path.basename(path).split(".")[0].split("_")[1]))
    with open(path) as f:
      text = f.read()
    with_dot = {m.group(1) for m in re.finditer(r"^%(\S+) .*?^}", text, re.M | re.S)
                if re.search(r"= \S+ dot\(", m.group(0))}
    for line in text.splitlines():
      m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+)", line)
      if m:
        src = re.search(r'op_name="([^"]*)"', line)
        called = re.search(r"calls=%([\w.\-]+)", line)
        has_dot = " dot(" in line or bool(called and called.group(1) in with_dot)
        out[pid, m.group(1)] = (m.group(2), src.group(1) if src else "", has_dot)
  return out


def wall_time(spans) -> tuple[dict[str, float], dict[str, float]]:
  """(module -> wall ms, module -> ms no kernel event covers), summed over its runs: a run's
  wall is its first kernel's start to its last kernel's end."""
  wall, uncovered = collections.Counter(), collections.Counter()
  for (mod, _), evs in spans.items():
    evs.sort()
    covered, (lo, hi) = 0, evs[0]
    for a, b in evs[1:]:
      if a > hi:
        covered, lo, hi = covered + hi - lo, a, b
      else:
        hi = max(hi, b)
    covered += hi - lo
    span = max(b for _, b in evs) - evs[0][0]
    wall[mod] += span / 1e6
    uncovered[mod] += (span - covered) / 1e6
  return wall, uncovered


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="anchor", choices=sorted(SHAPES))
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--top", type=int, default=12)
  p.add_argument("--kind", default="", help="list only kernels whose kind contains this, e.g. "
                 "'reduction' or 'Eigen'")
  args = p.parse_args()
  config = shape_config(args.shape, args.steps)
  trace = os.path.join(DUMP, "trace")
  print(f"profiling {args.steps} GRPO steps of the {args.shape} shape "
        f"({jax.device_count()} {jax.default_backend()} device(s))", flush=True)
  with tempfile.TemporaryDirectory() as workdir:
    jax.profiler.start_trace(trace)
    try:
      grpo.run(config, workdir, out=lambda *a: None)
    finally:
      jax.profiler.stop_trace()
  data = jax.profiler.ProfileData.from_file(
      sorted(glob.glob(os.path.join(trace, "**", "*.xplane.pb"), recursive=True))[-1])
  ms = collections.defaultdict(float)  # (module, program id, op) -> ms
  runs = collections.defaultdict(set)  # module -> run ids
  spans = collections.defaultdict(list)  # (module, run id) -> [(start, end)] of its kernels
  for plane in data.planes:
    for line in plane.lines:
      for ev in line.events:
        st = {k: str(v) for k, v in ev.stats}
        if "hlo_module" in st:
          ms[st["hlo_module"], st.get("program_id", ""), ev.name] += ev.duration_ns / 1e6
          runs[st["hlo_module"]].add(st.get("run_id"))
          spans[st["hlo_module"], st.get("run_id")].append(
              (ev.start_ns, ev.start_ns + ev.duration_ns))
  wall, uncovered = wall_time(spans)
  ops = hlo_ops(DUMP)
  n = args.steps
  per_module = collections.Counter()
  for (mod, _, _), t in ms.items():
    per_module[mod] += t / n
  total = sum(per_module.values())
  print(f"\nkernel time per GRPO step, by program (summed kernel events; see the docstring)")
  print(f"{'program':28s} {'runs/step':>9s} {'ms/step':>9s} {'share':>6s} {'wall ms/step':>12s} "
        f"{'uncovered':>9s}")
  for mod, t in per_module.most_common():
    if t >= 0.5:
      print(f"{NAMES.get(mod, mod):28s} {len(runs[mod]) / n:9.1f} {t:9.1f} {t / total:6.1%} "
            f"{wall[mod] / n:12.1f} {uncovered[mod] / max(wall[mod], 1e-9):9.0%}")
  for mod in BIG:
    # One program can be compiled more than once (the decode loop once per cache window):
    # a kernel's time is summed over those compiles, its shape read from one of them.
    per_op, pids = collections.Counter(), {}
    for (m, pid, op), t in ms.items():
      if m == mod:
        per_op[op] += t / n
        pids[op] = pid
    rows = [(t, pids[op], op) for op, t in per_op.most_common()]
    if not rows:
      continue
    by_kind = collections.Counter()
    for t, pid, op in rows:
      by_kind[kind(op, ops.get((pid, op), ("", "", False))[2])] += t
    mod_t = sum(by_kind.values())
    print(f"\n{NAMES[mod]}: {mod_t:.1f} ms/step of kernel events; " + ", ".join(
        f"{k} {v / mod_t:.0%}" for k, v in by_kind.most_common()) +
          f"\n  wall {wall[mod] / n:.1f} ms/step, {uncovered[mod] / n:.1f} of it outside every "
          "kernel event (Eigen dots' compute, dispatch)")
    shown = [r for r in rows if args.kind in kind(r[2], ops.get((r[1], r[2]), ("", "", False))[2])]
    for t, pid, op in shown[:args.top]:
      shape, src, _ = ops.get((pid, op), ("?", "", False))
      print(f"  {t:8.2f} ms  {op:28s} {shape[:30]:30s} {src[-60:]}")


if __name__ == "__main__":
  try:
    main()
  finally:
    shutil.rmtree(DUMP, ignore_errors=True)
