"""jaxrl's GPU attention kernels compiled for the GPU and run on it, against XLA's attention on
the same chip: the part of tests/test_kernels.py and tests/test_paged_kernels.py that CPU
cannot check (there they run in Pallas's interpreter). tools/gpu_check.sh runs it.

    python3 tools/gpu_kernels.py        # on a machine with a GPU; exits 1 if any check fails

Checks, each on the test modules' own inputs:
  - the Pallas (Triton) flash attention, forward and the three gradients, packed ragged rows
    with grouped-query heads, in float32 and bfloat16;
  - cuDNN's fused attention through jax.nn (JAXRL_GPU_ATTENTION=cudnn), bfloat16, forward and
    gradients;
  - the Pallas paged decode kernel against XLA's gather path, float32 and bfloat16.
Each compiled program must hold the kernel's custom call (Triton, Mosaic GPU or cuDNN), so
a silent fallback to XLA fails. Error bars: the reference runs at float32 `highest` precision;
Triton's float32 dots use TF32 (10-bit mantissa), hence 2e-2 on values of order 1 for float32
and 5e-2 for bfloat16, relative to the largest reference value.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_kernels import _self_attention  # noqa: E402  (the tests' inputs)
from test_paged_kernels import LIVE, _inputs  # noqa: E402

from jaxrl.backends.gpu import paged as gpu_paged  # noqa: E402
from jaxrl.backends.gpu.attention import cudnn_attention, pallas_attention  # noqa: E402
from jaxrl.models import attention  # noqa: E402
from jaxrl.models.attention import xla_attention  # noqa: E402

FAILED = []


def _report(name, got, want, tol, hlo, call):
  err = max(float(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)).max()) /
            max(1.0, float(np.abs(np.asarray(w, np.float32)).max())) for g, w in zip(got, want))
  # Pallas on GPU lowers to Triton by default, to Mosaic GPU when a kernel asks for it.
  names = ("triton", "mosaic_gpu") if call == "pallas" else (call,)
  found = any(n in hlo.lower() for n in names)
  ok = err <= tol and found
  print(f"{'PASS' if ok else 'FAIL'} {name}: max relative error {err:.2e} (bar {tol:.0e}), "
        f"{'/'.join(names)} call in the program: {found}", flush=True)
  if not ok:
    FAILED.append(name)


def _grads(fn, args, cot):
  def loss(*a):
    out = fn(*a)
    return jnp.sum(out.astype(jnp.float32) * cot), out
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, out), grads = step(*args)
  return [out, *grads], step.lower(*args).compile().as_text()


def learner(name, kernel, call, dtype, tol, *, packed):
  q, keys, values, mask, causal = _self_attention(3, 2, 256, 2, 2, 64, packed=packed)
  args = [jnp.asarray(x, dtype) for x in (q, keys, values)]
  seg = None if causal.q_segment_ids is None else jnp.asarray(causal.q_segment_ids)
  cot = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  got, hlo = _grads(lambda q, k, v: kernel(q, k, v, seg, seg), args, cot)
  with jax.default_matmul_precision("highest"):
    want, _ = _grads(lambda q, k, v: xla_attention(q, k, v, mask),
                     [jnp.asarray(x, jnp.float32) for x in (q, keys, values)], cot)
  _report(name, got, want, tol, hlo, call)


def paged(dtype, tol):
  q, keys, values, pages, pos = _inputs(2, 2, 64, dtype)
  fn = jax.jit(gpu_paged.paged_decode)
  got = fn(q, keys, values, pages, pos)
  with jax.default_matmul_precision("highest"):
    want = attention.xla_paged_decode_attention(
        *(x.astype(jnp.float32) for x in (q, keys, values)), pages, pos)
  _report(f"paged decode {jnp.dtype(dtype).name}", [got[LIVE]], [want[LIVE]], tol,
          fn.lower(q, keys, values, pages, pos).compile().as_text(), "pallas")


def main():
  print(f"{jax.devices()[0].device_kind} | jax {jax.__version__}", flush=True)
  if jax.default_backend() != "gpu":
    raise SystemExit(f"tools/gpu_kernels.py checks GPU kernels and jax runs on "
                     f"{jax.default_backend()}: run it on a machine with a GPU.")
  checks = [
      lambda: learner("pallas attention float32", pallas_attention, "pallas", jnp.float32,
                      2e-2, packed=True),
      lambda: learner("pallas attention bfloat16", pallas_attention, "pallas", jnp.bfloat16,
                      5e-2, packed=True),
      lambda: learner("cudnn attention bfloat16", cudnn_attention, "cudnn", jnp.bfloat16, 5e-2,
                      packed=False),
      lambda: paged(jnp.float32, 2e-2),
      lambda: paged(jnp.bfloat16, 5e-2),
  ]
  for check in checks:
    try:
      check()
    except Exception as e:  # one broken kernel must not hide the others' results
      FAILED.append(repr(e)[:300])
      print(f"FAIL {type(e).__name__}: {str(e)[:1500]}", flush=True)
  print(f"{len(checks) - len(FAILED)} of {len(checks)} GPU kernel checks passed", flush=True)
  sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
  main()
