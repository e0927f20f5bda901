"""Decode attention over the paged KV cache on GPU: jax's Pallas (Triton) paged attention
kernel (jax.experimental.pallas.ops.gpu.paged_attention), reading the pools in place.

The kernel takes the pools in the paged cache's one layout, [K, N, P, H] (the TPU kernel's too,
jaxrl.backends.tpu.paged): one program per (slot, KV head, group of query heads, split of the
page table), each walking its pages up to the slot's length with a running softmax, the splits
combined at the end (flash decoding). Checked against XLA's gather path in Pallas's interpreter
on CPU (tests/test_paged_kernels.py) and, compiled by Triton, on an H200 (tools/gpu_kernels.py),
where a Qwen3-0.6B rollout at batch 64 through it ran at 17.5% of the HBM roofline against the
dense cache's 43.8%: its block sizes are untuned (docs/guides/kernels.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl.backends.sharded import largest_divisor, paged_lengths

MAX_SPLITS = 16  # the kernel's default k_splits: partitions of a slot's table run in parallel
MAX_BLOCK_PAGES = 8  # the kernel's default pages_per_compute_block
BLOCK_H = 16  # query heads per program: the kernel's minimum (Triton's smallest dot)


def takes(head_dim: int, dtype, page_size: int) -> bool:
  """Whether the kernel takes a decode call: a power-of-two head_dim of at least 16 and pages of
  a power of two of at least 16 positions (Triton's block shapes are powers of two, its
  smallest dot 16), a float dtype."""
  def pow2(n):
    return n >= 16 and n & (n - 1) == 0
  return (pow2(head_dim) and pow2(page_size)
          and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16, jnp.float16))


def blocks(pages_per_slot: int) -> tuple[int, int]:
  """(k_splits, pages_per_compute_block) for a table of this many pages: the most splits (up to
  16) that divide it, then the largest power of two (up to 8 pages) that divides a split, so a
  compute block (pages x P positions) stays a power of two for Triton."""
  splits = largest_divisor(pages_per_slot, MAX_SPLITS)
  per_split = pages_per_slot // splits
  block = max(b for b in (1, 2, 4, 8) if b <= MAX_BLOCK_PAGES and per_split % b == 0)
  return splits, block


def paged_decode(q_bkgh, keys_knph, values_knph, pages_bn, pos_b, *, interpret: bool = False):
  """As jaxrl.backends.tpu.paged.paged_decode, by the Pallas GPU kernel: q [B, K, G, H] to
  slot b's positions <= pos_b[b] of the pools [K, N, P, H] through pages_bn [B, n]:
  [B, K, G, H] in q's dtype. interpret: Pallas's interpreter (CPU tests)."""
  # Imported here, as the learner's GPU kernel is: most jaxrl processes never run on a GPU.
  from jax.experimental.pallas.ops.gpu import paged_attention as pallas_gpu  # noqa: PLC0415
  B, K, G, H = q_bkgh.shape
  P = keys_knph.shape[2]
  n = pages_bn.shape[1]
  splits, block = blocks(n)
  q = (q_bkgh * jnp.asarray(H**-0.5, q_bkgh.dtype)).reshape(B, K * G, H)
  # Triton's dots take one dtype: a no-op when the cache is in the model's dtype (the engine's
  # default); a pool in another dtype would be copied whole each step.
  out = pallas_gpu.paged_attention(
      q, keys_knph.astype(q.dtype), values_knph.astype(q.dtype),
      jnp.maximum(pages_bn, 0).astype(jnp.int32), paged_lengths(pos_b, n, P),
      block_h=BLOCK_H, pages_per_compute_block=block, k_splits=splits, interpret=interpret)
  return out.reshape(B, K, G, H).astype(q_bkgh.dtype)
