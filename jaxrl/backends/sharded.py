"""Running a full-sequence attention kernel, or a paged decode kernel, per device, for the TPU
and GPU backends.

A Pallas kernel is one device's program: under jit on a mesh it must run inside shard_map,
each device on its own rows and KV heads (the layout's `batch` and `kv_heads` rules), with no
communication: attention mixes neither rows nor KV heads. The CPU backend does the same for
its C++ kernels (cpu/attention.py); this is the form the structured kernels share, whose mask
comes as segment ids (jaxrl.models.attention.Causal) rather than a [B, T, S] array.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import PartitionSpec as P


def row_and_kv_axes(mesh, *, batch, kv_heads):
  """(row axes, KV-head axes) of `mesh` for a per-device attention kernel, from a layout's
  `batch` and `kv_heads` rules (an axis name, a tuple of them or None); None where some mesh
  axis is neither (e.g. a sequence axis). Every mesh axis is named in the specs, size-1 ones
  with the rows: an axis a shard_map leaves out is one its transpose sums the gradients over."""
  def names(rule):
    return tuple(a for a in ((rule,) if isinstance(rule, str) else rule or ())
                 if a in mesh.shape)

  batch, kv = names(batch), names(kv_heads)
  rows = batch + tuple(a for a in mesh.axis_names
                       if mesh.shape[a] == 1 and a not in batch + kv)
  if set(mesh.axis_names) - set(rows + kv):
    return None
  return rows, kv


def divides(mesh, rows, kv, q_btkgh) -> bool:
  """Whether the row and KV-head axes divide q [B, T, K, G, H]'s rows and KV heads."""
  ways = lambda axes: int(np.prod([mesh.shape[a] for a in axes]))  # noqa: E731
  return q_btkgh.shape[0] % ways(rows) == 0 and q_btkgh.shape[2] % ways(kv) == 0


def per_device(kernel, mesh, *, batch, kv_heads):
  """kernel(q [B, T, K, G, H], keys, values [B, K, S, H], q_segment_ids [B, T] | None,
  kv_segment_ids [B, S] | None) -> [B, T, K, G, H], run on each device's rows and KV heads
  of `mesh`. Returns fn(same arguments) -> the output, or None where the mesh's axes do not
  divide the batch or the KV heads (XLA's attention takes those calls)."""
  if mesh.devices.size == 1:
    return kernel

  axes = row_and_kv_axes(mesh, batch=batch, kv_heads=kv_heads)
  if axes is None:  # e.g. a sequence axis: not this kernel's form
    return lambda *args: None
  rows, kv = axes

  def sharded(q_btkgh, keys_bksh, values_bksh, q_segment_ids, kv_segment_ids):
    if not divides(mesh, rows, kv, q_btkgh):
      return None
    q_spec, kv_spec, seg = P(rows, None, kv, None, None), P(rows, kv, None, None), P(rows, None)
    if q_segment_ids is None:  # shard_map's specs follow the arguments' structure
      fn = lambda q, k, v: kernel(q, k, v, None, None)  # noqa: E731
      return shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                       check_vma=False)(q_btkgh, keys_bksh, values_bksh)
    return shard_map(kernel, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg, seg),
                     out_specs=q_spec, check_vma=False)(
                         q_btkgh, keys_bksh, values_bksh, q_segment_ids, kv_segment_ids)

  return sharded


def paged_lengths(pos_b, pages_per_slot: int, page_size: int):
  """The keys each slot reads: its positions 0..pos. A slot fed a position past its table
  (idle: the engine feeds n * P) reads one, so the kernel fetches one page for it, not its
  whole table; its output is not used."""
  return jnp.where(pos_b < pages_per_slot * page_size, pos_b + 1, 1).astype(jnp.int32)


def largest_divisor(n: int, most: int) -> int:
  """The largest divisor of n that is at most `most` (the paged kernels' block sizes must
  divide a slot's page table)."""
  return max(d for d in range(1, min(most, n) + 1) if n % d == 0)


def per_device_paged(kernel, mesh, cache_spec, *, takes=lambda q_bkgh, keys_knph: True):
  """kernel(q [B, K, G, H], key and value pools [K, N, P, H], pages [B, n], pos [B]) ->
  [B, K, G, H] (a paged decode kernel), run on each device's slots and KV heads of `mesh`:
  slots over the axes of cache_spec[0] (the sampler's dense cache spec [B, K, W, H]), KV heads
  over cache_spec[1]. The pools hold every page on
  every slot device (the engine replicates them over the slot axes, split over KV heads), so
  a slot's page ids need no translation. No communication: decode attention mixes neither
  slots nor KV heads. Returns fn(same arguments) -> the output, or None where `takes(q, keys)`
  (the kernel's own limits: head_dim, dtype, page size) refuses the call or the mesh's axes do
  not divide the slots or KV heads."""
  b, k = (tuple(cache_spec) + (None, None))[:2]

  def ways(axes):
    axes = (axes,) if isinstance(axes, str) else axes or ()
    return int(np.prod([mesh.shape[a] for a in axes]))

  def sharded(q_bkgh, keys_knph, values_knph, pages_bn, pos_b):
    if not takes(q_bkgh, keys_knph):
      return None
    if mesh.devices.size == 1:
      return kernel(q_bkgh, keys_knph, values_knph, pages_bn, pos_b)
    if q_bkgh.shape[0] % ways(b) or q_bkgh.shape[1] % ways(k):
      return None
    q_spec, pool_spec = P(b, k, None, None), P(k, None, None, None)
    return shard_map(kernel, mesh=mesh,
                     in_specs=(q_spec, pool_spec, pool_spec, P(b, None), P(b)),
                     out_specs=q_spec, check_vma=False)(
                         q_bkgh, keys_knph, values_knph, pages_bn, pos_b)

  return sharded
