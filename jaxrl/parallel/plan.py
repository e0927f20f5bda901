"""The memory plan: bytes per device for each model role, computed before launch.

Roles: the actor (params, gradients, optimizer state), the frozen reference, frozen reward
models (one row each: the RL config's reward_model.checkpoints, or plan.reward_model), the
critic (PPO only), the sampler's weight copy and its KV cache, plus an
activation estimate. Colocated, one device holds the learner roles and the sampler side; the
plan takes the larger of the training and the generation phase. Disaggregated, the learner and
sampler devices are planned separately.

Activations are an estimate (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models": 34·D + 5·N·T bytes per token per layer at 16 bits, without
recomputation), plus the fp32 logits and their log-softmax. Everything else is exact shard
arithmetic from the layouts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import ml_collections
import numpy as np

from jaxrl.errors import ConfigError
from jaxrl.models import (CACHE_AXES, ModelConfig, RewardModel, abstract_model, cache_shape,
                          get_preset)
from jaxrl.parallel.layouts import get_rules, logical_spec
from jaxrl.parallel.sync import HOST_RESHARD_MIN_BYTES, Layout, Placement, host_memory

GIB = 1 << 30
# Per-chip (TPU) or per-GPU memory in GiB.
DEVICE_MEMORY_GIB = {
    "tpu-v4": 32, "tpu-v5e": 16, "tpu-v5p": 95, "tpu-v6e": 32,
    "a100-40gb": 40, "a100-80gb": 80, "h100-80gb": 80, "h200": 141, "b200": 180,
    "l4": 24, "a10g": 24, "t4": 16, "rtx-4090": 24,
}


def plan_config() -> ml_collections.ConfigDict:
  """The `plan` config section (RL configs fill slots, lengths and roles from their own)."""
  return ml_collections.ConfigDict(dict(
      device="",  # a DEVICE_MEMORY_GIB name; "" = only report
      device_gib=0.0,  # explicit per-device memory, overrides `device`
      slots=64,  # decode slots of the sampler (KV cache rows)
      max_len=1024,  # prompt + completion tokens per slot
      # Sequences each data-parallel replica runs through one forward/backward; gradient
      # accumulation covers the rest of the batch, so only this sets activation memory.
      micro_batch=4,
      seq_len=1024,
      reference=True,
      reward_model="",  # preset name of a frozen reward model, "" for none
      critic=False,  # PPO
      optimizer_states=2,  # Adam's mu and nu
      remat=False,  # activation recomputation: keep only each layer's input
  ))


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
    item = np.dtype(x.dtype).itemsize if dtype_bytes is None else dtype_bytes
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


def activation_bytes_per_device(cfg: ModelConfig, layout: Layout, micro_batch: int,
                                seq_len: int, remat: bool) -> int:
  m = layout.mesh.shape
  tokens = micro_batch * seq_len
  scale = _dtype_bytes(cfg.dtype) / 2  # the formula counts 16-bit activations
  if remat:
    per_layer = tokens * cfg.embed_dim * _dtype_bytes(cfg.dtype)
  else:
    per_layer = tokens * (34 * cfg.embed_dim + 5 * cfg.num_heads * seq_len) * scale / m["tensor"]
  logits = 2 * tokens * cfg.vocab_size * 4 / m["tensor"]
  return int(cfg.num_layers * per_layer + logits)


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
    lines = [f"memory plan ({self.placement}), bytes per device:"]
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
                sync_dtype: str = "", reward_models=()) -> MemoryPlan:
  """Bytes per device for every role, the peak per phase, and whether it fits.
  `reward_models` is a list of (label, ModelConfig), one learner row each (frozen: params
  only, in the learner layout where they score)."""
  p = plan_config() if section is None else section
  _, shapes, axes = abstract_model(cfg)
  L, S = placement.learner, placement.sampler
  params = tree_bytes_per_device(shapes, axes, L)
  learner = {"actor params": params, "actor gradients": params,
             "actor optimizer state": int(p["optimizer_states"]) * params}
  if p["reference"]:
    learner["reference params"] = params
  roles = list(reward_models)
  if p["reward_model"]:
    roles.append(("reward model", get_preset(p["reward_model"])))
  for label, rm_cfg, *feature in roles:  # (label, ModelConfig[, logprob_feature])
    model = functools.partial(RewardModel, logprob_feature=bool(feature and feature[0]))
    _, rs, ra = abstract_model(rm_cfg, model)
    learner[f"{label} params"] = tree_bytes_per_device(rs, ra, L)
  if p["critic"]:
    learner.update({"critic params": params, "critic gradients": params,
                    "critic optimizer state": int(p["optimizer_states"]) * params})
  learner["activations (estimate)"] = activation_bytes_per_device(
      cfg, L, int(p["micro_batch"]), int(p["seq_len"]), bool(p["remat"]))
  sampler = {
      "sampler weights": tree_bytes_per_device(
          shapes, axes, S, _dtype_bytes(sync_dtype) if sync_dtype else None),
      "kv cache": kv_cache_bytes_per_device(cfg, S, int(p["slots"]), int(p["max_len"])),
  }
  train_only = ("actor gradients", "critic gradients", "activations (estimate)")
  if placement.mode == "colocated":
    resident = sum(v for k, v in learner.items() if k not in train_only)
    kept = sum(sampler.values()) if placement.keep_sampler_copy else 0
    if not kept and host_memory(set(L.mesh.devices.flat) | set(S.mesh.devices.flat)):
      # On CPU the sync's pooled host buffers (one copy of the leaves it reshards on the host)
      # stay allocated over the update.
      kept = tree_bytes_per_device(
          shapes, axes, S, _dtype_bytes(sync_dtype) if sync_dtype else None,
          min_leaf_bytes=HOST_RESHARD_MIN_BYTES)
    train_peak = sum(learner.values()) + kept
    gen_peak = resident + sum(sampler.values())
    learner_peak, sampler_peak = train_peak, gen_peak
  else:
    learner_peak, sampler_peak = sum(learner.values()), sum(sampler.values())

  device_bytes = None
  if p["device_gib"]:
    device_bytes = int(float(p["device_gib"]) * GIB)
  elif p["device"]:
    if p["device"] not in DEVICE_MEMORY_GIB:
      raise ConfigError(f"plan.device={p['device']!r} is not a known device: choose one of "
                        f"{', '.join(DEVICE_MEMORY_GIB)}, or set plan.device_gib.")
    device_bytes = DEVICE_MEMORY_GIB[p["device"]] * GIB
  plan = MemoryPlan(placement.mode, learner, sampler, learner_peak, sampler_peak, device_bytes,
                    [])
  if plan.fits is False:
    plan.suggestions = _suggest(plan, placement, p, cfg)
  return plan


def _suggest(plan: MemoryPlan, placement: Placement, p, cfg: ModelConfig) -> list[str]:
  out = []
  kv = plan.sampler["kv cache"]
  if placement.mode == "colocated":
    if placement.keep_sampler_copy:
      out.append("set placement.keep_sampler_copy=False: the sampler copy and KV cache "
                 f"({_gib(sum(plan.sampler.values()))}) are then freed during the update")
    out.append("placement.mode=disaggregated puts the sampler weights and KV cache on their own "
               "devices")
  if kv > plan.device_bytes * 0.2:
    out.append(f"fewer slots (plan.slots={p['slots']} costs {_gib(kv)} of KV cache; halving it "
               f"saves {_gib(kv / 2)})")
    out.append(f"a shorter max length (plan.max_len={p['max_len']})")
  opt = plan.learner["actor gradients"] + plan.learner["actor optimizer state"]
  out.append(f"LoRA would shrink gradients and optimizer state ({_gib(opt)}) to a few percent")
  if cfg.param_dtype == "float32":
    out.append("model.param_dtype=bfloat16 halves every weight copy")
  out.append("more devices on fsdp shard the learner roles further")
  if not p["remat"]:
    out.append("plan.remat=True (activation recomputation) keeps only each layer's input")
  return out
