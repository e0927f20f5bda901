"""The model's attention, and the one place where a backend's kernels plug in.

jaxrl.models.llama calls `attention` for every forward over several positions (training,
scoring, prefill) and `decode_attention` for the sampler's one-token decode steps. Each runs
XLA's implementation below (batched products and a masked softmax, on every platform) unless
the program is traced inside `tracing(...)` with a kernel that jaxrl.backends chose for its
mesh: today the C++ kernels on CPU. A TPU splash or GPU cuDNN kernel plugs in at
jaxrl.backends the same way, and llama.py does not change. A kernel returns None for inputs it
does not handle, and those get XLA's attention.

Why a scope and not an argument: a kernel runs per device under shard_map, so it needs the mesh
and the layout's axes, which the model does not have (its layers never name mesh axes), and it
is chosen while jax traces the layers. So the code that builds a program sets it, in one `with`
around the traced function:

  jaxrl.parallel.shard_activations   learner programs: rows pinned, the full-sequence kernel
  jaxrl.sampler.Engine               decode steps: the decode kernel (dense cache) or the
                                     paged decode kernel (paged cache)

The same scope carries the residual stream's row sharding (pin_rows), for the same reason.
Anything traced outside a scope gets XLA's attention and unpinned rows.

A full-sequence call may also say what its mask is made of (Causal): causal with the queries
at the end of the keys, within segments. A kernel that takes masks by structure rather than as
a [B, T, S] array (TPU splash, GPU flash attention: jaxrl.backends) needs that, and returns
None for calls without it (the cached forwards of the sampler, whose mask is by position).

Shapes use letters: B batch (or decode slots), T new tokens, S keys (cache length), K kv heads,
G query heads per kv head, H head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl import backends


class Causal(NamedTuple):
  """What a full-sequence mask [B, T, S] is made of: query t sits at key position t + S - T
  (the queries are the keys' last T), and attends to the keys s <= t + S - T whose segment id
  equals its own: mask[b, t, s] = s <= t + S - T and q_segment_ids[b, t] ==
  kv_segment_ids[b, s]. Segment ids None: one segment. The model passes it beside the dense
  mask it builds from the same arrays, so a kernel may read either. Every query keeps at least
  its own key (its diagonal), so no row is empty."""
  q_segment_ids: jax.Array | None = None  # [B, T] int32
  kv_segment_ids: jax.Array | None = None  # [B, S] int32


class Tracing(NamedTuple):
  """What a program is traced with, beyond its arrays (see tracing)."""
  # [B, ...] -> [B, ...]: the residual stream's sharding constraint, applied after the embedding
  # and after each block (jaxrl.parallel.activation_sharding: rows over the batch axes). Without
  # the pin, GSPMD propagated the learner layout's parameters, whose embed dimension is split
  # over the same axes as the batch, into the activations: every device ran the whole batch on
  # its D-slice and all-reduced each product's output (the bench preset, B x T = 64 x 128 on
  # fsdp=8: 347 MiB of all-reduce per step instead of 17 MiB of weight all-gathers, 4x the step
  # time; tests/test_sharding.py counts them).
  pin_rows: Callable | None = None
  # (q [B, T, K, G, H], keys, values [B, K, S, H], mask [B, T, S], causal: Causal | None)
  # -> [B, T, K, G, H] or None.
  attention: Callable | None = None
  # (q [B, K, G, H], keys, values [B, K, S, H], pos [B]) -> [B, K, G, H] or None.
  decode: Callable | None = None
  # (q [B, K, G, H], key and value pools [K, N, P, H], pages [B, n], pos [B]) -> [B, K, G, H]
  # or None: the paged cache's decode step (paged_decode_attention).
  paged: Callable | None = None
  # A decode step's q, k and v (and the MLP's gate and up) from one product against their
  # weights joined (True, the default and the CPU's choice) or one product per weight
  # (jaxrl.backends.joins_decode_weights).
  join_weights: bool = True
  # A decode step's rotary half swap as a product with a permutation matrix (True, the TPU's
  # choice: jaxrl.backends.decode_on_matrix_unit) or a concatenate of the halves (False).
  rope_matmul: bool = False
  # A decode step writes the dense cache one (slot, KV head) row at a time (True, the TPU's
  # choice: jaxrl.backends.writes_cache_per_head) or one [K, H] window per slot (False).
  write_per_head: bool = False


_TRACING: contextvars.ContextVar[Tracing] = contextvars.ContextVar("jaxrl_tracing",
                                                                  default=Tracing())


@contextlib.contextmanager
def tracing(*, pin_rows=None, attention=None, decode=None, paged=None, join_weights=True,
            rope_matmul=False, write_per_head=False):
  """While tracing inside this scope, the model pins its residual stream's rows with `pin_rows`
  and calls the `attention`, `decode` and `paged` (decode over a paged cache) kernels (each
  None: XLA's); a decode step joins its q, k and v weights into one product, and the MLP's gate
  and up into another, if `join_weights`, and swaps rotary halves by a product if
  `rope_matmul`, and writes the dense cache per KV head if `write_per_head`. The scope sets all
  seven: an inner scope does not inherit an outer one's."""
  token = _TRACING.set(Tracing(pin_rows, attention, decode, paged, join_weights, rope_matmul,
                               write_per_head))
  try:
    yield
  finally:
    _TRACING.reset(token)


def attention_kernel(mesh, *, batch, kv_heads):
  """The selected backend's full-sequence kernel for a program on `mesh` whose rows are split
  over the `batch` mesh axes and KV heads over `kv_heads`, or None (jaxrl.backends)."""
  return backends.attention_kernel(mesh, batch=batch, kv_heads=kv_heads)


def decode_kernel(mesh, cache_spec):
  """The selected backend's decode-step kernel for a KV cache laid out as `cache_spec` on
  `mesh`, or None (jaxrl.backends)."""
  return backends.decode_kernel(mesh, cache_spec)


def paged_decode_kernel(mesh, cache_spec):
  """The selected backend's decode-step kernel over a paged cache, for a sampler whose dense
  cache would be laid out as `cache_spec` [B, K, W, H] on `mesh` (slots over its first axes,
  KV heads over its second), or None (jaxrl.backends)."""
  return backends.paged_decode_kernel(mesh, cache_spec)


def join_weights() -> bool:
  """Whether the scope's decode steps join their projections' weights (see Tracing)."""
  return _TRACING.get().join_weights


def write_per_head() -> bool:
  """Whether the scope's decode steps write the dense cache per KV head (see Tracing)."""
  return _TRACING.get().write_per_head


def rope_matmul() -> bool:
  """Whether the scope's rotary embedding swaps halves by a product (see Tracing)."""
  return _TRACING.get().rope_matmul


def pin_rows(x):
  """x [B, ...] through the scope's row sharding constraint (unchanged outside a scope)."""
  constrain = _TRACING.get().pin_rows
  return x if constrain is None else constrain(x)


def attention(q_btkgh, keys_bksh, values_bksh, mask_bts, causal: Causal | None = None):
  """Attention over several positions: q [B, T, K, G, H] to keys and values [B, K, S, H],
  position t attending to the keys s with mask_bts[b, t, s]: [B, T, K, G, H]. `causal`: what
  the mask is made of, when it is causal within segments (see Causal); None: only the dense
  mask says. The scope's kernel where it takes the call (q and out in the projections' layout,
  no transposes), else xla_attention."""
  kernel = _TRACING.get().attention
  out_btkgh = None if kernel is None else kernel(q_btkgh, keys_bksh, values_bksh, mask_bts,
                                                 causal)
  if out_btkgh is None:
    out_btkgh = xla_attention(q_btkgh, keys_bksh, values_bksh, mask_bts)
  return out_btkgh


def decode_attention(q_bkgh, keys_bksh, values_bksh, pos_b):
  """A decode step's attention: slot b's G query heads per KV head, q [B, K, G, H], attend to
  its cache positions <= pos_b[b] of keys and values [B, K, S, H]: [B, K, G, H]. The scope's
  kernel where it takes the call, else xla_decode_attention."""
  kernel = _TRACING.get().decode
  out_bkgh = None if kernel is None else kernel(q_bkgh, keys_bksh, values_bksh, pos_b)
  if out_bkgh is None:
    out_bkgh = xla_decode_attention(q_bkgh, keys_bksh, values_bksh, pos_b)
  return out_bkgh


def paged_write(pool_knph, page_b, off_b, x_bkh):
  """The paged cache's one layout (jaxrl.sampler.paged): a layer's key or value pool is
  [K, N, P, H], KV head first, so that the TPU and GPU paged attention kernels read it in place.
  Returns the pool with slot b's new key or value x_bkh[b] at offset off_b[b] of page page_b[b]
  (page N or beyond: dropped).

  Written as a scatter into the pool viewed as [K, N * P, H] (a free reshape) at the index
  pairs (k, position), each update one row of H: written as pool[:, page_b, off_b] (updates
  [K, H] windows at two scattered dimensions), XLA:TPU wanted the pool laid out KV head next to
  minor for the scatter, and inside the decode scan, where it picks the loop-carried pools'
  layout, copied every pool into that layout and back to the kernel's row-major one twice per
  layer per step (v5e, Qwen3-0.6B at batch 64, 8 steps per call: 4.3 ms of copies per step,
  whose HBM roofline is 1.08 ms, and 0.81 GB of temporaries per chip;
  benchmarks/paged_decode_tpu.py --steps 8, docs/guides/kernels.md)."""
  K, N, P, H = pool_knph.shape
  pos_b = page_b * P + off_b  # page N or beyond: past the flat pool's N * P rows, dropped
  flat_kxh = pool_knph.reshape(K, N * P, H)
  out = flat_kxh.at[jnp.arange(K)[:, None], pos_b[None, :]].set(
      x_bkh.transpose(1, 0, 2).astype(pool_knph.dtype), mode="drop")
  return out.reshape(K, N, P, H)


def paged_decode_attention(q_bkgh, keys_knph, values_knph, pages_bn, pos_b):
  """decode_attention over a paged cache (jaxrl.sampler.paged): slot b's positions p <=
  pos_b[b] live at [:, pages_bn[b, p // P], p % P] of the pools keys and values [K, N, P, H]
  (-1 in pages_bn: no page; a slot fed a position pos >= n * P is idle, its output unused).
  The pools come as stored (their dtype may differ from q's: a kernel reads them in place).
  The scope's paged kernel where it takes the call (TPU and GPU Pallas paged attention,
  jaxrl.backends), else xla_paged_decode_attention."""
  kernel = _TRACING.get().paged
  out_bkgh = None if kernel is None else kernel(q_bkgh, keys_knph, values_knph, pages_bn, pos_b)
  if out_bkgh is None:
    out_bkgh = xla_paged_decode_attention(q_bkgh, keys_knph, values_knph, pages_bn, pos_b)
  return out_bkgh


def xla_paged_decode_attention(q_bkgh, keys_knph, values_knph, pages_bn, pos_b):
  """XLA's gather path for paged_decode_attention: each slot's pages are gathered into a
  [B, K, n * P, H] view (an unheld page, -1, reads page 0; it lies past pos_b, masked) and
  attended as the dense cache is, so the result is the dense cache's. It reads n * P positions
  per slot, its whole table; the kernels read each slot up to its own length."""
  B, n = pages_bn.shape
  K, _, P, H = keys_knph.shape
  idx_bn = jnp.maximum(pages_bn, 0)

  def view(pool_knph):  # [K, B, n, P, H] -> [B, K, n * P, H]
    return pool_knph[:, idx_bn].transpose(1, 0, 2, 3, 4).reshape(B, K, n * P, H)

  return xla_decode_attention(q_bkgh, view(keys_knph).astype(q_bkgh.dtype),
                              view(values_knph).astype(q_bkgh.dtype), pos_b)


def xla_attention(q_btkgh, keys_bksh, values_bksh, mask_bts):
  """XLA's attention over several positions (see attention), logits scaled by H^-1/2.

  Grouped-query attention as batched matmuls over (B, K): the G query heads that share a KV
  head are stacked into G*T rows against that head's S keys. (As one 5-D einsum over
  [B, T, K, G, H], XLA:CPU transposed around every dot: on the bench shape one layer's
  attention forward + backward took 29 ms, 16 ms as this.)"""
  B, T, K, G, H = q_btkgh.shape
  S = keys_bksh.shape[2]
  q_bkmh = q_btkgh.transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
  logits = jnp.einsum("BKMH,BKSH->BKMS", q_bkmh, keys_bksh, preferred_element_type=jnp.float32)
  logits = logits * H**-0.5
  mask_bms = jnp.broadcast_to(mask_bts[:, None], (B, G, T, S)).reshape(B, G * T, S)
  logits = jnp.where(mask_bms[:, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(q_btkgh.dtype)
  out = jnp.einsum("BKMS,BKSH->BKMH", probs, values_bksh)  # [B, K, G*T, H]
  return out.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4)


def xla_decode_attention(q_bkgh, keys_bksh, values_bksh, pos_b):
  """XLA's decode-step attention (see decode_attention), as batched matmuls over (B, K) that
  read the cache as stored."""
  S, head_dim = keys_bksh.shape[2], q_bkgh.shape[-1]
  logits_bkgs = jnp.einsum("BKGH,BKSH->BKGS", q_bkgh, keys_bksh,
                           preferred_element_type=jnp.float32) * head_dim**-0.5
  mask_bs = jnp.arange(S)[None, :] <= pos_b[:, None]
  logits_bkgs = jnp.where(mask_bs[:, None, None, :], logits_bkgs, jnp.finfo(jnp.float32).min)
  probs_bkgs = jax.nn.softmax(logits_bkgs, axis=-1).astype(q_bkgh.dtype)
  return jnp.einsum("BKGS,BKSH->BKGH", probs_bkgs, values_bksh)
