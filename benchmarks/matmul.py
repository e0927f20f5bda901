"""The fp32 matmul rate each framework's CPU kernels reach on the GRPO anchor's shapes, side by
side in one run: where the learner's and the sampler's time goes on this machine.

    .venv/bin/python benchmarks/matmul.py [--torch-python /tmp/peer/bin/python]

Shapes of the bench preset (d 256, MLP 688): `decode` multiplies 64 rows (a batch-64 decode
step's MLP), `learner` 4,032 rows (the anchor update's completion tokens). Each timing chains
(x @ B) @ C `--chain` times in one call (a jitted fori_loop in jax, a Python loop in torch),
so per-call dispatch is spread thin and the figure is the kernels' own. The jax rows also show
XLA:CPU's alternatives to its default YNNPACK dots, compiled per call through
`compiler_options` (`xla_cpu_experimental_ynn_fusion_type=""`: XLA's own or Eigen dots). With
--torch-python, benchmarks/peers/torch_matmul.py times PyTorch (oneDNN / MKL) on the same shapes
under that interpreter, after the jax rows.

--one-core adds each row on one core: jax re-runs pinned to one CPU (sched_setaffinity before
jax starts, so XLA sizes its thread pools to it), torch with one thread. The pairs show how
much each framework gains from the second core on each shape.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

if "MATMUL_ONE_CPU" in os.environ:  # the --one-core run: pinned before XLA sizes its threads
  os.sched_setaffinity(0, {int(os.environ["MATMUL_ONE_CPU"])})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl.backends.cpu.dots import EIGEN_DOTS  # noqa: E402

SHAPES = {"decode": 64, "learner": 4032}  # rows; torch_matmul.py gets these in argv
D, F = 256, 688


def chain_length(rows: int) -> int:
  return 200 if rows < 1000 else 8
VARIANTS = {"YNNPACK (default)": {}, "no YNNPACK": EIGEN_DOTS}


def rate(rows: int, chain: int, options: dict, repeats: int) -> float:
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (rows, D))
  b = jax.random.normal(k2, (D, F)) * D**-0.5
  c = jax.random.normal(k3, (F, D)) * F**-0.5

  def chained(x, b, c):
    return jax.lax.fori_loop(0, chain, lambda i, x: (x @ b) @ c, x)

  f = jax.jit(chained, compiler_options=options)
  f(x, b, c).block_until_ready()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    f(x, b, c).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * 2 * rows * D * F * chain / float(np.median(times)) / 1e9


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--torch-python", default=None)
  p.add_argument("--repeats", type=int, default=15)
  p.add_argument("--one-core", action="store_true",
                 help="also time every row on one core (jax pinned to one CPU, torch 1 thread)")
  p.add_argument("--jax-rows-only", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  cores = len(os.sched_getaffinity(0))
  if not args.jax_rows_only:
    print(f"jax {jax.__version__} on {jax.device_count()} {jax.default_backend()} device(s), "
          f"{cores} cores, load average {os.getloadavg()[0]:.1f}; GFLOP/s, fp32")
  suffix = f", {cores} core{'s' if cores > 1 else ''}"
  for shape, rows in SHAPES.items():
    chain = chain_length(rows)
    for name, options in VARIANTS.items():
      label = f"{shape} [{rows}, {D}] x [{D}, {F}]"
      print(f"{label:36s} jax, {name + suffix:28s} "
            f"{rate(rows, chain, options, args.repeats):6.0f}", flush=True)
  if args.jax_rows_only:
    return
  if args.one_core:  # the jax rows again, in a process that may use one CPU only
    one = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--jax-rows-only",
                          "--repeats", str(args.repeats)], capture_output=True, text=True,
                         env=dict(os.environ, MATMUL_ONE_CPU=str(one)))
    if out.returncode != 0:
      raise SystemExit(f"the one-core run failed: {out.stderr[-1500:]}")
    print(out.stdout, end="")
  if args.torch_python:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "torch_matmul.py")
    shapes = {k: [rows, chain_length(rows)] for k, rows in SHAPES.items()}
    out = subprocess.run([args.torch_python, script, str(args.repeats),
                          json.dumps({"d": D, "f": F, "shapes": shapes,
                                      "threads": [1] if args.one_core else []})],
                         capture_output=True, text=True)
    if out.returncode != 0:
      raise SystemExit(f"{script} failed under {args.torch_python}: {out.stderr[-1500:]}")
    print(out.stdout, end="")


if __name__ == "__main__":
  main()
