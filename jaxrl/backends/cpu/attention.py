"""jaxrl's CPU attention kernels (csrc/, built and registered by build.py) as JAX functions,
called through XLA's FFI: the sampler's decode step, and the learner's full-sequence attention
with its gradient under a custom VJP. Each equals XLA's attention (jaxrl.models.attention) to
float rounding (tests/test_decode_attention.py, tests/test_learner_attention.py); the figures
are in benchmarks/README.md.

Decode. A batch-64 decode step of the bench preset spends about a quarter of its time in
attention: per layer and (slot, KV head), a 2 x 64 x S product for the logits, a masked softmax
over [B, K, G, S], and a 2 x S x 64 product for the values, each its own kernel at
~15 GFLOP/s. The kernel reads each cached key and value row once, only up to the slot's
position, and shares the (slot, KV head) pairs with XLA's intra-op threads.

Learner. Every full-sequence forward of the model (train steps, the reference and reward
forwards, DPO's and SFT's) computes grouped-query attention as batched products per (row, KV
head) with a masked softmax between them. On the GRPO anchor (bench preset, 64 rows of 63
completion tokens after a 16-token prompt) XLA:CPU ran those products at ~35 GFLOP/s, and the
softmax, its gradient and the transposes around the products were further passes over
[B, K, G*T, S]. The kernels keep one (row, KV head) pair's queries, keys, values and
probabilities in the core's caches, and the backward recomputes the probabilities (as flash
attention does) instead of keeping them.

Both handle float32 only, with head_dim a multiple of 8 (up to 256 for decoding); the sharded
functions return None for anything else, which leaves it to XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl.backends.sharded import divides, row_and_kv_axes

DECODE = "jaxrl_decode_attention"
FORWARD = "jaxrl_learner_attention"
BACKWARD = "jaxrl_learner_attention_grad"


# ----------------------------------------------------------------------------- decode


def decode(q_bkgh, keys_bksh, values_bksh, pos_b):
  """Attention of slot b's queries q_bkgh[b] to its cached positions 0..pos_b[b]: [B, K, G, H]
  float32. Runs on the devices' own shards; see decode_sharded for a sharded cache."""
  return jax.ffi.ffi_call(DECODE, jax.ShapeDtypeStruct(q_bkgh.shape, jnp.float32),
                          vmap_method="sequential")(
                              q_bkgh, keys_bksh, values_bksh, pos_b.astype(jnp.int32))


def handles_decode(dtype, head_dim: int) -> bool:
  """Whether the decode kernel handles this compute dtype and head_dim."""
  return jnp.dtype(dtype) == jnp.float32 and head_dim % 8 == 0 and head_dim <= 256


def decode_sharded(mesh, cache_spec: P):
  """decode as a function of (q [B, K, G, H], keys, values [B, K, S, H], pos [B]) for a cache
  laid out as `cache_spec` on `mesh`, returning None for inputs it does not handle. On a mesh
  of several devices each device runs it on its own slots and KV heads (shard_map), with no
  communication."""
  fn = decode
  if mesh.devices.size > 1:
    b, k = (tuple(cache_spec) + (None, None))[:2]
    spec4 = P(b, k, None, None)
    fn = jax.shard_map(decode, mesh=mesh, in_specs=(spec4, spec4, spec4, P(b)),
                       out_specs=spec4, check_vma=False)
  return lambda q, *rest: fn(q, *rest) if handles_decode(q.dtype, q.shape[-1]) else None


# ----------------------------------------------------------------------------- learner


def _forward(q_btkgh, keys_bksh, values_bksh, mask_bts):
  return jax.ffi.ffi_call(FORWARD, jax.ShapeDtypeStruct(q_btkgh.shape, jnp.float32),
                          vmap_method="sequential")(q_btkgh, keys_bksh, values_bksh, mask_bts)


@jax.custom_vjp
def learner(q_btkgh, keys_bksh, values_bksh, mask_bts):
  """Attention of q [B, T, K, G, H] (the G query heads of each KV head, as the projection lays
  them out) to keys and values [B, K, S, H], position t attending to the keys s with
  mask_bts[b, t, s] (a position with none: uniformly to all S), logits scaled by H^-1/2:
  [B, T, K, G, H] float32. Runs on the devices' own shards; see learner_sharded for a sharded
  batch."""
  return _forward(q_btkgh, keys_bksh, values_bksh, mask_bts)


def _learner_fwd(q_btkgh, keys_bksh, values_bksh, mask_bts):
  return _forward(q_btkgh, keys_bksh, values_bksh, mask_bts), (q_btkgh, keys_bksh, values_bksh,
                                                               mask_bts)


def _learner_bwd(residuals, d_out_btkgh):
  q_btkgh, keys_bksh, values_bksh, mask_bts = residuals
  f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)  # noqa: E731
  d_q, d_k, d_v = jax.ffi.ffi_call(BACKWARD, (f32(q_btkgh), f32(keys_bksh), f32(values_bksh)),
                                   vmap_method="sequential")(
                                       q_btkgh, keys_bksh, values_bksh, mask_bts, d_out_btkgh)
  return d_q, d_k, d_v, None


learner.defvjp(_learner_fwd, _learner_bwd)


def handles_learner(dtype, head_dim: int) -> bool:
  """Whether the learner's kernels handle this compute dtype and head_dim."""
  return jnp.dtype(dtype) == jnp.float32 and head_dim % 8 == 0


def learner_sharded(mesh, *, batch, kv_heads):
  """learner as a function of (q, keys, values, mask, causal=None) for full-sequence programs
  traced on `mesh`, whose rows are split over the `batch` mesh axes and KV heads over `kv_heads` (a
  layout's rules: an axis name, a tuple of them or None). The function returns None (XLA's
  attention) for inputs the kernels do not handle (handles_learner). On a mesh of several
  devices each device runs it on its own rows and KV heads, with no communication; a batch or
  KV-head count those axes do not divide also gets None."""
  # `causal` (what the mask is made of, jaxrl.models.attention.Causal) is not read: the kernels
  # take any mask as the dense array.
  if mesh.devices.size == 1:
    return lambda q, k, v, mask, causal=None: (
        learner(q, k, v, mask) if handles_learner(q.dtype, q.shape[-1]) else None)

  axes = row_and_kv_axes(mesh, batch=batch, kv_heads=kv_heads)
  if axes is None:
    return lambda *args: None
  rows, kv = axes

  def sharded(q_btkgh, keys_bksh, values_bksh, mask_bts, causal=None):
    del causal
    if (not handles_learner(q_btkgh.dtype, q_btkgh.shape[-1])
        or not divides(mesh, rows, kv, q_btkgh)):
      return None
    q_spec, kv_spec = P(rows, None, kv, None, None), P(rows, kv, None, None)
    return jax.shard_map(learner, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec,
                                                       P(rows, None, None)),
                         out_specs=q_spec, check_vma=False)(
                             q_btkgh, keys_bksh, values_bksh, mask_bts)

  return sharded
