"""LoRA adapters on the decoder's weights: what they are, and the tree operations on them.

With model.lora.rank > 0 (ModelConfig.lora_rank), every weight named in lora_targets gets an
`nnx.LoRA` submodule `<weight>_lora` beside it (jaxrl.models.llama): Attention's `q_lora`,
`k_lora`, `v_lora`, `o_lora`, MLP's `gate_lora`, `up_lora`, `down_lora`, so a parameter path
is `layers/<i>/attn/q_lora/lora_a`. Over the weight flattened to [in, out] (q: D -> N*H, k and
v: D -> K*H, o: N*H -> D, gate and up: D -> F, down: F -> D), lora_a is [in, r] and lora_b
[r, out], zeros at init, and the adapted weight is

    W + (alpha / r) * lora_a @ lora_b.

Why nnx.LoRA rather than a hand-written pair of parameters: it is the kept library's adapter,
its variables are nnx.LoRAParam (a filter Tunix and flax's own examples train by), and its
a_metadata / b_metadata carry the logical axes, so the layouts shard adapters like their weights.
The forward adds the adapter's term to x @ W rather than merging (merging every step would
write a full copy of each adapted weight).

Params are pure nested dicts (nnx.to_pure_dict), so the helpers below find adapters by path:
a path component ending in `_lora`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.models import quant
from jaxrl.models.config import ModelConfig

SUFFIX = "_lora"


def _key_name(k) -> str:
  return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def is_lora_path(path) -> bool:
  """Whether a parameter path (a tuple of keys or jax key entries, or a "/" or "." joined
  string) lies inside a LoRA adapter."""
  if isinstance(path, str):
    parts = path.replace(".", "/").split("/")
  else:
    parts = [_key_name(k) for k in path]
  return any(p.endswith(SUFFIX) for p in parts)


def partition(tree, keep) -> dict:
  """The sub-tree of a nested dict whose leaf paths satisfy keep(path); empty dicts pruned."""
  def walk(node, path):
    if not isinstance(node, dict):
      return node if keep(path) else None
    out = {}
    for k, v in node.items():
      sub = walk(v, path + (k,))
      if sub is not None and not (isinstance(sub, dict) and not sub):
        out[k] = sub
    return out
  return walk(tree, ())


def split_lora(params) -> tuple[dict, dict]:
  """(base, adapters): the params without the adapters, and the adapters alone, both nested
  dicts in the params' own structure. The arrays are the params' own (nothing is copied)."""
  return (partition(params, lambda p: not is_lora_path(p)),
          partition(params, is_lora_path))


def combine(base, adapters) -> dict:
  """The inverse of split_lora: base with the adapters' sub-trees put back in place."""
  if not isinstance(adapters, dict):
    return adapters
  out = dict(base)
  for k, v in adapters.items():
    out[k] = combine(base.get(k, {}), v) if isinstance(v, dict) else v
  return out


def has_lora(params) -> bool:
  return bool(split_lora(params)[1])


def delta(cfg: ModelConfig, adapter, shape, dtype=jnp.float32) -> jax.Array:
  """(alpha / r) * lora_a @ lora_b in float32, reshaped to the adapted weight's shape and cast
  to `dtype`."""
  a, b = adapter["lora_a"], adapter["lora_b"]
  scale = cfg.lora_alpha / cfg.lora_rank
  ab = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))
  return (scale * ab).reshape(shape).astype(dtype)


def merge_lora(cfg: ModelConfig, params) -> dict:
  """The params without adapters, each adapted weight replaced by W + (alpha / r) * A @ B
  (summed in float32, in the weight's dtype and shape): a plain model of base_config(cfg) that
  computes what the adapted one does. Weights without an adapter are the params' own arrays.
  A quantised base (model.lora.quantize) is dequantised first (quant.dequantized_base: W in
  model.param_dtype, the scales dropped)."""
  if cfg.lora_quantize:
    params = quant.dequantized_base(cfg, params)

  def walk(node):
    out = {}
    for k, v in node.items():
      if str(k).endswith(SUFFIX):
        continue
      if isinstance(v, dict):
        out[k] = walk(v)
        continue
      adapter = node.get(f"{k}{SUFFIX}")
      if adapter is None:
        out[k] = v
      else:
        out[k] = (v.astype(jnp.float32) + delta(cfg, adapter, v.shape)).astype(v.dtype)
    return out
  return walk(params)


def as_base(cfg: ModelConfig, plain, target) -> dict:
  """A plain model's params (a checkpoint's, or merge_lora's) as the frozen base of `target`,
  the LoRA params they fill: the top-level entries target has, quantised when cfg quantises
  (quant.quantize_params), each leaf in the dtype of target's. Under jit when target holds
  abstract values; with arrays the quantisation is jitted into target's shardings."""
  base_t = split_lora(target)[0]
  plain = {k: plain[k] for k in base_t if k in plain}
  if not cfg.lora_quantize:
    return plain

  def quantised(p):
    return jax.tree.map(lambda x, t: x.astype(t.dtype), quant.quantize_params(cfg, p),
                        {k: base_t[k] for k in p})
  if all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
         for x in jax.tree.leaves(base_t)):
    shd = jax.tree.map(lambda x: x.sharding, {k: base_t[k] for k in plain})
    return jax.jit(quantised, out_shardings=shd)(plain)
  return quantised(plain)


def adapters_off(params) -> dict:
  """The params with every adapter zeroed (lora_a and lora_b): the base model's function in
  the adapted model's structure, so one graphdef serves policy and reference. The base
  weights are the params' own arrays, not copies; the adapters are new (small) zero arrays,
  never the policy's, which a train step donates. This is the frozen reference of a LoRA run:
  the base with adapters off."""
  def walk(node, inside):
    out = {}
    for k, v in node.items():
      if isinstance(v, dict):
        out[k] = walk(v, inside or str(k).endswith(SUFFIX))
      else:
        out[k] = jnp.zeros_like(v) if inside else v
    return out
  return walk(params, False)


def base_config(cfg: ModelConfig) -> ModelConfig:
  """The same model with LoRA off, its base unquantised: the structure of merge_lora's
  output (and of a plain checkpoint a LoRA run starts from)."""
  return cfg.replace(lora_rank=0, lora_targets=(), lora_dropout=0.0, lora_quantize="")


def trainable(path, extra: tuple[str, ...] = ()) -> bool:
  """Whether a LoRA run trains the parameter at `path`: an adapter, or anything under the
  top-level sub-trees named in `extra` (a reward model's head). The base decoder is frozen."""
  return is_lora_path(path) or (len(path) > 0 and _key_name(path[0]) in extra)


def describe(cfg: ModelConfig) -> str:
  """What a run's banner says of its LoRA: "" when off."""
  if not cfg.lora_rank:
    return ""
  base = "the base frozen" + (f", in {cfg.lora_quantize}" if cfg.lora_quantize else "")
  return (f" (LoRA rank {cfg.lora_rank} on {','.join(cfg.lora_targets)}: "
          f"{cfg.num_lora_params:,} trained, {base})")


def count(params) -> tuple[int, int]:
  """(adapter parameters, all parameters) of a params tree."""
  _, adapters = split_lora(params)
  size = lambda t: sum(int(x.size) for x in jax.tree.leaves(t))  # noqa: E731
  return size(adapters), size(params)
