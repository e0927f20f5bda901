"""The learner's CPU attention kernels (jaxrl/backends/cpu/csrc/learner_attention.cc) against
XLA's attention, side by side in one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 .venv/bin/python \
        benchmarks/learner_attention.py [--repeats 30] [--rounds 3]

1. One layer of the GRPO anchor's learner attention (bench preset: 64 rows of 63 completion
   positions after a 16-token prompt, 2 KV heads of 2 query heads, head_dim 64), XLA's path
   and the kernels alternating call by call, compiled with the learner's dot kernels: the
   forward alone (the reference forward's case) and the forward with its gradient (the
   update's; the loss reads the output, so neither forward is dropped).
2. --rounds whole GRPO runs of the anchor shape (benchmarks/grpo_step.py's, 6 steps after a
   warm-up), alternating XLA's attention and the kernels round by round: median s/step and the
   update and reference phases.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
  from jaxrl.backends.cpu import allocator
  allocator.ensure()  # tcmalloc, as the jaxrl command runs

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, ROOT)
from jaxrl.backends import compiler_options  # noqa: E402
from jaxrl.backends.cpu import attention as cpu_attention, build  # noqa: E402
from jaxrl.models import attention  # noqa: E402


def layer_ab(repeats: int) -> None:
  B, T, K, G, Tp, H = 64, 63, 2, 2, 16, 64
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, K, G, H)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((B, K, Tp + T, H)), jnp.float32)
  values = jnp.asarray(rng.standard_normal((B, K, Tp + T, H)), jnp.float32)
  valid = rng.random((B, Tp)) < 0.9
  causal = np.arange(T)[:, None] >= np.arange(T)[None, :]
  mask = jnp.asarray(np.concatenate([np.broadcast_to(valid[:, None], (B, T, Tp)),
                                     np.broadcast_to(causal, (B, T, T))], axis=2))
  cot = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  opts = compiler_options(jax.devices())
  fns = {}
  for name, attn in (("XLA", attention.xla_attention), ("kernel", cpu_attention.learner)):
    def loss(q, k, v, attn=attn):
      return jnp.sum(attn(q, k, v, mask) * cot)
    fns[f"forward, {name}"] = jax.jit(lambda q, k, v, attn=attn: attn(q, k, v, mask),
                                      compiler_options=opts)
    fns[f"forward + gradient, {name}"] = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=opts)
  times = {n: [] for n in fns}
  for f in fns.values():
    jax.block_until_ready(f(q, keys, values))
  for _ in range(repeats):
    for n, f in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(f(q, keys, values))
      times[n].append(time.perf_counter() - t)
  print(f"one layer of the anchor's learner attention, q {tuple(q.shape)}, keys "
        f"{tuple(keys.shape)}, median of {repeats} alternating calls")
  for n, ts in times.items():
    print(f"  {n:28s} {1e3 * statistics.median(ts):7.2f} ms  (min {1e3 * min(ts):.2f})")


def grpo_ab(rounds: int, steps: int) -> None:
  from benchmarks.grpo_step import run_shape  # noqa: PLC0415
  # The learner's programs ask jaxrl.models.attention for their kernel; decoding keeps its own.
  real = attention.attention_kernel
  rows = {"XLA": [], "kernel": []}
  for r in range(rounds):
    for name in ("XLA", "kernel"):
      attention.attention_kernel = real if name == "kernel" else (lambda *a, **k: None)
      try:
        med = run_shape("anchor", steps)
      finally:
        attention.attention_kernel = real
      rows[name].append(med)
      print(f"  round {r + 1}, {name:6s}: {med['step']:.2f} s/step, update {med['update']:.3f} "
            f"s, reference {med['ref']:.3f} s, generation {med['gen']:.3f} s", flush=True)
  print(f"GRPO anchor, medians over {rounds} alternating round(s) of {steps} steps")
  for name, meds in rows.items():
    pick = lambda k: statistics.median(m[k] for m in meds)  # noqa: E731
    print(f"  {name:6s} {pick('step'):.2f} s/step  update {pick('update'):.3f} s  reference "
          f"{pick('ref'):.3f} s  generation {pick('gen'):.3f} s")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=30)
  p.add_argument("--rounds", type=int, default=3, help="GRPO rounds per side (0: skip)")
  p.add_argument("--steps", type=int, default=6)
  a = p.parse_args()
  if not build.available():
    raise SystemExit("the CPU attention kernels are unavailable here (see the line above)")
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"load average {os.getloadavg()[0]:.1f}")
  layer_ab(a.repeats)
  if a.rounds:
    grpo_ab(a.rounds, a.steps)


if __name__ == "__main__":
  main()
