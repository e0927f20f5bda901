"""jaxrl's GPU backend: flash attention for the learner's full-sequence attention, forward and
gradient (attention.py). jaxrl.backends asks it on GPU devices only.

  JAXRL_GPU_ATTENTION=pallas|cudnn|xla   the learner's attention (default: pallas)
  JAXRL_GPU_PAGED=pallas|xla             the paged KV cache's decode attention (default:
                                         pallas, the Pallas Triton paged attention kernel,
                                         paged.py; xla: the gather path)

pallas: jax's Pallas (Triton) flash attention, for causal rows with or without packed
segments, in any float dtype. cudnn: cuDNN's fused attention (jax.nn.dot_product_attention)
where it takes the call (bfloat16/float16 rows without packing), Pallas for the other rows.
Pallas is the default because it was checked first, against XLA's attention in Pallas's
interpreter (tests/test_kernels.py); on an H200 both paths compiled and matched XLA's attention
(tools/gpu_kernels.py), neither has been timed against the other. Decoding over the dense cache
keeps XLA's attention on GPU; over the paged cache it runs the Pallas paged attention kernel
(checked on an H200, and slower there than the dense cache: docs/guides/kernels.md).
"""

from __future__ import annotations

import functools
import os

from jaxrl.backends.gpu.attention import (cudnn_attention, handles_cudnn, handles_pallas,
                                          pallas_attention)
from jaxrl.backends.gpu import paged
from jaxrl.backends.sharded import per_device, per_device_paged
from jaxrl.errors import check_choice

ENV = "JAXRL_GPU_ATTENTION"
CHOICES = ("pallas", "cudnn", "xla")
PAGED_ENV = "JAXRL_GPU_PAGED"


def paged_choice() -> str:
  """The paged cache's decode attention JAXRL_GPU_PAGED names (default pallas)."""
  return check_choice(PAGED_ENV, os.environ.get(PAGED_ENV, "pallas").strip().lower(),
                      ("pallas", "xla"))


def paged_decode_kernel(mesh, cache_spec, *, interpret: bool = False):
  """The Pallas GPU paged attention kernel for the paged cache's decode step on `mesh`, per
  device under shard_map; None with JAXRL_GPU_PAGED=xla. The kernel returns None (XLA's gather
  path) for calls paged.takes refuses and where the mesh's axes do not divide the slots or KV
  heads. interpret: Pallas's interpreter (tests on CPU devices)."""
  if paged_choice() == "xla":
    return None
  return per_device_paged(functools.partial(paged.paged_decode, interpret=interpret), mesh,
                          cache_spec,
                          takes=lambda q, keys: paged.takes(q.shape[-1], q.dtype, keys.shape[2]))


def choice() -> str:
  """The learner attention JAXRL_GPU_ATTENTION names (default pallas)."""
  return check_choice(ENV, os.environ.get(ENV, "pallas").strip().lower(), CHOICES)


def attention_kernel(mesh, *, batch, kv_heads, interpret: bool = False):
  """Flash attention for the full-sequence calls of programs on `mesh` (rows over the `batch`
  mesh axes, KV heads over `kv_heads`), per device under shard_map; None where
  JAXRL_GPU_ATTENTION=xla. The kernel returns None (XLA's attention) for calls it does not take:
  a mask given only as an array (the cached forwards), keys beyond the queries' own positions
  (a GRPO group's completions against their shared prompt), a mesh whose axes do not divide
  the rows or KV heads. interpret: Pallas's interpreter (tests on CPU devices)."""
  which = choice()
  if which == "xla":
    return None
  pallas = per_device(functools.partial(pallas_attention, interpret=interpret), mesh,
                      batch=batch, kv_heads=kv_heads)
  cudnn = per_device(cudnn_attention, mesh, batch=batch, kv_heads=kv_heads)

  def kernel(q_btkgh, keys_bksh, values_bksh, mask_bts, causal=None):
    del mask_bts  # the same mask, by structure in `causal`
    if causal is None:
      return None
    q_seg, kv_seg = causal
    T, S = q_btkgh.shape[1], keys_bksh.shape[2]
    if which == "cudnn" and handles_cudnn(q_btkgh.dtype, q_seg, kv_seg, T, S):
      return cudnn(q_btkgh, keys_bksh, values_bksh, None, None)
    if handles_pallas(q_seg, kv_seg, T, S):
      return pallas(q_btkgh, keys_bksh, values_bksh, q_seg, kv_seg)
    return None

  return kernel


def describe() -> dict[str, str]:
  """The attention and dot kernels this process runs on GPU, for run records."""
  which = choice()
  attention = {
      "pallas": "pallas flash attention (triton) for the learner's causal self-attention",
      "cudnn": "cudnn fused attention for unpacked half-precision rows, pallas flash attention "
               "for the learner's other causal self-attention",
      "xla": f"xla ({ENV}=xla)"}[which]
  if which != "xla":
    attention += "; xla for dense-cache decoding, cached forwards and grouped-prompt completions"
  attention += ("; pallas paged attention for paged-cache decoding" if paged_choice() == "pallas"
                else f"; xla paged gather ({PAGED_ENV}=xla)")
  return {"attention": attention, "dots": "xla"}
