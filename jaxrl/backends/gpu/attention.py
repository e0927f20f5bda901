"""Flash attention for the learner's full-sequence calls on GPU, forward and gradient: the
Pallas (Triton) kernel jax ships (jax.experimental.pallas.ops.gpu.attention.mha), or cuDNN's
fused attention through jax.nn.dot_product_attention(implementation="cudnn").

Pallas mha takes what the learner's rows need: any float dtype, causal masking, packed rows'
segment ids, and a backward kernel that recomputes the probabilities from the saved
log-sum-exp; it runs in Pallas's interpreter on CPU, where tests/test_kernels.py checks it
against XLA's attention. It takes one segment-id array for queries and keys, so the keys are
the queries' own positions (S = T): a GRPO group's completions against their shared prompt
(S > T) stay with XLA. It has no grouped-query form, so each KV head is repeated for its G
query heads (K*G*S*H elements, far below the [K*G, T, S] scores it replaces).

cuDNN takes bfloat16 and float16 only, and through jax.nn no segment ids: plain causal rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _padded_len(n: int) -> int:
  """A length the Pallas kernel's blocks divide: a power of two from 16 (Triton's smallest dot)
  up to 128, then multiples of 128 (its default block)."""
  if n > 128:
    return -(-n // 128) * 128
  return max(16, 1 << (n - 1).bit_length())


def pallas_attention(q_btkgh, keys_bksh, values_bksh, q_segment_ids=None, kv_segment_ids=None,
                     *, interpret: bool = False):
  """Attention of q [B, T, K, G, H] to its own positions' keys and values [B, K, T, H], causal
  within segments (segment ids [B, T] or None; jaxrl.models.attention.Causal with S = T),
  logits scaled by H^-1/2: [B, T, K, G, H] in q's dtype. kv_segment_ids are read as the same
  ids (handles_pallas says which calls it takes). One device's rows
  (jaxrl.backends.sharded.per_device); interpret: Pallas's interpreter (CPU tests)."""
  # Imported here: jax 0.12 warns on importing it (deprecated in favour of tokamax), and
  # every jaxrl process imports this backend, most of them never on a GPU.
  from jax.experimental.pallas.ops.gpu import attention as pallas_gpu  # noqa: PLC0415
  B, T, K, G, H = q_btkgh.shape
  del kv_segment_ids  # the same ids as the queries' (handles_pallas)
  pad = _padded_len(T) - T
  q = jnp.pad(q_btkgh.reshape(B, T, K * G, H), ((0, 0), (0, pad), (0, 0), (0, 0)))
  # [B, K, T, H] -> [B, T, K*G, H]: head k * G + g reads KV head k, as the model lays q out.
  kv = [jnp.pad(jnp.repeat(x.transpose(0, 2, 1, 3), G, axis=2), ((0, 0), (0, pad), (0, 0),
                                                                  (0, 0)))
        for x in (keys_bksh, values_bksh)]
  seg = q_segment_ids
  if seg is not None:
    # The padded positions keep the last real segment: each padded query sees a real key (its
    # output is dropped), and no real query sees a padded key (they lie past it, causally).
    seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, pad)), mode="edge")
  out = pallas_gpu.mha(q, *kv, seg, sm_scale=H**-0.5, causal=True, interpret=interpret)
  return out[:, :T].reshape(B, T, K, G, H).astype(q_btkgh.dtype)


def handles_pallas(q_segment_ids, kv_segment_ids, q_len: int, kv_len: int) -> bool:
  """Whether the Pallas kernel takes the call: the keys are the queries' own positions, and one
  array gives both segment ids (the model passes the same one twice: Causal(ids, ids))."""
  return q_len == kv_len and q_segment_ids is kv_segment_ids


def handles_cudnn(dtype, q_segment_ids, kv_segment_ids, q_len: int, kv_len: int) -> bool:
  """Whether cuDNN's fused attention takes the call through jax.nn: half precision, one
  segment, the keys the queries' own positions."""
  return (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and q_segment_ids is None
          and kv_segment_ids is None and q_len == kv_len)


def cudnn_attention(q_btkgh, keys_bksh, values_bksh, q_segment_ids=None, kv_segment_ids=None):
  """As pallas_attention, by cuDNN (jax.nn.dot_product_attention, grouped-query heads its own),
  for the calls handles_cudnn says it takes."""
  del q_segment_ids, kv_segment_ids  # none (handles_cudnn)
  B, T, K, G, H = q_btkgh.shape
  k, v = (x.transpose(0, 2, 1, 3) for x in (keys_bksh, values_bksh))  # [B, S, K, H]
  out = jax.nn.dot_product_attention(q_btkgh.reshape(B, T, K * G, H), k, v, is_causal=True,
                                     implementation="cudnn")
  return out.reshape(B, T, K, G, H)
