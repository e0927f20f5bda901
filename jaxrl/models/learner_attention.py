"""The learner's full-sequence attention on CPU as C++ kernels (learner_attention.cc), forward
and gradient, called through XLA's FFI under a custom VJP.

Every full-sequence forward of the model (train steps, the reference and reward forwards, DPO's
and SFT's) computes grouped-query attention as batched products per (row, KV head) with a
masked softmax between them. On the GRPO anchor (bench preset, 64 rows of 63 completion tokens
after a 16-token prompt) XLA:CPU ran those products at ~35 GFLOP/s, and the softmax, its
gradient and the transposes around the products were further passes over [B, K, G*T, S]. The
kernels keep one (row, KV head) pair's queries, keys, values and probabilities in the core's
caches, and the backward recomputes the probabilities (as flash attention does) instead of
keeping them. Their results equal XLA's to float rounding (tests/test_learner_attention.py);
the figures are in the README's Benchmarks.

The library is jaxrl.models.decode_attention's (built on first use, cached, JAXRL_CPU_KERNELS=0
switches it off). jaxrl.parallel.layouts.shard_activations traces the learner's programs with
`for_mesh`'s function, so it applies on CPU meshes only, to float32 models; everywhere else the
model keeps XLA's attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrl.models import decode_attention
from jaxrl.parallel.cpu_kernels import on_cpu

FORWARD = "jaxrl_learner_attention"
BACKWARD = "jaxrl_learner_attention_grad"


def _forward(q_btkgh, keys_bksh, values_bksh, mask_bts):
  return jax.ffi.ffi_call(FORWARD, jax.ShapeDtypeStruct(q_btkgh.shape, jnp.float32),
                          vmap_method="sequential")(q_btkgh, keys_bksh, values_bksh, mask_bts)


@jax.custom_vjp
def kernel(q_btkgh, keys_bksh, values_bksh, mask_bts):
  """Attention of q [B, T, K, G, H] (the G query heads of each KV head, as the projection lays
  them out) to keys and values [B, K, S, H], position t attending to the keys s with
  mask_bts[b, t, s] (a position with none: uniformly to all S), logits scaled by H^-1/2:
  [B, T, K, G, H] float32. Runs on the devices' own shards; see for_mesh for a sharded batch."""
  return _forward(q_btkgh, keys_bksh, values_bksh, mask_bts)


def _kernel_fwd(q_btkgh, keys_bksh, values_bksh, mask_bts):
  return _forward(q_btkgh, keys_bksh, values_bksh, mask_bts), (q_btkgh, keys_bksh, values_bksh,
                                                               mask_bts)


def _kernel_bwd(residuals, d_out_btkgh):
  q_btkgh, keys_bksh, values_bksh, mask_bts = residuals
  f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)  # noqa: E731
  d_q, d_k, d_v = jax.ffi.ffi_call(BACKWARD, (f32(q_btkgh), f32(keys_bksh), f32(values_bksh)),
                                   vmap_method="sequential")(
                                       q_btkgh, keys_bksh, values_bksh, mask_bts, d_out_btkgh)
  return d_q, d_k, d_v, None


kernel.defvjp(_kernel_fwd, _kernel_bwd)


def _handles(dtype, head_dim: int) -> bool:
  return jnp.dtype(dtype) == jnp.float32 and head_dim % 8 == 0


def supports(cfg) -> bool:
  """Whether the kernels handle this model config (float32 compute, head_dim a multiple of 8)."""
  return _handles(cfg.dtype, cfg.head_dim)


def for_mesh(mesh, layout: str = "learner"):
  """The kernel as a function of (q, keys, values, mask) for full-sequence programs traced on
  `mesh`, or None where XLA's attention stays: off CPU, with JAXRL_CPU_KERNELS=0, or when the
  library could not be built. The function returns None (XLA's attention) for inputs the
  kernels do not handle (see supports). On a mesh of several devices each device runs it on its
  own rows (the layout's batch axes) and KV heads (its kv_heads axis), with no communication;
  a batch or KV-head count those axes do not divide also gets None."""
  if not on_cpu(mesh.devices.flat) or not decode_attention.available():
    return None
  if mesh.devices.size == 1:
    return lambda q, *rest: kernel(q, *rest) if _handles(q.dtype, q.shape[-1]) else None
  from jaxrl.parallel.layouts import get_rules  # noqa: PLC0415 (layouts imports the model)
  rules = get_rules(layout)

  def names(rule):
    return tuple(a for a in ((rule,) if isinstance(rule, str) else rule or ())
                 if a in mesh.shape)

  batch, kv = names(rules["batch"]), names(rules["kv_heads"])
  # Every mesh axis is named in the specs (size-1 ones with the rows): an axis a shard_map
  # leaves out is one its transpose sums the gradients over.
  rows = batch + tuple(a for a in mesh.axis_names
                       if mesh.shape[a] == 1 and a not in batch + kv)
  ways = lambda axes: int(np.prod([mesh.shape[a] for a in axes]))  # noqa: E731
  if set(mesh.axis_names) - set(rows + kv):
    return lambda *args: None

  def sharded(q_btkgh, keys_bksh, values_bksh, mask_bts):
    if (not _handles(q_btkgh.dtype, q_btkgh.shape[-1]) or q_btkgh.shape[0] % ways(rows)
        or q_btkgh.shape[2] % ways(kv)):
      return None
    q_spec, kv_spec = P(rows, None, kv, None, None), P(rows, kv, None, None)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec,
                                                      P(rows, None, None)),
                         out_specs=q_spec, check_vma=False)(
                             q_btkgh, keys_bksh, values_bksh, mask_bts)

  return sharded
