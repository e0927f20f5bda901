"""jaxrl's CPU backend: what runs on XLA:CPU in place of XLA's defaults, and the one switch for
it. jaxrl.backends asks it on CPU devices only; nothing here changes a program elsewhere.

  attention.py   C++ attention kernels for the sampler's decode step and the learner's
                 full-sequence forward and gradient (csrc/), built by build.py
  dots.py        which XLA:CPU dot kernels the learner's programs compile with
  allocator.py   TCMalloc, which the jaxrl command re-executes itself on

Each is steered by an environment variable, which its module reads:

  JAXRL_CPU_KERNELS=0               keep XLA's attention (default: the kernels, where they build)
  JAXRL_KERNEL_CACHE=DIR            where the built kernels are cached (~/.cache/jaxrl/kernels)
  JAXRL_CPU_DOTS=auto|ynnpack|eigen the learner's dot kernels (auto: Eigen on x86-64 without
                                    AVX-512, YNNPACK elsewhere)
  JAXRL_TCMALLOC=0|PATH             stay on glibc malloc, or preload this libtcmalloc

describe() says what they chose in this process; every run records it in its config.json and
summary.json (jaxrl.backends.describe, jaxrl.train.rundir).
"""

from __future__ import annotations

import os

# attention, build and dots are imported where used: this package stays free of jax for the
# console script's allocator re-exec (jaxrl.__main__), which imports it before jax loads.


def attention_kernel(mesh, *, batch, kv_heads):
  """The learner's attention kernel for full-sequence programs on `mesh` (see
  attention.learner_sharded), or None where XLA's attention stays: JAXRL_CPU_KERNELS=0, or the
  library could not be built."""
  from jaxrl.backends.cpu import attention, build
  if not build.available():
    return None
  return attention.learner_sharded(mesh, batch=batch, kv_heads=kv_heads)


def decode_kernel(mesh, cache_spec):
  """The decode-step attention kernel for a cache laid out as `cache_spec` on `mesh` (see
  attention.decode_sharded), or None as for attention_kernel."""
  from jaxrl.backends.cpu import attention, build
  if not build.available():
    return None
  return attention.decode_sharded(mesh, cache_spec)


def compiler_options(program: str) -> dict | None:
  """The `compiler_options` of a program on CPU devices (see dots.compiler_options)."""
  from jaxrl.backends.cpu import dots
  return dots.compiler_options(program)


def describe() -> dict[str, str]:
  """The attention and dot kernels this process runs on CPU, and why, for run records. Builds
  the kernels if no earlier call did (as the first CPU program would)."""
  from jaxrl.backends.cpu import build, dots
  path, why_not = build.library()
  setting = os.environ.get(dots.ENV, dots.DEFAULT).strip().lower()
  return {
      "attention": (f"cpu kernels for float32 models ({path})" if path else
                    f"xla (cpu kernels unavailable: {why_not})"),
      "dots": (f"learner {dots.choose()} ({dots.ENV}={setting}); decoding ynnpack, eigen "
               "with one slot per device"),
  }
