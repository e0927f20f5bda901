"""The memory plan: bytes per device for each model role and each program, before launch.

A trainer describes its own run (jaxrl.algorithms.sft.programs, rm.programs, dpo.programs,
jaxrl.algorithms.grpo.programs): the `Workload` (rows, lengths, reference, reward models, the
sampler's slots and KV cache, all read from the trainer's own config sections) and the jitted
`Program`s it runs, with abstract arguments laid out on the mesh. Nothing here is a free knob:
the `plan` config section only names the device (and whether a run checks the plan first).

Two views, one source:
- roles (memory_plan): the bytes that stay resident per device (actor params, Adam moments,
  the reference, reward models, the sampler copy and its KV cache), exact shard arithmetic;
- programs (plan_programs): per jitted program, XLA's own accounting estimated without a
  compile: argument + output - aliased (donated) + temporary bytes, plus what stays resident
  beside it. Arguments and outputs are exact from the shardings; the temporaries of a train
  step are the residuals its backward keeps (counted by tracing jax.vjp of the trainer's loss
  under eval_shape, so remat and chunked log-probs count as the program runs them), the
  gradients and the gathered weights of one layer; a forward's are its fp32 logits. The
  compiler's figures (jaxrl.parallel.compile) check it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable

import jax
import ml_collections
import numpy as np

from jaxrl.errors import ConfigError
from jaxrl.models import CACHE_AXES, ModelConfig, RewardModel, abstract_model, cache_shape
from jaxrl.models.attention import Causal
from jaxrl.models.llama import first_layers, is_stacked
from jaxrl.models.lora import base_config as lora_base_config
from jaxrl.models.lora import is_lora_path, partition, split_lora, trainable
from jaxrl.models.quant import SCALE
from jaxrl.parallel.layouts import abstract_layer, get_rules, logical_spec
from jaxrl.parallel.sync import HOST_RESHARD_MIN_BYTES, Layout, Placement, host_memory

GIB = 1 << 30
# Per-chip (TPU) or per-GPU memory in GiB.
DEVICE_MEMORY_GIB = {
    "tpu-v4": 32, "tpu-v5e": 16, "tpu-v5p": 95, "tpu-v6e": 32,
    "a100-40gb": 40, "a100-80gb": 80, "h100-80gb": 80, "h200": 141, "b200": 180,
    "l4": 24, "a10g": 24, "t4": 16, "rtx-4090": 24,
}


def plan_config() -> ml_collections.ConfigDict:
  """The `plan` config section: which device the plan is checked against, and whether a run
  checks it before its first step. Everything else the plan counts comes from the trainer's
  own sections (its Workload and Programs)."""
  return ml_collections.ConfigDict(dict(
      device="",  # a DEVICE_MEMORY_GIB name; "" = the runtime's own figure, else only report
      device_gib=0.0,  # explicit per-device memory, overrides `device`
      check=True,  # a trainer stops before step 1 when the plan says it does not fit
      # A TPU slice ("v5e:2x4"): `jaxrl plan` off TPU plans its abstract devices, not this
      # machine's, so a slice's config plans as written on a laptop.
      topology="",
  ))


@dataclasses.dataclass(frozen=True)
class Workload:
  """What a trainer's config makes each device hold: filled by the trainer (its `programs`
  function), never by hand. rows: sequences per device in one forward/backward of the
  update; seq_len: their length; slots x max_len: the sampler's KV cache (0 = no sampler)."""
  rows: int = 1
  seq_len: int = 1024
  reference: bool = False
  optimizer_states: int = 2  # Adam's mu and nu
  slots: int = 0
  max_len: int = 0
  remat: str = "none"
  logits_chunk: int = 0  # positions per chunk of the chunked log-probs; 0 = whole sequence
  critic: bool = False  # PPO: a value model (the decoder and a value head) trains beside
  # PPO's critic.lora='off': a full critic beside a LoRA actor (else the critic takes the
  # actor's LoRA: adapters and head trained over its own frozen base copy).
  critic_full: bool = False


def _dtype_bytes(name: str) -> int:
  return 2 if name == "bfloat16" else 4


def tree_bytes_per_device(shapes, axes, layout: Layout, dtype_bytes: int | None = None, *,
                          min_leaf_bytes: int = 0) -> int:
  """Bytes one device holds of a tree under a layout (every array evenly sharded), counting
  only leaves of at least `min_leaf_bytes` (whole-array size)."""
  rules = get_rules(layout.rules)
  flat_s = jax.tree_util.tree_leaves(shapes)
  flat_a = jax.tree_util.tree_structure(shapes).flatten_up_to(axes)
  total = 0
  for x, ax in zip(flat_s, flat_a):
    # A cast (dtype_bytes) applies to float leaves only: a quantised base's int8 stays int8.
    item = np.dtype(x.dtype).itemsize
    if dtype_bytes is not None and jax.dtypes.issubdtype(x.dtype, np.floating):
      item = dtype_bytes
    if int(np.prod(x.shape)) * item < min_leaf_bytes:
      continue
    spec, _ = logical_spec(ax, x.shape, rules, layout.mesh)
    ways = 1
    for s in spec:
      for a in ((s,) if isinstance(s, str) else (s or ())):
        ways *= layout.mesh.shape[a]
    total += int(np.prod(x.shape)) * item // ways
  return total


def kv_cache_bytes_per_device(cfg: ModelConfig, layout: Layout, slots: int, max_len: int) -> int:
  shape = cache_shape(cfg, slots, max_len)
  spec, _ = logical_spec(CACHE_AXES, shape, get_rules(layout.rules), layout.mesh,
                         name="kv_cache")
  ways = 1
  for s in spec:
    for a in ((s,) if isinstance(s, str) else (s or ())):
      ways *= layout.mesh.shape[a]
  return 2 * cfg.num_layers * int(np.prod(shape)) * _dtype_bytes(cfg.dtype) // ways  # k and v


def activation_bytes_per_device(cfg: ModelConfig, layout: Layout, rows: int, seq_len: int,
                                remat: str = "none", logits_chunk: int = 0) -> int:
  """A closed-form estimate of a train step's activations (the role table's row; the program
  plan traces the real residuals instead). Korthikanti et al. 2022: 34·D + 5·N·T bytes per token
  per layer at 16 bits without recomputation; "full" remat keeps each layer's input; the fp32
  logits and their log-softmax over the whole sequence, or one chunk of positions."""
  m = layout.mesh.shape
  tokens = rows * seq_len
  scale = _dtype_bytes(cfg.dtype) / 2  # the formula counts 16-bit activations
  if remat == "full":
    per_layer = tokens * cfg.embed_dim * _dtype_bytes(cfg.dtype)
  else:
    per_layer = tokens * (34 * cfg.embed_dim + 5 * cfg.num_heads * seq_len) * scale / m["tensor"]
  positions = min(seq_len, logits_chunk) if logits_chunk else seq_len
  logits = 2 * rows * positions * cfg.vocab_size * 4 / m["tensor"]
  return int(cfg.num_layers * per_layer + logits)


def device_bytes_of(section) -> int | None:
  """The per-device memory the plan checks against: plan.device_gib, else plan.device's
  figure, else what the runtime reports (TPU/GPU), else None (only report)."""
  p = plan_config() if section is None else section
  if p["device_gib"]:
    return int(float(p["device_gib"]) * GIB)
  if p["device"]:
    if p["device"] not in DEVICE_MEMORY_GIB:
      raise ConfigError(f"plan.device={p['device']!r} is not a known device: choose one of "
                        f"{', '.join(DEVICE_MEMORY_GIB)}, or set plan.device_gib.")
    return DEVICE_MEMORY_GIB[p["device"]] * GIB
  return None


@dataclasses.dataclass
class MemoryPlan:
  placement: str
  learner: dict[str, int]  # role -> bytes per learner device
  sampler: dict[str, int]  # role -> bytes per sampler device (colocated: the same devices)
  learner_peak: int
  sampler_peak: int
  device_bytes: int | None
  suggestions: list[str]

  @property
  def peak(self) -> int:
    return max(self.learner_peak, self.sampler_peak)

  @property
  def fits(self) -> bool | None:
    return None if self.device_bytes is None else self.peak <= self.device_bytes

  def persistent_bytes(self) -> int:
    """Bytes that stay live between steps on a colocated device (no gradients, activations)."""
    skip = ("actor gradients", "critic gradients", "activations (estimate)")
    return sum(v for k, v in {**self.learner, **self.sampler}.items() if k not in skip)

  def table(self) -> str:
    rows = [(k, v, "learner") for k, v in self.learner.items()]
    rows += [(k, v, "sampler") for k, v in self.sampler.items()]
    w = max(len(r[0]) for r in rows)
    lines = [f"memory plan by role ({self.placement}), bytes per device:"]
    lines += [f"  {k:<{w}}  {_gib(v):>11}  [{side}]" for k, v, side in rows]
    if self.placement == "colocated":
      lines.append(f"  peak per device: {_gib(self.peak)} (train phase {_gib(self.learner_peak)},"
                   f" generation phase {_gib(self.sampler_peak)})")
    else:
      lines.append(f"  peak per learner device: {_gib(self.learner_peak)}; per sampler device: "
                   f"{_gib(self.sampler_peak)}")
    if self.device_bytes is not None:
      verdict = "fits" if self.fits else "does NOT fit"
      lines.append(f"  device memory {_gib(self.device_bytes)}: {verdict} "
                   f"({100 * self.peak / self.device_bytes:.0f}% of it)")
      for s in self.suggestions:
        lines.append(f"  - {s}")
    return "\n".join(lines)


def _gib(n: float) -> str:
  return f"{n / GIB:.3f} GiB" if n >= GIB / 100 else f"{n / (1 << 20):.2f} MiB"


def memory_plan(cfg: ModelConfig, placement: Placement, section=None, *,
                workload: Workload | None = None, sync_dtype: str = "",
                ref_dtype: str = "", reward_models=()) -> MemoryPlan:
  """Bytes per device for every role, the peak per phase, and whether it fits. `workload` is
  the trainer's (its programs function); `reward_models` is a list of (label, ModelConfig[,
  logprob_feature]), one learner row each (frozen: params only, in the learner layout);
  `ref_dtype` the reference copy's (placement.ref_dtype; "": the params')."""
  w = Workload() if workload is None else workload
  _, shapes, axes = abstract_model(cfg)
  L, S = placement.learner, placement.sampler
  params = tree_bytes_per_device(shapes, axes, L)
  learner = {"actor params": params, "actor gradients": params,
             "actor optimizer state": w.optimizer_states * params}
  if w.reference:
    learner["reference params"] = tree_bytes_per_device(
        shapes, axes, L, _dtype_bytes(ref_dtype) if ref_dtype else None)
  if cfg.lora_rank:
    # LoRA: gradients and moments for the adapters only; the reference is the actor's own
    # frozen base with zero adapters, so only those are its own.
    adapters = tree_bytes_per_device(*(split_lora(t)[1] for t in (shapes, axes)), L)
    learner.update({"actor gradients": adapters,
                    "actor optimizer state": w.optimizer_states * adapters})
    if w.reference:
      learner["reference params"] = adapters
  if w.critic:  # PPO's value model: a decoder with a head, trained by its own optimizer
    ccfg = lora_base_config(cfg) if w.critic_full else cfg
    _, cs, ca = abstract_model(ccfg, RewardModel)
    critic = trained = tree_bytes_per_device(cs, ca, L)
    if ccfg.lora_rank:  # its own frozen base in the params; adapters and head train
      keep = lambda path: trainable(path, ("head",))  # noqa: E731
      trained = tree_bytes_per_device(partition(cs, keep), partition(ca, keep), L)
    learner.update({"critic params": critic, "critic gradients": trained,
                    "critic optimizer state": w.optimizer_states * trained})
  for label, rm_cfg, *feature in reward_models:
    model = functools.partial(RewardModel, logprob_feature=bool(feature and feature[0]))
    _, rs, ra = abstract_model(rm_cfg, model)
    learner[f"{label} params"] = tree_bytes_per_device(rs, ra, L)
  learner["activations (estimate)"] = activation_bytes_per_device(
      cfg, L, w.rows, w.seq_len, w.remat, w.logits_chunk)
  sampler = {}
  if w.slots:
    cast = _dtype_bytes(sync_dtype) if sync_dtype else None
    sampler = {"sampler weights": tree_bytes_per_device(shapes, axes, S, cast)}
    if cfg.lora_rank:
      # LoRA (merged on the sampler, jaxrl.parallel.sync.WeightSync): the engine's weights are
      # the plain model's, merged from the sampler's own copy of the frozen base, which stays
      # (a quantised base as it is, int8 and float32 scales, never cast).
      _, ps, pa = abstract_model(lora_base_config(cfg))
      base_s, base_a = split_lora(shapes)[0], split_lora(axes)[0]
      sampler = {"sampler weights": tree_bytes_per_device(ps, pa, S, cast),
                 "sampler base (LoRA)": tree_bytes_per_device(
                     base_s, base_a, S, None if cfg.lora_quantize else cast)}
    sampler["kv cache"] = kv_cache_bytes_per_device(cfg, S, w.slots, w.max_len)
  train_only = ("actor gradients", "critic gradients", "activations (estimate)")
  if placement.mode == "colocated":
    resident = sum(v for k, v in learner.items() if k not in train_only)
    kept = sum(sampler.values()) if placement.keep_sampler_copy else 0
    if w.slots and not kept and host_memory(set(L.mesh.devices.flat) | set(S.mesh.devices.flat)):
      # On CPU the sync's pooled host buffers (one copy of the leaves it reshards on the host)
      # stay allocated over the update.
      kept = tree_bytes_per_device(
          shapes, axes, S, _dtype_bytes(sync_dtype) if sync_dtype else None,
          min_leaf_bytes=HOST_RESHARD_MIN_BYTES)
    learner_peak = sum(learner.values()) + kept
    sampler_peak = resident + sum(sampler.values())
  else:
    learner_peak, sampler_peak = sum(learner.values()), sum(sampler.values())
  plan = MemoryPlan(placement.mode, learner, sampler, learner_peak, sampler_peak,
                    device_bytes_of(section), [])
  if plan.fits is False:
    plan.suggestions = suggest(plan, placement, w, cfg)
  return plan


def suggest(plan: MemoryPlan, placement: Placement, w: Workload, cfg: ModelConfig) -> list[str]:
  out = []
  kv = plan.sampler.get("kv cache", 0)
  if placement.mode == "colocated" and plan.sampler:
    if placement.keep_sampler_copy:
      out.append("set placement.keep_sampler_copy=False: the sampler copy and KV cache "
                 f"({_gib(sum(plan.sampler.values()))}) are then freed during the update")
    out.append("placement.mode=disaggregated puts the sampler weights and KV cache on their own "
               "devices")
  if kv > plan.device_bytes * 0.2:
    out.append(f"fewer decode slots ({w.slots} cost {_gib(kv)} of KV cache; halving them "
               f"saves {_gib(kv / 2)}) or shorter sequences ({w.max_len} positions)")
  if w.remat == "none":
    out.append("model.remat=full (recompute each decoder block in the backward) keeps only each "
               "layer's input")
  out.append("fewer rows per device in one micro-batch: raise optim.accum_steps")
  opt = plan.learner["actor gradients"] + plan.learner["actor optimizer state"]
  out.append(f"LoRA would shrink gradients and optimizer state ({_gib(opt)}) to a few percent")
  if cfg.param_dtype == "float32":
    out.append("model.param_dtype=bfloat16 halves every weight copy")
  out.append("more devices on fsdp shard the learner roles further")
  return out


# ----------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Program:
  """One jitted program a trainer runs, with abstract arguments (jax.ShapeDtypeStruct carrying
  their shardings): what `jaxrl plan` estimates and `jaxrl plan --compile` compiles.

  kind: "train" (forward + backward + update), "forward" (log-probs or rewards, no gradient),
  "prefill", "decode" or "sync". resident: bytes per device that stay live beside the
  program's own arguments while it runs (e.g. the reference's params during the update).
  loss: for a train step, (loss_fn, params, micro_batch) of one micro-batch, abstract, whose
  backward's residuals are counted. flops: model FLOPs per call; tokens: tokens it produces
  or consumes per call (decode: slots x steps)."""
  name: str
  fn: Callable
  args: tuple
  kind: str
  resident: dict[str, int] = dataclasses.field(default_factory=dict)
  loss: tuple | None = None
  donated: tuple[int, ...] = ()
  flops: float = 0.0
  tokens: int = 0
  rows: int = 0  # sequences per device in one forward (train: one micro-batch)
  seq_len: int = 0
  vocab: int = 0  # the model's vocabulary (the fp32 logits' last dimension)
  logits_chunk: int = 0  # positions per log-prob chunk (0: the whole sequence at once)
  # Bytes per device of one decoder block's activations over this program's rows (its
  # residuals without remat): what a forward holds at once, and what a rematerialised
  # block's recompute holds in the backward.
  layer_bytes: int = 0
  remat: str = "none"
  accum_steps: int = 1  # train: micro-batches per update (a scan carrying the gradients' sum)
  depth: int = 0  # train: the blocks of the model(s) in `loss`, each as deep (residual_bytes)
  # Bytes per device of the float32 scores [rows, heads, queries, keys] of the program's
  # largest full-sequence attention call, where XLA's attention runs it
  # (attention_score_bytes); 0 where a kernel takes it (kernel_takes: the CPU's, TPU splash,
  # GPU flash attention).
  attention_bytes: int = 0


def _nbytes(shape, itemsize: int) -> int:
  """Bytes of an array. (TPU tile padding is not modelled: real-size dimensions are multiples
  of 128, where it adds nothing; the tiny presets' small dimensions pad more.)"""
  return int(np.prod(tuple(int(d) for d in shape))) * itemsize


def _itemsize(dtype) -> int:
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return 8  # a threefry key's two uint32 words
  return np.dtype(dtype).itemsize


def abstract_bytes(tree, *, ways: int = 1) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs (or arrays): each leaf's shard
  under its sharding, or the whole leaf divided by `ways` when it has none."""
  total = 0
  for x in jax.tree.leaves(tree):
    item = _itemsize(x.dtype)
    sharding = getattr(x, "sharding", None)
    if sharding is not None and hasattr(sharding, "shard_shape"):
      total += _nbytes(sharding.shard_shape(x.shape), item)
    else:
      shape = list(x.shape)
      if shape and ways > 1 and shape[0] % ways == 0:
        shape[0] //= ways
      total += _nbytes(shape, item)
  return total


def gathered_bytes(params) -> int:
  """Bytes of the weights FSDP gathers whole onto every device at once: the embedding and
  LM head (used at both ends of the forward and again in the backward) and two decoder
  layers (the one computing and the next one prefetched). A quantised weight (QLoRA: int8
  beside its `_scale`, jaxrl.models.quant) counts gathered and dequantised, its int8 bytes
  plus its bytes in the param dtype (the embedding's): the forward multiplies the
  dequantised copy. (The tiny GRPO programs on 8 CPU devices, rank 8 on every linear weight:
  XLA's temporaries grew by 1.18 MB from LoRA to QLoRA, in the train step and the log-prob
  forward alike, three quarters of the 1.57 MB of float32 linear weights, where counting the
  int8 alone had the plan shrink them by as much; counted this way the plan is 7% under XLA
  for the train step, 10% under for the forward.)"""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  scaled = {tuple(str(getattr(k, "key", k)) for k in path[:-1]) + (
      str(getattr(path[-1], "key", path[-1]))[:-len(SCALE)],)
      for path, _ in flat if str(getattr(path[-1], "key", "")).endswith(SCALE)}
  # The param dtype: the base's own float weights' (the adapters are float32 whatever it is).
  floats = [np.dtype(x.dtype).itemsize for path, x in flat
            if jax.dtypes.issubdtype(x.dtype, np.floating) and not is_lora_path(path)
            and not str(getattr(path[-1], "key", "")).endswith(SCALE)]
  param_item = max(floats) if floats else 4
  layers: dict[str, int] = {}
  other = 0
  for path, x in flat:
    n = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if tuple(keys) in scaled:
      n += int(np.prod(x.shape)) * param_item
    if "layers" in keys:
      i = keys.index("layers")
      if not keys[i + 1].isdigit():  # a scanned model's stacked [L, ...] leaf: one layer's part
        for layer in range(x.shape[0]):
          layers[str(layer)] = layers.get(str(layer), 0) + n // x.shape[0]
      else:
        layers[keys[i + 1]] = layers.get(keys[i + 1], 0) + n
    else:
      other += n
  per_layer = max(layers.values()) if layers else 0
  return other + min(2, len(layers)) * per_layer


@dataclasses.dataclass
class ProgramEstimate:
  """The plan's estimate of one program on one device, in XLA's terms."""
  name: str
  argument: int
  output: int
  alias: int
  temp: int
  resident: int

  @property
  def program_peak(self) -> int:
    """What XLA's memory_analysis sums to: arguments + outputs - aliased + temporaries."""
    return self.argument + self.output - self.alias + self.temp

  @property
  def peak(self) -> int:
    return self.program_peak + self.resident


def _row_ways(args) -> int:
  """Ways a program's rows are split: the largest number of shards of any argument's leading
  (batch) dimension."""
  ways = 1
  for x in jax.tree.leaves(args):
    s = getattr(x, "sharding", None)
    if s is not None and hasattr(s, "shard_shape") and len(x.shape) >= 2:
      ways = max(ways, x.shape[0] // max(1, s.shard_shape(x.shape)[0]))
  return ways


def attention_score_bytes(cfg: ModelConfig, mesh, *, rows: int, queries: int, keys: int,
                          fused: bool) -> int:
  """Bytes per device of one attention call's float32 scores [rows, heads, queries, keys], the
  heads split over the mesh's tensor axis; 0 when a fused kernel takes the call (`fused`:
  kernel_takes)."""
  if fused:
    return 0
  return 4 * rows * (cfg.num_heads // mesh.shape["tensor"]) * queries * keys


def kernel_takes(kernel, cfg: ModelConfig, mesh, *, queries: int, keys: int) -> bool:
  """Whether `kernel`, the backend's full-sequence attention kernel for the learner layout on
  `mesh` (jaxrl.backends.attention_kernel; None: XLA's), takes a causal call of
  `queries` against `keys` in the model's dtype: then no float32 scores are materialised (CPU
  kernels, TPU splash, GPU flash attention). Asked of the kernel itself, traced abstractly
  (nothing runs), so the plan follows each kernel's own limits (splash: >= 128 keys; GPU
  Pallas: keys = queries)."""
  if kernel is None:
    return False
  rows = mesh.shape["data"] * mesh.shape["fsdp"]  # one per device
  K, G, H = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
  dt = jax.numpy.dtype(cfg.dtype)
  q = jax.ShapeDtypeStruct((rows, queries, K, G, H), dt)
  kv = jax.ShapeDtypeStruct((rows, K, keys, H), dt)
  mask = jax.ShapeDtypeStruct((rows, queries, keys), np.bool_)
  out = jax.eval_shape(lambda q, k, v, m: kernel(q, k, v, m, Causal()), q, kv, kv, mask)
  return out is not None


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def residual_bytes(loss_fn, params, batch, *, ways: int, depth: int = 0) -> int:
  """Bytes per device the backward of loss_fn(params, batch, key) keeps from its forward: the
  residuals of jax.vjp, traced under eval_shape (nothing runs), the batch's rows split `ways`
  ways. Two things XLA does not keep are left out: boolean masks (it recomputes them from
  iotas), and the float32 twin of a bfloat16 residual of the same shape (a convert it
  recomputes: with bf16 compute each activation appears in both precisions).

  depth > 2 (every model in loss_fn has that many blocks): the residuals are c + depth x b,
  every block keeping the same, so they are traced over the first block and the first two
  (jaxrl.models.llama.first_layers) and extrapolated, c + b + (depth - 1) x b: the same bytes
  as the whole model's trace (every recorded scale row's plan checked equal), which at 28-36
  blocks took most of a real-size plan's seconds. depth 0: every block traced (models of
  several depths).

  The blocks are traced one by one (first_layers), a scanned model's too: a scan's residuals
  are stacked [layers, rows, ...] and would not split by rows (the tiny SFT train step on 8
  devices planned 22.02 MiB per device scanned, against 5.98 unrolled; XLA 4.98 and 5.97)."""
  if depth > 2:
    one, two = (residual_bytes(loss_fn, params, batch, ways=ways, depth=n) for n in (1, 2))
    return one + (depth - 1) * (two - one)
  def residuals(p, b):
    return jax.vjp(lambda q: loss_fn(q, b, None)[0], p)[1]
  strip = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  with first_layers(depth or sys.maxsize):
    out = jax.eval_shape(residuals, strip(params), strip(batch))
  flat_params = {(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(params)}
  # A scanned model's layers, traced one by one (first_layers), read slices of its stacked
  # leaves: the parameters still, not activations.
  flat_params |= {(tuple(x.shape[1:]), str(x.dtype)) for path, x in
                  jax.tree_util.tree_flatten_with_path(params)[0]
                  if "layers" in (keys := _keys(path)) and is_stacked(keys[keys.index("layers"):])}
  count: dict[tuple, int] = {}
  for x in jax.tree.leaves(out):
    key = (tuple(x.shape), str(x.dtype))
    if key in flat_params or not x.shape or x.dtype == np.bool_:
      continue  # the params themselves (arguments already), scalars and masks
    count[key] = count.get(key, 0) + 1
  total = 0
  for (shape, dtype), n in count.items():
    if dtype == "float32":
      n = max(0, n - count.get((shape, "bfloat16"), 0))
    shape = list(shape)
    if shape[0] % ways == 0:
      shape[0] //= ways
    total += n * _nbytes(shape, _itemsize(dtype))
  return total


def reshard_bytes(src, dst) -> int:
  """Temporaries per device of one jitted reshard of the tree `src` into `dst` (same structure,
  abstract, with shardings): XLA overlaps every leaf's collective, so one staging buffer per
  moved leaf is live at once. A target that splits the leaf over every device is reached by an
  all-to-all, staged in the target shard's size; a target replicated over some devices (the
  sampler's data axis) by gathering the whole leaf first. Calibrated on the Qwen3-8B QLoRA
  sync compiled for v5e-8 (learner fsdp=8 -> sampler tensor=8: XLA 1.38 GiB of temporaries,
  this 1.14, the program 3.73 against 3.49; -> data=4 x tensor=2: XLA 7.75, this 8.87, the
  program 13.42 against 14.53; docs/guides/lora.md). Before, the plan counted no temporaries
  and said 2.35 and 5.66."""
  total = 0
  for x, y in zip(_per_layer_leaves(src), jax.tree.leaves(dst)):
    sx, sy = getattr(x, "sharding", None), getattr(y, "sharding", None)
    if sy is None or (sx is not None and sx.is_equivalent_to(sy, len(x.shape))):
      continue
    shard = sy.shard_shape(y.shape)
    item = np.dtype(y.dtype).itemsize
    whole = math.prod(y.shape) * item
    split = whole // max(1, math.prod(shard) * item)  # distinct shards
    total += math.prod(shard) * item if split >= len(sy.device_set) else whole
  return total


def _per_layer_leaves(tree) -> list:
  """The leaves of `tree` with a scanned model's stacked layer leaves ([L, ...], the layer axis
  replicated) given as their L layers, each sharded as the stack past its layer axis: the
  leaves of the unrolled model's tree, in its order (a scanned learner's sync unstacks)."""
  flat = {_keys(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
  stacked = {k for k in flat if "layers" in k and is_stacked(k[k.index("layers"):])}
  if not stacked:
    return list(flat.values())
  out = {}
  for k, x in flat.items():
    if k in stacked:
      i = k.index("layers")
      out.update({(*k[:i + 1], n, *k[i + 1:]): abstract_layer(x) for n in range(x.shape[0])})
    else:
      out[k] = x
  # In the order jax flattens the unrolled tree: by path, layer indices as numbers.
  order = lambda k: tuple((0, v, "") if isinstance(v, int) else (1, 0, str(v)) for v in k)
  return [out[k] for k in sorted(out, key=order)]


def estimate(program: Program) -> ProgramEstimate:
  """The plan's estimate of `program` per device (see the module docstring)."""
  argument = abstract_bytes(program.args)
  if program.kind == "train":
    # A train step's outputs are its new state, in the state argument's shapes and shardings
    # (make_train_step's out_shardings), and scalar metrics, counted as nothing: not traced
    # (through the optimizer's update of every leaf, most of a real-size plan's seconds).
    out_tree = program.args[0]
  else:
    out_tree = jax.eval_shape(program.fn, *program.args)
  # An output without a sharding (a scan's carry) takes that of an argument of its shape.
  like = {(tuple(x.shape), str(x.dtype)): x.sharding for x in jax.tree.leaves(program.args)}
  out_tree = jax.tree.map(
      lambda x: x if getattr(x, "sharding", None) is not None else jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=like.get((tuple(x.shape), str(x.dtype)))), out_tree)
  output = abstract_bytes(out_tree)
  alias = min(output, sum(abstract_bytes(program.args[i]) for i in program.donated))
  ways = _row_ways(program.args)
  positions = program.seq_len
  if program.logits_chunk and program.logits_chunk < positions:
    positions = program.logits_chunk
  logits = 4 * program.rows * positions * program.vocab  # one fp32 [rows, T, V] array
  temp = 0
  if program.kind == "train":
    loss_fn, params, batch = program.loss
    state = program.args[0]
    grads = abstract_bytes(state.params)
    # Residuals of one micro-batch; the gradients twice in the params' sharding (and with
    # micro-batches a third copy: the scan's running sum beside a micro-batch's gradients and
    # the update's; Llama-3.2-3B SFT on v5p at 4 micro-batches held 4.7 GiB, 1.6 copies, beyond
    # the other terms and two copies); the logits' gradient at the loss's top (one fp32
    # [rows, T, V], or one chunk's); the weights FSDP gathers; with remat, one block's recompute.
    copies = 3 if program.accum_steps > 1 else 2
    temp = (residual_bytes(loss_fn, params, batch, ways=ways, depth=program.depth)
            + copies * grads
            + logits + gathered_bytes(params))
    if program.remat != "none":  # one block recomputed whole in the backward
      temp += program.layer_bytes
  elif program.kind == "forward":  # the learner's: its weights gathered as in the train step
    # A forward holds only part of a block's residuals at once: a third, as XLA counted Qwen3-
    # 0.6B's GRPO log-prob forward on v5e, beside the head's logits. Where XLA's attention
    # runs, a block's peak is its softmax instead, about 2.25 float32 score arrays (the
    # scores, their exponentials and the bf16 probabilities, partly fused), whichever is the
    # larger: calibrated on two v5e compiles of Qwen3-0.6B at 16 rows per chip, the log-prob
    # forward (1,536 queries x 2,048 keys; XLA 7.20 GiB of temporaries, this 7.45) and the
    # reward models' (2,048 x 2,048; XLA 10.09, this 9.70).
    temp = gathered_bytes(program.args[0]) + max(2 * logits + program.layer_bytes // 3,
                                                 9 * program.attention_bytes // 4)
  elif program.kind == "prefill":
    temp = 2 * logits
  elif program.kind == "decode":
    # The decode scan's carry: XLA keeps a second copy of the decode state (the KV cache) for
    # the loop body (Qwen3-0.6B on v5e: 1.9 GiB of cache, 1.9 GiB of temporaries).
    temp = 2 * logits + abstract_bytes(program.args[1])
  elif program.kind == "sync":
    temp = reshard_bytes(program.args[0], out_tree)
  return ProgramEstimate(program.name, argument, output, alias, temp,
                         sum(program.resident.values()))


@dataclasses.dataclass
class ProgramPlan:
  """A trainer's programs, each estimated; fits when the largest peak fits the device."""
  estimates: list[ProgramEstimate]
  device_bytes: int | None

  @property
  def peak(self) -> int:
    return max(e.peak for e in self.estimates)

  @property
  def fits(self) -> bool | None:
    return None if self.device_bytes is None else self.peak <= self.device_bytes

  def table(self) -> str:
    w = max(len(e.name) for e in self.estimates)
    lines = [f"memory plan by program, bytes per device (program = arguments + outputs - "
             "donated + temporaries; peak adds what stays resident beside it):",
             f"  {'program':<{w}}  {'arguments':>11}  {'temporaries':>11}  {'program':>11}  "
             f"{'peak':>11}"]
    for e in self.estimates:
      lines.append(f"  {e.name:<{w}}  {_gib(e.argument):>11}  {_gib(e.temp):>11}  "
                   f"{_gib(e.program_peak):>11}  {_gib(e.peak):>11}")
    if self.device_bytes is not None:
      verdict = "fits" if self.fits else "does NOT fit"
      lines.append(f"  device memory {_gib(self.device_bytes)}: the largest peak "
                   f"{_gib(self.peak)} {verdict} ({100 * self.peak / self.device_bytes:.0f}%)")
    return "\n".join(lines)


def plan_programs(programs: list[Program], section=None) -> ProgramPlan:
  return ProgramPlan([estimate(p) for p in programs], device_bytes_of(section))


def runtime_device_bytes(devices) -> int | None:
  """What the runtime reports as one device's memory (TPU/GPU), or None (CPU). Only this
  process's devices can answer (a multi-process run's other devices raise), so the first
  addressable one is asked."""
  local = [d for d in devices if d.process_index == jax.process_index()]
  stats = (local[0].memory_stats() if local else None) or {}
  return stats.get("bytes_limit")


def check_fits(plan: ProgramPlan, device_bytes: int | None, *, what: str) -> None:
  """One sentence and a stop when the plan's largest program does not fit the device."""
  if device_bytes is None or plan.peak <= device_bytes:
    return
  worst = max(plan.estimates, key=lambda e: e.peak)
  raise ConfigError(
      f"{what} will not fit: its {worst.name} needs {_gib(worst.peak)} per device by the "
      f"memory plan but the device has {_gib(device_bytes)}; see `jaxrl plan --config ...` for "
      "what to change (model.remat, fewer rows per device via optim.accum_steps, more devices), "
      "or pass --config.plan.check=False to start anyway.")
