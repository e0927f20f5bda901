"""Learner -> sampler weight sync: layouts as data, placements, and a timed sync every step.

A `Layout` is a mesh plus a rule set; the learner and sampler layouts of one run may sit on the
same devices with different mesh shapes (colocated: e.g. fsdp=8 for training, data=2 x tensor=4
for sampling) or on disjoint device sets (disaggregated). Either way the sync is one
`jax.device_put(tree, target_shardings)`: probing on 8 fake CPU devices put it near 2x a numpy
memcpy, while a jitted identity with out_shardings was up to 10x slower and cannot cross device
sets. On Pathways (JAX_PLATFORMS=proxy) pathwaysutils' reshard is used when importable.

When every device on both sides is a CPU device of this process, all of them are host memory,
and the sync is done on the host instead (`HostReshard`): each distinct target shard is copied
once from read-only views of the source shards into a reused, 64-byte-aligned buffer, and the
devices that hold it (replicas included) get it without a copy. Measured on 8 fake devices
(benchmarks/sync.py), device_put moved 1 GiB colocated (fsdp=8 -> data=2 x tensor=4) at 0.23x
memcpy: its reshard all-gathers every matrix to every device ("involuntary full
rematerialization") and writes into fresh pages, which fault at ~1.8 GB/s on this VM.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from jaxrl.errors import ConfigError
from jaxrl.models import ModelConfig, abstract_model, lora
from jaxrl.models.llama import unstack_layers
from jaxrl.parallel.distributed import global_array, to_host
from jaxrl.parallel.layouts import tree_shardings
from jaxrl.parallel.mesh import make_mesh

PLACEMENTS = ("colocated", "disaggregated")
SYNC_DTYPES = ("", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a parameter tree lives: a mesh and the rule set ("learner" or "sampler")."""

  mesh: Mesh
  rules: str

  def shardings(self, shapes, axes):
    return tree_shardings(shapes, axes, self.mesh, self.rules)

  def model_shardings(self, cfg: ModelConfig):
    _, shapes, axes = abstract_model(cfg)
    return self.shardings(shapes, axes)


@dataclasses.dataclass(frozen=True)
class Placement:
  mode: str  # colocated | disaggregated
  learner: Layout
  sampler: Layout
  keep_sampler_copy: bool = False  # colocated: keep sampler weights + KV cache over the update


def placement_config() -> ml_collections.ConfigDict:
  """The `placement` and `sync` config sections (RL configs and `jaxrl bench sync` use them)."""
  return ml_collections.ConfigDict(dict(
      mode="colocated",
      # disaggregated: devices given to the learner (the rest go to the sampler); -1 = half.
      learner_devices=-1,
      # disaggregated: how many of the devices the learner leaves the sampler uses; -1 = all.
      # Fewer leave the others idle: on CPU, where XLA's client runs one multi-device program
      # at a time, a one-device sampler is the one that runs beside the learner (design.md,
      # "Async generation on CPU").
      sampler_devices=-1,
      # The sampler's mesh; colocated it spans all devices, disaggregated only its own.
      sampler_mesh=dict(data=-1, fsdp=1, tensor=1),
      keep_sampler_copy=False,
      # Cast on sync: "" keeps the learner dtype; "bfloat16" halves the bytes moved.
      sync_dtype="",
      # The frozen reference's dtype on the learner (RL trainers): "" keeps the learner's
      # (model.param_dtype); "bfloat16" halves its bytes. Exact where model.dtype is bfloat16:
      # every forward casts each weight to the compute dtype first, so the reference's log-probs
      # are the same; and a bf16 checkpoint's start policy is bf16 to begin with. Full
      # fine-tuning only (with LoRA the reference is the policy's own frozen base).
      ref_dtype="",
  ))


def make_placement(mesh_section, section=None, *, devices=None) -> Placement:
  """Builds the learner and sampler layouts of a config's `mesh` and `placement` sections."""
  section = placement_config() if section is None else section
  devices = list(jax.devices() if devices is None else devices)
  sm = section["sampler_mesh"]
  m = int(section.get("sampler_devices", -1))
  if section["mode"] == "colocated":
    if m != -1:
      raise ConfigError(f"placement.sampler_devices={m} applies to "
                        "disaggregated placement; colocated, the sampler spans every device: "
                        "set placement.mode=disaggregated or leave it at -1.")
    learner_devs = sampler_devs = devices
  elif section["mode"] == "disaggregated":
    n = int(section["learner_devices"])
    n = len(devices) // 2 if n == -1 else n
    if not 0 < n < len(devices):
      raise ConfigError(f"placement.learner_devices={n} must leave devices for both sides of "
                        f"{len(devices)}: choose 1..{len(devices) - 1} (or -1 for half).")
    learner_devs, sampler_devs = split_devices(devices, n, m)
  else:
    raise ConfigError(f"placement.mode={section['mode']!r} is not valid: choose one of "
                      f"{', '.join(PLACEMENTS)}.")
  learner = make_mesh(mesh_section["data"], mesh_section["fsdp"], mesh_section["tensor"],
                      devices=learner_devs)
  try:
    sampler = make_mesh(sm["data"], sm["fsdp"], sm["tensor"], devices=sampler_devs)
  except ConfigError as e:
    raise ConfigError(f"placement.sampler_mesh: {e}") from None
  return Placement(section["mode"], Layout(learner, "learner"), Layout(sampler, "sampler"),
                   bool(section["keep_sampler_copy"]))


def split_devices(devices, n: int, m: int = -1):
  """The learner's n devices and the sampler's m of the rest (-1: all of them), for
  disaggregated placement. On one process, the first n and the next m. Across processes, the
  same share of every process's devices on each side, so that each program (the sampler's, the
  learner's) runs on every process, as the multi-controller runtime needs."""
  per = {}
  for d in devices:
    per.setdefault(d.process_index, []).append(d)
  left = len(devices) - n
  if m != -1 and not 0 < m <= left:
    raise ConfigError(f"placement.sampler_devices={m}: the learner leaves {left} devices; "
                      f"choose 1..{left} (or -1 for all of them).")
  if len(per) == 1:
    return devices[:n], devices[n:] if m == -1 else devices[n:n + m]
  k = n // len(per)
  if k * len(per) != n or not all(0 < k < len(ds) for ds in per.values()):
    raise ConfigError(f"placement.learner_devices={n}: on {len(per)} processes each must give "
                      "the learner the same share of its devices and keep some for the "
                      f"sampler; choose a multiple of {len(per)} below {len(devices)} (or -1 for "
                      "half).")
  if m != -1 and m % len(per):
    raise ConfigError(f"placement.sampler_devices={m}: on {len(per)} processes each must give "
                      f"the sampler the same share of its devices; choose a multiple of "
                      f"{len(per)} (or -1 for all the learner leaves).")
  j = None if m == -1 else k + m // len(per)
  return ([d for ds in per.values() for d in ds[:k]], [d for ds in per.values() for d in ds[k:j]])


# ----------------------------------------------------------------------------- the sync


def _use_pathways() -> bool:
  return os.environ.get("JAX_PLATFORMS", "") == "proxy"


@partial(jax.jit, static_argnums=1)
def cast_floats(tree, dtype):
  """`tree` with its floating leaves in `dtype`, cast where they are (the same shardings): a
  bf16 sync moves half the bytes; GRPO's bf16 reference copy (placement.ref_dtype)."""
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x, tree)


def sync(params, target_shardings, *, dtype=None, donate: bool = False):
  """Moves `params` into `target_shardings`, optionally cast to `dtype` first.

  With donate=True the source buffers are released as soon as the copy exists (a cast source is
  a temporary and always released).
  """
  if dtype is not None and any(x.dtype != dtype for x in jax.tree.leaves(params)):
    cast = cast_floats(params, jnp.dtype(dtype))
    if donate:
      release(params)
    params, donate = cast, True
  if _use_pathways():
    try:
      from pathwaysutils.experimental import reshard  # optional fast path on Pathways
      return reshard.reshard(params, target_shardings, donate=donate)
    except ImportError:
      pass
  if HostReshard.applies(params, target_shardings):
    out = _HOST.reshard(params, target_shardings, min_bytes=HOST_RESHARD_MIN_BYTES)
  elif _across_device_sets(params, target_shardings):
    # Multi-controller JAX reshards between different device sets only on TPU (experimental),
    # so on several processes a disaggregated sync goes through the hosts: each leaf is
    # gathered whole on every process, which then places its own shards. Correct anywhere;
    # its cost shows in sync/ms.
    out = jax.tree.map(lambda x, t: global_array(to_host(x), t), params, target_shardings)
  else:
    # may_alias=False: the sampler copy never shares a buffer with the learner's, so releasing
    # one (SamplerCopy.before_update) can never free the other's memory.
    out = jax.device_put(params, target_shardings, may_alias=False)
  if donate:
    # device_put(donate=True) kept the source alive on CPU while aliasing some of its shards
    # into the result; instead free the source by hand once the copy exists.
    jax.block_until_ready(out)
    for src, dst in zip(jax.tree.leaves(params), jax.tree.leaves(out)):
      if src is not dst and not src.is_deleted():
        src.delete()
  return out


class HostReshard:
  """The sync on host memory, for trees whose source and target devices are all CPU devices of
  this process (see the module docstring).

  Each distinct target shard (replicas share one) is assembled once from zero-copy views of the
  source shards, in a thread pool, into a 64-byte-aligned numpy buffer, which jax.device_put
  then hands to each device that holds it without a copy. Buffers are pooled per (leaf, shard)
  and reused only once nothing but the pool refers to them: the runtime keeps a reference to a
  buffer for as long as any array (or running computation) uses it, so a live sampler copy is
  never overwritten. At most `max_sets` buffers are pooled per shard (the current copy and the
  one being replaced); beyond that a buffer is allocated unpooled. The pool's host memory is
  `pooled_bytes()`: one sampler copy, which stays allocated between steps on CPU (freeing it
  would make every sync fault in fresh pages, ~7x slower).

  A learner copy is never aliased, so releasing one side never frees the other's memory.

  Leaves under `min_bytes` go through one jax.device_put instead: the host path costs ~0.2 ms
  of Python per leaf, and measured on 8 fake devices device_put was faster below ~4 MiB per
  leaf (0.25 MiB: 0.12 vs 0.57 ms colocated) and slower above it (16 MiB: 0.23x vs 0.6x memcpy).
  """

  def __init__(self, *, max_sets: int = 2, threads: int | None = None):
    self.max_sets = max_sets
    self.threads = threads or min(8, os.cpu_count() or 1)
    self._pool: dict[tuple, list[np.ndarray]] = {}
    self._executor: ThreadPoolExecutor | None = None
    self._lock = threading.Lock()

  @staticmethod
  def applies(params, target_shardings) -> bool:
    devices = set()
    for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(target_shardings)):
      if not isinstance(x, jax.Array) or not hasattr(t, "devices_indices_map"):
        return False
      devices |= x.sharding.device_set | t.device_set
    return host_memory(devices)

  def pooled_bytes(self) -> int:
    return sum(raw.nbytes for raws in self._pool.values() for raw in raws)

  def reshard(self, params, target_shardings, *, min_bytes: int = 0):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    targets = jax.tree.leaves(target_shardings)
    small = [i for i, (_, x) in enumerate(leaves) if x.nbytes < min_bytes]
    moved = dict(zip(small, jax.device_put([leaves[i][1] for i in small],
                                           [targets[i] for i in small], may_alias=False)))
    if len(small) == len(leaves):
      return jax.tree.unflatten(treedef, [moved[i] for i in range(len(leaves))])
    big = [i for i in range(len(leaves)) if i not in moved]
    leaves, targets = [leaves[i] for i in big], [targets[i] for i in big]
    # The runtime drops its references to host buffers of deleted arrays lazily, the next time
    # Python calls into it; a tiny transfer flushes them, so a copy released just before this
    # sync has its buffers seen as free.
    jax.device_put(np.zeros((), np.float32), next(iter(targets[0].device_set)))
    plans, jobs = [], []
    for (path, x), target in zip(leaves, targets):
      sources = {}  # source region -> read-only view (replicated sources read once)
      for shard in x.addressable_shards:
        region = _region(shard.index, x.shape)
        if region not in sources:
          sources[region] = np.asarray(shard.data)
      holders: dict[tuple, list] = {}  # target region -> the devices that hold it
      for device, index in target.addressable_devices_indices_map(x.shape).items():
        holders.setdefault(_region(index, x.shape), []).append(device)
      name = jax.tree_util.keystr(path)
      plans.append((x, target, holders))
      jobs += [(name, x.dtype, region, sources) for region in holders]
    if self._executor is None:
      self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="jaxrl-sync")
    built = iter(list(self._executor.map(lambda job: self._build(*job), jobs)))
    out = []
    for x, target, holders in plans:
      bufs = {region: next(built) for region in holders}
      # One batched transfer per leaf; on CPU an aligned buffer is taken without a copy.
      out.append(jax.make_array_from_callback(
          x.shape, target, lambda index, shape=x.shape, bufs=bufs: bufs[_region(index, shape)]))
    moved.update(zip(big, out))
    return jax.tree.unflatten(treedef, [moved[i] for i in range(len(moved))])

  def _build(self, name, dtype, region, sources):
    shape = tuple(hi - lo for lo, hi in region)
    buf = self._buffer((name, region, np.dtype(dtype).str), shape, dtype)
    for src_region, src in sources.items():
      lo = [max(a, c) for (a, _), (c, _) in zip(region, src_region)]
      hi = [min(b, d) for (_, b), (_, d) in zip(region, src_region)]
      if all(l < h for l, h in zip(lo, hi)):
        buf[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, region))] = \
            src[tuple(slice(l - c, h - c) for l, h, (c, _) in zip(lo, hi, src_region))]
    return buf

  def _buffer(self, key, shape, dtype):
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    with self._lock:
      raws = self._pool.setdefault(key, [])
      for raw in raws:
        # Referenced only by the pool list, this loop and getrefcount's argument: free.
        if sys.getrefcount(raw) <= 3:
          return _aligned_view(raw, shape, dtype)
      raw = np.empty(nbytes + 64, np.uint8)
      if len(raws) < self.max_sets:
        raws.append(raw)
    return _aligned_view(raw, shape, dtype)


def _same_devices(tree, target_shardings) -> bool:
  """Every leaf already lives on the devices its target sharding spans (colocated), in the
  same order, so one jitted program can take the leaf and write the target. jit refuses one
  set of devices in two orders, and a colocated learner and sampler get two when their mesh
  shapes differ on a 3-D slice (v5p-8, 2x2x1: the learner's fsdp=4 ring is chips 0, 2, 1, 3,
  the sampler's 2x2 mesh 0, 1, 2, 3)."""
  return all(x.sharding.device_set == t.device_set and _order(x.sharding) is not None
             and _order(x.sharding) == _order(t)
             for x, t in zip(jax.tree.leaves(tree), jax.tree.leaves(target_shardings)))


def _order(sharding):
  """A NamedSharding's devices in its mesh's order; None for other shardings."""
  mesh = getattr(sharding, "mesh", None)
  return tuple(d.id for d in mesh.devices.flat) if isinstance(mesh, Mesh) else None


def _across_device_sets(params, target_shardings) -> bool:
  """Several processes, and some leaf moves to other devices than it is on."""
  return jax.process_count() > 1 and any(
      x.sharding.device_set != t.device_set
      for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(target_shardings)))


def host_memory(devices) -> bool:
  """Every device is a CPU device of this (single) process, so all of them are host memory:
  the condition for HostReshard, and for the memory plan to count its pool."""
  devices = set(devices)
  return (jax.process_count() == 1 and bool(devices) and
          all(d.platform == "cpu" for d in devices))


def _region(index, shape) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _aligned_view(raw: np.ndarray, shape, dtype) -> np.ndarray:
  offset = (-raw.ctypes.data) % 64
  nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
  return raw[offset:offset + nbytes].view(dtype).reshape(shape)


_HOST = HostReshard()
HOST_RESHARD_MIN_BYTES = 4 << 20  # smaller leaves take jax.device_put (see HostReshard)


def host_pool_bytes() -> int:
  """Host bytes held by the CPU sync's buffer pool (see HostReshard)."""
  return _HOST.pooled_bytes()


def release(tree) -> None:
  """Frees every array of a tree now, rather than whenever Python drops the last reference."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not x.is_deleted():
      x.delete()


def tree_bytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def live_bytes() -> int:
  """Bytes of every live jax.Array in this process (all devices)."""
  return sum(x.nbytes for x in jax.live_arrays())


@dataclasses.dataclass
class SyncStats:
  ms: float
  bytes: int

  @property
  def gb_per_s(self) -> float:
    return self.bytes / 1e9 / max(self.ms / 1e3, 1e-12)

  def metrics(self) -> dict[str, float]:
    return {"sync/ms": self.ms, "sync/gb_per_s": self.gb_per_s}


LORA_SAMPLER = ("merge", "apply")


class WeightSync:
  """The learner -> sampler sync of one run: target shardings computed once, every call timed.

      weight_sync = WeightSync(cfg, placement, dtype="bfloat16")
      sampler_params = weight_sync(learner_params)
      logger.log(step, weight_sync.last.metrics())   # sync/ms, sync/gb_per_s

  With LoRA on (cfg.lora_rank > 0; `adapters_only` overrides) only the adapters move at each
  call: the frozen base is synced once, on the first call (and again only if the learner's
  base arrays are ever other ones), into a sampler-side base copy that stays. Then, with
  lora_sampler="merge" (the default), one jitted W + (alpha / r) A B per adapted weight on the
  sampler's devices gives a plain model of `sampler_cfg` (LoRA off) for the engine; with
  "apply" the sampler's params are its base copy with the adapters beside it and the engine
  runs the LoRA graph. Merging won on every shape measured on CPU (benchmarks/lora_sync.py,
  docs/guides/peft.md: on the bench preset, rank 16 all-linear, a decode step took 1.4-1.9x as
  long with the adapters' extra products as without, while the merge cost about one decode
  step's time per RL step). It holds a second base-sized copy while generating, which SamplerCopy
  releases before each update. `last.bytes` counts what the call moved (the base included on
  its first call), and `last.ms` the whole call, merge included, so sync/gb_per_s stays honest.
  """

  def __init__(self, cfg: ModelConfig, placement: Placement, *, dtype: str | None = None,
               adapters_only: bool | None = None, lora_sampler: str = "merge"):
    self.placement = placement
    self.dtype = jnp.dtype(dtype) if dtype else None
    # A scanned learner (model.scan_layers) holds its layers stacked; the sampler runs them
    # one by one, as MaxText serves unscanned checkpoints: its decode steps then read each
    # layer's weights as they sit (no slice of a stack per layer and step) and compile as the
    # unrolled model's. The sync unstacks on the learner's devices, fused with its cast.
    self.num_layers = cfg.num_layers if cfg.scan_layers else 0
    cfg = cfg.replace(scan_layers=False)
    self.target = placement.sampler.model_shardings(cfg)
    self.history: list[SyncStats] = []
    self.adapters_only = bool(cfg.lora_rank) if adapters_only is None else adapters_only
    if self.adapters_only and not cfg.lora_rank:
      raise ConfigError("adapter-only weight sync needs LoRA adapters: set model.lora.rank > 0.")
    if lora_sampler not in LORA_SAMPLER:
      raise ConfigError(f"lora_sampler={lora_sampler!r} is not valid: choose one of "
                        f"{', '.join(LORA_SAMPLER)}.")
    self.merge = self.adapters_only and lora_sampler == "merge"
    # The model the sampler runs: the plain base model when it gets merged weights.
    self.sampler_cfg = lora.base_config(cfg) if self.merge else cfg
    self.base = None        # the sampler's copy of the frozen base (adapters_only)
    # What the sampler's engine makes of each synced tree (Engine.decode_params: on TPU the
    # q, k and v weights heads-major), applied to the tree the sync owns whole (no LoRA, or
    # merged), inside the timed call; None: the tree as synced. The trainer sets it.
    self.prepare: Callable | None = None
    self._base_src = None   # the learner's base leaves it was copied from
    # A quantised base (QLoRA) is synced as it is, int8 values and float32 scales, never cast:
    # the sampler then dequantises the very weights the learner uses, and casts after merging.
    self._base_dtype = None if cfg.lora_quantize else self.dtype
    if self.merge:
      # Merged in the base's (synced) dtype, straight into the sampler layout of the plain model.
      def merge(base, adapters):
        merged = lora.merge_lora(cfg, lora.combine(base, adapters))
        return cast_floats(merged, self.dtype) if cfg.lora_quantize and self.dtype else merged
      self._merge = jax.jit(merge, out_shardings=placement.sampler.model_shardings(
          self.sampler_cfg))

  @property
  def last(self) -> SyncStats:
    return self.history[-1]

  def unstacked(self, tree, dtype=None):
    """`tree` (the learner's params, or a part of them) with a scanned model's stacked layers
    split into one leaf per layer, cast to `dtype` on the way: a temporary copy on the
    learner's devices, for sync to move. `tree` itself, unscanned."""
    if not self.num_layers:
      return tree
    return _unstack(tree, num_layers=self.num_layers, dtype=dtype)

  def to_sampler(self, params):
    """The learner's whole params in the sampler's layout (and sync dtype), untimed: the
    held-out evaluator's weights."""
    if not self.num_layers:
      return sync(params, self.target, dtype=self.dtype)
    return sync(self.unstacked(params, self.dtype), self.target, donate=True)

  def __call__(self, params, *, donate: bool = False):
    t0 = time.perf_counter()
    if not self.adapters_only:
      dtype = self.dtype
      if self.num_layers:  # scanned: unstacked and cast into a temporary the sync frees
        params, donate, dtype = self.unstacked(params, self.dtype), True, None
      out = jax.block_until_ready(sync(params, self.target, dtype=dtype, donate=donate))
      moved = tree_bytes(out)
    else:
      base, adapters = lora.split_lora(params)
      base_target, adapter_target = lora.split_lora(self.target)
      if self.num_layers:  # (uncast: a colocated merge reads the learner's adapters as they are)
        adapters, donate = self.unstacked(adapters), True
      # The base is never donated: it is the learner's frozen base, shared by every step.
      if self.merge and _same_devices(adapters, adapter_target):
        # Colocated: the merge program takes the learner's adapters as they are and XLA moves
        # them inside it. One dispatch instead of one transfer per adapter leaf: on the bench
        # preset (84 leaves, 8 CPU devices) 30 ms against 87 ms for device_put, then merge.
        adapters_s = adapters
      else:
        adapters_s = sync(adapters, adapter_target, dtype=self.dtype, donate=donate)
      moved = tree_bytes(adapters_s)
      src = jax.tree.leaves(base)
      if self._base_src is None or any(a is not b for a, b in zip(src, self._base_src)):
        if self.base is not None:
          release(self.base)
        # (scanned: the learner's stacked base unstacked once, a temporary freed after)
        self.base = sync(self.unstacked(base, self._base_dtype), base_target,
                         dtype=None if self.num_layers else self._base_dtype,
                         donate=bool(self.num_layers))
        self._base_src = src
        moved += tree_bytes(self.base)
      if self.merge:
        out = jax.block_until_ready(self._merge(self.base, adapters_s))
        if adapters_s is not adapters or donate:
          release(adapters_s)
      else:
        out = jax.block_until_ready(lora.combine(self.base, adapters_s))
    if self.prepare is not None and (not self.adapters_only or self.merge):
      out = jax.block_until_ready(self.prepare(out, donate=True))
    self.history.append(SyncStats((time.perf_counter() - t0) * 1e3, moved))
    return out

  def release(self, out) -> None:
    """Frees a tree this sync returned, never the sampler's base copy (adapters_only): with
    "apply" its adapters, with "merge" the merged weights, without LoRA all of it."""
    release(lora.split_lora(out)[1] if self.adapters_only and not self.merge else out)

  def median(self) -> SyncStats:
    ms = statistics.median(s.ms for s in self.history)
    return SyncStats(ms, self.history[-1].bytes)


@partial(jax.jit, static_argnames=("num_layers", "dtype"))
def _unstack(tree, *, num_layers: int, dtype=None):
  out = unstack_layers(tree, num_layers)
  return cast_floats(out, dtype) if dtype is not None else out


class SamplerCopy:
  """The sampler's weights under colocated placement: released before each update (its memory
  goes to gradients and optimizer state) and rebuilt after, unless `keep` says they fit. With
  an adapter-only sync (LoRA) the sampler's base copy stays; what is released is what each sync
  makes (the merged weights, or the adapters)."""

  def __init__(self, weight_sync: WeightSync, *, keep: bool | None = None):
    self.weight_sync = weight_sync
    self.keep = weight_sync.placement.keep_sampler_copy if keep is None else keep
    self.params = None

  def refresh(self, learner_params):
    old, self.params = self.params, self.weight_sync(learner_params)
    if old is not None:
      self.weight_sync.release(old)
    return self.params

  def before_update(self) -> None:
    if not self.keep and self.params is not None:
      self.weight_sync.release(self.params)
      self.params = None


class Overlap:
  """Runs generation for step k+1 on the sampler while step k trains on the learner.

  JAX dispatch is asynchronous and releases the GIL while devices run, so one background thread
  is enough: the rollout driver's host loop runs there, the train step is dispatched here. Each
  result carries the params version it was generated with, so the trainer can log staleness and
  apply importance-sampling correction.
  """

  def __init__(self):
    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxrl-sampler")

  def submit(self, fn: Callable[..., Any], *args, version: int, **kw) -> Future:
    """Starts fn(*args) in the background; the future's result is (version, fn's result)."""
    return self._pool.submit(lambda: (version, fn(*args, **kw)))

  def close(self) -> None:
    self._pool.shutdown(wait=True)


def bench_sync(cfg: ModelConfig, placement: Placement, params, *, repeats: int,
               dtype: str | None = None, adapters_only: bool = False,
               lora_sampler: str = "merge") -> SyncStats:
  """The median of `repeats` timed syncs of `params` after one warm-up (which compiles and,
  with adapters_only, moves the base once): what `jaxrl bench sync` prints. Each output is
  released before the next sync, as SamplerCopy does."""
  ws = WeightSync(cfg, placement, dtype=dtype, adapters_only=adapters_only,
                  lora_sampler=lora_sampler)
  out = ws(params)
  for _ in range(repeats):
    ws.release(out)
    out = ws(params)
  ws.release(out)
  if ws.base is not None:
    release(ws.base)
  ws.history.pop(0)
  return ws.median()


def memcpy_gb_per_s(nbytes: int, repeats: int = 5) -> float:
  """Host memcpy bandwidth for `nbytes` on this machine (median), the baseline for sync."""
  src = np.ones(nbytes // 4, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)  # touch pages first
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    times.append(time.perf_counter() - t0)
  return src.nbytes / 1e9 / statistics.median(times)
