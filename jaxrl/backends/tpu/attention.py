"""Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) as the learner's
full-sequence attention on TPU, forward and gradient.

Splash is flash attention for TPU with a block-sparse mask: it walks the [T, S] score matrix in
[block_q, block_kv] tiles, skips the tiles the mask empties (above the causal diagonal: about
half), and keeps one tile of float32 scores in VMEM, so the [B, K, G*T, S] float32 scores of
XLA's attention (jaxrl.models.attention.xla_attention) are never written to HBM. Its backward
recomputes the probabilities from the saved log-sum-exp, as flash attention does.

The mask comes by structure (jaxrl.models.attention.Causal): a CausalMask whose offset puts the
T queries at the end of the S keys (0 for a training row; the prompt's length for a GRPO
group's completions against their shared prompt), and-ed with segment ids (packed rows; a
prompt's padding). Grouped-query attention is the kernel's own: the K*G query heads, each KV
head's G together, against K key and value heads (head n reads KV head n // G).

Splash takes blocks of at least 128 (the TPU's lanes: for the keys always, for the queries
with segment ids), so T and S are padded up to multiples of 128: the padded keys lie past every
real query's causal reach, and the padded queries (whose outputs are dropped, so no gradient
reaches them) keep the last real query's segment and so at least one key each. Below one kv
block (S < 128) the backend leaves the call to XLA (takes): there the padding would cost more
than the [T, S] scores it saves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

LANES = 128  # splash's smallest kv block: the TPU vector unit's lane count
BLOCKS = (512, 256, 128)  # largest first: MaxText's default tile is 512 x 512


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _block(n: int) -> int:
  return next(b for b in BLOCKS if n % b == 0)


def takes(q_len: int, kv_len: int) -> bool:
  """Whether splash takes a call of q_len queries against kv_len keys (see the module doc)."""
  return kv_len >= LANES and q_len <= kv_len


def padded_lengths(q_len: int, kv_len: int) -> tuple[int, int]:
  """The lengths splash runs a call at: multiples of 128."""
  return _round_up(q_len, LANES), _round_up(kv_len, LANES)


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, q_len: int, kv_len: int, offset: int, interpret: bool):
  """The splash kernel for one row's [heads, q_len, H] queries (padded_lengths) against
  [K, kv_len, H] keys, query t at key position t + offset. Cached: the block mask is
  numpy work per shape, done once per program shape rather than per layer."""
  bq, bkv = _block(q_len), _block(kv_len)
  sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                            block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                            block_q_dq=bq, block_kv_dq=bkv)
  mask = splash.MultiHeadMask([splash.CausalMask((q_len, kv_len), offset=offset)] * heads)
  # Its block mask as concrete arrays (constants of every program), not tracers of the first
  # program that asked: the kernel is cached across traces.
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def splash_attention(q_btkgh, keys_bksh, values_bksh, q_segment_ids=None, kv_segment_ids=None,
                     *, interpret: bool = False):
  """Attention of q [B, T, K, G, H] to keys and values [B, K, S, H] with the mask of
  jaxrl.models.attention.Causal (segment ids [B, T] and [B, S], or None: one segment), logits
  scaled by H^-1/2: [B, T, K, G, H] in q's dtype. One device's rows (see per_device);
  interpret: Pallas's interpreter (CPU tests) instead of Mosaic."""
  B, T, K, G, H = q_btkgh.shape
  S = keys_bksh.shape[2]
  t_pad, s_pad = padded_lengths(T, S)
  # Splash does not scale the logits; scaling q first is the same product.
  q = (q_btkgh * jnp.asarray(H**-0.5, q_btkgh.dtype)).transpose(0, 2, 3, 1, 4)
  q = q.reshape(B, K * G, T, H)  # head k * G + g reads KV head k
  q = jnp.pad(q, ((0, 0), (0, 0), (0, t_pad - T), (0, 0)))
  pad_s = ((0, 0), (0, 0), (0, s_pad - S), (0, 0))
  k, v = jnp.pad(keys_bksh, pad_s), jnp.pad(values_bksh, pad_s)
  kernel = _kernel(K * G, t_pad, s_pad, S - T, interpret)
  if q_segment_ids is None and kv_segment_ids is None:
    out = jax.vmap(kernel)(q, k, v)
  else:
    q_seg = jnp.zeros((B, T), jnp.int32) if q_segment_ids is None else q_segment_ids
    kv_seg = jnp.zeros((B, S), jnp.int32) if kv_segment_ids is None else kv_segment_ids
    ids = splash.SegmentIds(
        q=jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, t_pad - T)), mode="edge"),
        kv=jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, s_pad - S)), mode="edge"))
    out = jax.vmap(kernel)(q, k, v, ids)
  out = out[:, :, :T].reshape(B, K, G, T, H)
  return out.transpose(0, 3, 1, 2, 4)
