"""Which XLA:CPU dot kernels the learner's programs (train steps, batched log-prob forwards)
compile with: XLA's default YNNPACK fusions, or its own Eigen kernels on the CPUs where those
were measured faster.

XLA:CPU can run a dot as a YNNPACK fusion (its default) or as its own Eigen-based kernel. Which
is faster depends on the CPU. On the learner's fp32 shapes (bench preset, the GRPO anchor's
4,160 token rows), in one process, alternating the two compiles call by call:

- an Intel Xeon with AVX-512 and AMX (2 cores): YNNPACK ahead, forward + backward 0.768 s
  against 0.807 s (median of 8, 2026-11-30);
- an AMD EPYC (Zen 3, AVX2, 2 cores): Eigen ahead, the GRPO update 1.39 s against 1.50 s and
  the reference forward 0.46 s against 0.51 s (median of 7, 2026-11-30 22:15 UTC; again
  2026-12-01 06:41 UTC, median of 5: 0.951 and 0.935 of YNNPACK's time); a lone
  [4032, 256] x [256, 688] product 129 against 108 GFLOP/s (`benchmarks/matmul.py`).

`JAXRL_CPU_DOTS` picks: `auto` (the default: Eigen on x86-64 without AVX-512 or with XLA capped
below it by --xla_cpu_max_isa, YNNPACK elsewhere), `ynnpack` (XLA's own default) or `eigen`.
`auto` was opt-in until the demo stopped hanging on one SFT draw: on the AMD machine the demo's
old SFT recipe (lr 3e-3, seed 0, 8 devices) ended at held-out loss 0.473 with Eigen dots
against 0.293 with YNNPACK, and GRPO from it gained +0.03 against +0.19, while GRPO from one
SFT checkpoint gave bit-identical results under both. Over seeds that was the draw of a chaotic
SFT, not a worse kernel: seeds 0-11 of that recipe on one device (2026-12-01), held-out loss
YNNPACK / Eigen 0.231 / 0.242, 0.459 / 0.620, 0.547 / 0.742, 0.433 / 0.424, 0.907 / 0.994,
0.625 / 0.704, 0.507 / 0.665, 0.399 / 0.670, 1.000 / 0.920, 0.574 / 0.264, 0.588 / 0.504,
0.434 / 0.420: Eigen behind in 7 of 12, by 0.04 +- 0.05 (mean, standard error), against a spread of
0.23-1.00 over seeds; held-out accuracy 0.399 against 0.387 on average. The demo's SFT now runs
at lr 1e-3 (jaxrl.demo), which ends at 0.47-0.66 over seeds 0-5 with YNNPACK and 0.51-0.66 over
seeds 0-3 with Eigen dots, and GRPO gains +0.12..+0.19 from either.
Decoding keeps YNNPACK either way, except one-slot shards ("decode_one_slot", see
`jaxrl.sampler.engine`). Nothing changes off CPU (jaxrl.backends asks this module on CPU only).
"""

from __future__ import annotations

import functools
import os
import platform

from jaxrl.errors import ConfigError

ENV = "JAXRL_CPU_DOTS"
CHOICES = ("ynnpack", "eigen", "auto")
DEFAULT = "auto"
# Compile options for XLA's own (Eigen / matrix-vector) dots instead of YNNPACK fusions.
EIGEN_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def cpu_flags() -> frozenset[str]:
  """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


def choose(setting: str | None = None, *, machine: str | None = None,
           flags: frozenset[str] | None = None) -> str:
  """"ynnpack" or "eigen" for this CPU, from `setting` (default: $JAXRL_CPU_DOTS, else auto)."""
  setting = (os.environ.get(ENV, DEFAULT) if setting is None else setting).strip().lower()
  if setting not in CHOICES:
    raise ConfigError(f"environment variable {ENV}={setting!r} is not valid: choose one of "
                      f"{', '.join(CHOICES)} (or unset it for auto).")
  if setting != "auto":
    return setting
  machine = platform.machine() if machine is None else machine
  flags = cpu_flags() if flags is None else flags
  if machine.lower() in ("x86_64", "amd64") and flags and (
      "avx512f" not in flags or below_avx512()):
    return "eigen"
  return "ynnpack"


def below_avx512(xla_flags: str | None = None) -> bool:
  """Whether XLA_FLAGS caps XLA:CPU below AVX-512 (--xla_cpu_max_isa=AVX2, say, which `make
  test-isa` sets to emulate an AVX2 machine): auto then chooses as that machine would."""
  xla_flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  isa = [f.split("=", 1)[1] for f in xla_flags.split() if f.startswith("--xla_cpu_max_isa=")]
  return bool(isa) and isa[-1].upper() in ("SSE4_2", "AVX", "AVX2")


def compiler_options(program: str) -> dict | None:
  """The `compiler_options` for a `program` on CPU devices: "learner" (train steps, batched
  log-prob and reference forwards) takes the choice above, "decode_one_slot" (the sampler's
  decode steps where each device holds one slot) always Eigen dots. None: XLA's defaults."""
  if program == "decode_one_slot":
    return dict(EIGEN_DOTS)
  if program != "learner":
    raise ValueError(f"compiler_options: unknown program {program!r}")
  return dict(EIGEN_DOTS) if choose() == "eigen" else None
