"""Decode attention over the paged KV cache on TPU: jax's Pallas TPU paged attention kernel
(jax.experimental.pallas.ops.tpu.paged_attention), reading the pools in place.

The kernel walks each slot's page table and DMAs only the pages up to the slot's length
(`lengths`), `pages_per_compute_block` pages at a time, into VMEM, with a flash-style running
softmax over them; grouped-query heads are its own (q head h reads KV head h // G, the order
the model's projection has). XLA's gather path (jaxrl.models.attention.xla_paged_decode_attention)
instead copies every slot's whole table, n * P positions, out of the pool first.

Why this kernel and not ragged_paged_attention (jax 0.12), which the issue named:
  - the ragged kernel wants keys and values interleaved in one pool [N, P, 2K, H], which the GPU
    kernel does not read; this one reads [K, N, P, H] pools, the same layout as the GPU's
    (jax.experimental.pallas.ops.gpu.paged_attention), so the paged cache has one layout;
  - the ragged kernel does not run in Pallas's interpreter in jax 0.12 (the TPU interpret mode
    fails on its reshaped VMEM ref, the HLO interpreter on its masked store), so it could not be
    checked against the gather path on CPU; this one runs there (tests/test_paged_kernels.py);
  - the ragged kernel's gain is mixed prefill and decode in one call; jaxrl's engine prefills
    densely and writes the pages at insert, so the paged call is always one query per slot:
    exactly the decode-only kernel's form.

Limits (checked by takes; other calls go to the gather path): head_dim a multiple of 128 (the
Mosaic lowering's lane tiling: compiled for v5e, head_dim 32 fails to lower; Qwen3, Llama 3 and
Qwen2.5-7B have 128), float32 or bfloat16.

Precision: the kernel casts the keys and values it loads to bfloat16 (jax 0.12,
MultiPageAsyncCopyDescriptor._maybe_dequantize), then multiplies with float32 accumulation. For
a bfloat16 cache that is exact; for a float32 one it rounds the operands as a TPU's
default-precision product does (one bfloat16 pass), so a float32 rollout through it is not
bit-equal to XLA's gather path on CPU (tests/test_paged_kernels.py checks it against the gather
path over bfloat16-rounded pools).
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

from jaxrl.backends.sharded import largest_divisor, paged_lengths

LANES = 128
MAX_BLOCK_POSITIONS = 512  # positions per compute block: up to 32 pages of 16


def takes(head_dim: int, dtype) -> bool:
  """Whether the kernel takes a decode call of this head_dim and dtype (see the module doc)."""
  return head_dim % LANES == 0 and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def pages_per_block(pages_per_slot: int, page_size: int) -> int:
  """The kernel's compute block: the most pages, at most MAX_BLOCK_POSITIONS positions, that
  divide a slot's table (the kernel requires a divisor)."""
  return largest_divisor(pages_per_slot, max(1, MAX_BLOCK_POSITIONS // page_size))


def paged_decode(q_bkgh, keys_knph, values_knph, pages_bn, pos_b, *, interpret: bool = False):
  """Decode attention of q [B, K, G, H] to slot b's positions <= pos_b[b] of the pools keys and
  values [K, N, P, H] through its page table pages_bn [B, n] (-1: no page), logits scaled by
  H^-1/2: [B, K, G, H] in q's dtype. One device's slots and KV heads
  (jaxrl.backends.sharded.per_device_paged); interpret: Pallas's TPU interpreter (CPU tests)."""
  B, K, G, H = q_bkgh.shape
  _, _, P, _ = keys_knph.shape
  n = pages_bn.shape[1]
  # The kernel does not scale the logits; scaling q first is the same product.
  q = (q_bkgh * jnp.asarray(H**-0.5, q_bkgh.dtype)).reshape(B, K * G, H)
  # An unheld page (-1) is past the slot's length, so never read; 0 keeps the index in range.
  page_indices = jnp.maximum(pages_bn, 0).astype(jnp.int32)
  mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
  with mode:
    # The pools as stored, float32 or bfloat16: the kernel reads keys and values as bfloat16
    # whatever their dtype (its own cast, after the DMA into VMEM).
    out = paged_attention(q, keys_knph, values_knph, paged_lengths(pos_b, n, P), page_indices,
                          pages_per_compute_block=pages_per_block(n, P))
  return out.reshape(B, K, G, H).astype(q_bkgh.dtype)
