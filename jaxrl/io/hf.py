"""Hugging Face checkpoints in and out: config.json <-> ModelConfig, safetensors <-> params.

Reading never needs torch: safetensors' numpy API (`safe_open(..., framework="np")` and
`get_slice(name)[index]`) reads only the byte ranges asked for, and every parameter is built by
`jax.make_array_from_callback` with its target NamedSharding, so each host reads exactly the
slices its own devices hold. No host materialises a full tensor it does not need.

Tensor map (HF name -> jaxrl path; HF linear weights are [out, in]):
  model.embed_tokens.weight [V, D]                    -> embed [V, D]
  model.layers.{i}.self_attn.q_proj.weight [N*H, D]   -> layers.{i}.attn.q [D, N, H]
  model.layers.{i}.self_attn.{k,v}_proj.weight [K*H, D] -> layers.{i}.attn.{k,v} [D, K, H]
  model.layers.{i}.self_attn.o_proj.weight [D, N*H]   -> layers.{i}.attn.o [N, H, D]
  model.layers.{i}.self_attn.{q,k,v}_proj.bias        -> layers.{i}.attn.{q,k,v}_bias  (Qwen2)
  model.layers.{i}.self_attn.{q,k}_norm.weight [H]    -> layers.{i}.attn.{q,k}_norm.scale (Qwen3)
  model.layers.{i}.mlp.{gate,up}_proj.weight [F, D]   -> layers.{i}.mlp.{gate,up} [D, F]
  model.layers.{i}.mlp.down_proj.weight [D, F]        -> layers.{i}.mlp.down [F, D]
  model.layers.{i}.input_layernorm.weight             -> layers.{i}.attn_norm.scale
  model.layers.{i}.post_attention_layernorm.weight    -> layers.{i}.mlp_norm.scale
  model.norm.weight                                   -> final_norm.scale
  lm_head.weight [V, D]                               -> lm_head [D, V]  (untied only)
jaxrl's RoPE rotates halves as HF does, so q and k need no permutation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable

import jax
import ml_collections
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.io.params import load_params, restore_params, save_params, save_safetensors
from jaxrl.models.config import ModelConfig, RopeScaling  # noqa: F401  (hf.RopeScaling)
# The config.json map lives with the model, where the config loader reads it without reaching
# up into io; its names stay importable from here too, beside the tensor map.
from jaxrl.models.hf_config import (  # noqa: F401
    ARCHITECTURES, config_from_hf, config_to_hf, family_for, family_of, read_hf_config)
from jaxrl.models.hf_config import CORRUPT, read_json
from jaxrl.models import lora, quant
from jaxrl.models.llama import abstract_model, is_stacked, per_layer
from jaxrl.parallel.layouts import init_params, tree_shardings

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_HF_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


# ----------------------------------------------------------------------------- tensor map


@dataclasses.dataclass(frozen=True)
class _Map:
  """How one jaxrl parameter comes from one HF tensor.

  `hf_index(index)` turns the jaxrl shard's index (a tuple of ranges) into the HF tensor's
  slice to read, and `to_jaxrl(block, index)` turns what was read into the shard.
  `to_hf(x)` turns a whole jaxrl array into the HF tensor (export).
  """

  hf_name: str
  hf_shape: tuple[int, ...]
  hf_index: Callable
  to_jaxrl: Callable
  to_hf: Callable


def _ident(name, shape):
  return _Map(name, shape, lambda ix: ix, lambda b, ix: b, lambda x: x)


def _transposed(name, shape_hf):  # jaxrl [a, b] <- HF [b, a]
  return _Map(name, shape_hf, lambda ix: (ix[1], ix[0]), lambda b, ix: b.T, lambda x: x.T)


def _heads_in(name, d, n, h):
  """jaxrl [D, N, H] <- HF [N*H, D]: the heads' rows, then the head_dim range inside them."""
  return _Map(
      name, (n * h, d),
      lambda ix: (slice(ix[1].start * h, ix[1].stop * h), ix[0]),
      lambda b, ix: b.reshape(-1, h, b.shape[-1])[:, ix[2]].transpose(2, 0, 1),
      lambda x: x.reshape(d, n * h).T)


def _heads_out(name, d, n, h):
  """jaxrl [N, H, D] <- HF [D, N*H]."""
  return _Map(
      name, (d, n * h),
      lambda ix: (ix[2], slice(ix[0].start * h, ix[0].stop * h)),
      lambda b, ix: b.reshape(b.shape[0], -1, h)[:, :, ix[1]].transpose(1, 2, 0),
      lambda x: x.reshape(n * h, d).T)


def _heads_bias(name, n, h):
  """jaxrl [N, H] <- HF [N*H]."""
  return _Map(
      name, (n * h,),
      lambda ix: (slice(ix[0].start * h, ix[0].stop * h),),
      lambda b, ix: b.reshape(-1, h)[:, ix[1]],
      lambda x: x.reshape(n * h))


def tensor_map(cfg: ModelConfig) -> dict[tuple, _Map]:
  """jaxrl parameter path (a tuple, layer indices as ints) -> its HF tensor."""
  d, n, k, h, f, v = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.mlp_dim, cfg.vocab_size)
  out = {("embed",): _ident("model.embed_tokens.weight", (v, d)),
         ("final_norm", "scale"): _ident("model.norm.weight", (d,))}
  if not cfg.tie_embeddings:
    out[("lm_head",)] = _transposed("lm_head.weight", (v, d))
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out.update({
        ("layers", i, "attn", "q"): _heads_in(a + "q_proj.weight", d, n, h),
        ("layers", i, "attn", "k"): _heads_in(a + "k_proj.weight", d, k, h),
        ("layers", i, "attn", "v"): _heads_in(a + "v_proj.weight", d, k, h),
        ("layers", i, "attn", "o"): _heads_out(a + "o_proj.weight", d, n, h),
        ("layers", i, "mlp", "gate"): _transposed(p + "mlp.gate_proj.weight", (f, d)),
        ("layers", i, "mlp", "up"): _transposed(p + "mlp.up_proj.weight", (f, d)),
        ("layers", i, "mlp", "down"): _transposed(p + "mlp.down_proj.weight", (d, f)),
        ("layers", i, "attn_norm", "scale"): _ident(p + "input_layernorm.weight", (d,)),
        ("layers", i, "mlp_norm", "scale"): _ident(p + "post_attention_layernorm.weight",
                                                     (d,)),
    })
    if cfg.qkv_bias:
      out[("layers", i, "attn", "q_bias")] = _heads_bias(a + "q_proj.bias", n, h)
      out[("layers", i, "attn", "k_bias")] = _heads_bias(a + "k_proj.bias", k, h)
      out[("layers", i, "attn", "v_bias")] = _heads_bias(a + "v_proj.bias", k, h)
    if cfg.qk_norm:
      out[("layers", i, "attn", "q_norm", "scale")] = _ident(a + "q_norm.weight", (h,))
      out[("layers", i, "attn", "k_norm", "scale")] = _ident(a + "k_norm.weight", (h,))
  return out


# ----------------------------------------------------------------------------- safetensors


def _weight_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file, from model.safetensors.index.json or the one file."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    index_json = read_json(index)
    weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
    if not isinstance(weight_map, dict):
      raise ConfigError(f"{index} has no \"weight_map\" object: {CORRUPT}.")
    for name, file in weight_map.items():
      if not os.path.isfile(os.path.join(path, file)):
        raise ConfigError(f"{index}: tensor {name} is in {file}, which is missing: copy every "
                          "shard the index lists.")
    for file in sorted(set(weight_map.values())):
      _tensor_names(os.path.join(path, file))  # a damaged shard fails here, named
    return {name: os.path.join(path, file) for name, file in weight_map.items()}
  files = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
  if not files:
    raise ConfigError(f"{path!r} holds no *.safetensors files (and no "
                      "model.safetensors.index.json): jaxrl reads safetensors checkpoints only.")
  out = {}
  for file in files:
    out.update({name: os.path.join(path, file)
                for name in _tensor_names(os.path.join(path, file))})
  return out


def _tensor_names(file: str) -> list[str]:
  """The tensor names in a safetensors file's header. Opening checks the header against the
  file's size, so a truncated or damaged file fails here with one sentence naming it."""
  from safetensors import SafetensorError, safe_open
  try:
    with safe_open(file, framework="np") as f:
      return list(f.keys())
  except (SafetensorError, OSError) as e:
    raise ConfigError(f"{file} could not be read as safetensors ({e}): {CORRUPT}.") from None


class _Reader:
  """Open safetensors files, and a log of every slice read (tests check shard-sized reads)."""

  def __init__(self):
    self.handles: dict = {}
    self.reads: list[tuple[str, tuple[int, ...]]] = []

  def slice(self, file: str, name: str, index: tuple) -> np.ndarray:
    from safetensors import safe_open
    if file not in self.handles:
      self.handles[file] = safe_open(file, framework="np")
    block = self.handles[file].get_slice(name)[index]
    self.reads.append((name, block.shape))
    return block

  def close(self):
    self.handles.clear()


def _norm_index(index, shape) -> tuple[slice, ...]:
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _path_of(keypath) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in keypath)


def _check(path: str, files: dict[str, str], maps: dict) -> None:
  """Every tensor is present with its expected shape; one sentence names the first bad one."""
  from safetensors import safe_open
  missing = [m.hf_name for m in maps.values() if m.hf_name not in files]
  if missing:
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    raise ConfigError(f"{path}: tensor {missing[0]} is missing{more}: the checkpoint does not "
                      "match its config.json.")
  by_file: dict[str, list] = {}
  for m in maps.values():
    by_file.setdefault(files[m.hf_name], []).append(m)
  for file, ms in by_file.items():
    with safe_open(file, framework="np") as f:
      for m in ms:
        sl = f.get_slice(m.hf_name)
        shape = tuple(sl.get_shape())
        if shape != m.hf_shape:
          raise ConfigError(f"{path}: tensor {m.hf_name} has shape {list(shape)} but "
                            f"config.json implies {list(m.hf_shape)}.")
        if sl.get_dtype() not in _HF_DTYPES:
          raise ConfigError(f"{path}: tensor {m.hf_name} has dtype {sl.get_dtype()}: jaxrl "
                            f"reads {', '.join(_HF_DTYPES)}.")


# The ModelConfig fields that shape the parameters. param_dtype is not one: load_hf casts every
# tensor to model.param_dtype, which is how a bf16 checkpoint trains in fp32.
_SHAPE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim", "qkv_bias", "qk_norm", "tie_embeddings")


def _check_config(path: str, cfg: ModelConfig, saved: ModelConfig) -> None:
  """The model the config asks for has the checkpoint's shapes: an override such as
  model.num_layers=1 would otherwise read a subset of the tensors and drop the rest."""
  for name in _SHAPE_FIELDS:
    want, have = getattr(cfg, name), getattr(saved, name)
    if want != have:
      raise ConfigError(f"model.{name}={want!r} but model.hf_path={path!r} has {have!r} (its "
                        f"config.json): drop the model.{name} override, or the checkpoint's "
                        "tensors would not fit the model.")


def load_hf(path: str, mesh: Mesh, layout: str = "learner", *, cfg: ModelConfig | None = None,
            param_dtype: str | None = None, reader: _Reader | None = None):
  """(cfg, graphdef, params) from an HF checkpoint directory, placed in `layout` on `mesh`.

  Every parameter is made by jax.make_array_from_callback with its target sharding; the
  callback reads only that device's slice from safetensors, so a host reads what its devices
  hold and nothing else. Shards replicated across this host's devices are read once.
  """
  where = os.path.join(path, "config.json")
  if cfg is None:
    cfg = config_from_hf(read_hf_config(path), param_dtype=param_dtype, where=where)
  else:
    _check_config(path, cfg, config_from_hf(read_hf_config(path), where=where))
  graphdef, shapes, axes = abstract_model(cfg)
  shardings = tree_shardings(shapes, axes, mesh, layout)
  maps = tensor_map(cfg)
  files = _weight_files(path)
  _check(path, files, maps)
  reader = _Reader() if reader is None else reader
  dtype = _NP_DTYPES[cfg.param_dtype]

  def read_one(m: _Map, ix) -> np.ndarray:
    block = reader.slice(files[m.hf_name], m.hf_name, m.hf_index(ix))
    return np.ascontiguousarray(m.to_jaxrl(block, ix)).astype(dtype)

  def one(keypath, shape, sharding):
    path = _path_of(keypath)
    cache: dict = {}

    def read(index):
      ix = _norm_index(index, shape.shape)
      key = tuple((s.start, s.stop) for s in ix)
      if key not in cache:
        if is_stacked(path):  # a scanned model's [L, ...] leaf: its layers' tensors, stacked
          cache[key] = np.stack([read_one(maps[("layers", i, *path[1:])], ix[1:])
                                 for i in range(ix[0].start, ix[0].stop)])
        else:
          cache[key] = read_one(maps[path], ix)
      return cache[key]

    return jax.make_array_from_callback(shape.shape, sharding, read)

  try:
    params = jax.tree_util.tree_map_with_path(one, shapes, shardings)
  finally:
    reader.close()
  return cfg, graphdef, params


# ----------------------------------------------------------------------------- export


def _host_array(x: jax.Array) -> np.ndarray:
  """One parameter on this host, whole. Across processes it is gathered one tensor at a time,
  so host memory peaks at the largest tensor, not the model."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_hf(out: str, cfg: ModelConfig, params, *, max_shard_bytes: int = 2 << 30,
            extra_config: dict | None = None) -> list[str]:
  """Writes config.json and safetensors shards (with model.safetensors.index.json when there is
  more than one) that transformers loads unchanged. Only process 0 writes. Returns the files."""
  maps = tensor_map(cfg)
  flat = per_layer({_path_of(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]},
                   cfg.num_layers)
  if set(flat) != set(maps):
    extra, missing = set(flat) - set(maps), set(maps) - set(flat)
    raise ConfigError(f"params do not match the config: unexpected {sorted(map(str, extra))[:3]}"
                      f", missing {sorted(map(str, missing))[:3]}.")
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(out, exist_ok=True)
    # A previous export's shards or index would shadow this one's (loaders follow the index).
    for old in os.listdir(out):
      if old.endswith(".safetensors") or old == "model.safetensors.index.json":
        os.remove(os.path.join(out, old))
  # Plan the shards from the shapes first, so each file's name carries the total count.
  shards, size = [[]], 0
  for path, m in maps.items():
    nbytes = math.prod(m.hf_shape) * np.dtype(_NP_DTYPES[cfg.param_dtype]).itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(path)
    size += nbytes
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  weight_map, total = {}, 0
  for name, shard in zip(names, shards):
    tensors = {}
    for path in shard:
      m = maps[path]
      x = np.ascontiguousarray(m.to_hf(_host_array(flat[path])))
      tensors[m.hf_name] = x
      weight_map[m.hf_name] = name
      total += x.nbytes
    if writer:
      save_safetensors(tensors, os.path.join(out, name))
  if writer:
    with open(os.path.join(out, "config.json"), "w") as f:
      json.dump(config_to_hf(cfg, extra=extra_config), f, indent=2)
    if len(names) > 1:
      with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names + ["config.json"] + (["model.safetensors.index.json"] if len(names) > 1 else [])


# ----------------------------------------------------------------------------- convert

# Files of an HF checkpoint that travel with it untouched (tokenizer and generation settings).
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "generation_config.json")


def _carry(src: str, dst: str) -> list[str]:
  import shutil
  os.makedirs(dst, exist_ok=True)
  names = [n for n in CARRIED_FILES if os.path.isfile(os.path.join(src, n))]
  for name in names:
    shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
  return names


def hf_to_jaxrl(src: str, out: str, mesh: Mesh, *, param_dtype: str | None = None) -> ModelConfig:
  """HF directory -> jaxrl checkpoint (config.json, params/ and hf/ with the HF config.json and
  tokenizer files, so `jaxrl_to_hf` writes back a servable directory)."""
  cfg, _, params = load_hf(src, mesh, "learner", param_dtype=param_dtype)
  save_params(out, cfg, params)
  if jax.process_index() == 0:
    _carry(src, os.path.join(out, "hf"))
    with open(os.path.join(out, "hf", "config.json"), "w") as f:
      json.dump(read_hf_config(src), f, indent=2)
  return cfg


def jaxrl_to_hf(checkpoint: str, out: str, mesh: Mesh, *, merge: bool = False,
                max_shard_bytes: int = 2 << 30) -> list[str]:
  """jaxrl checkpoint -> HF directory: config.json, safetensors shards (+ index), and the
  tokenizer files the import carried. `checkpoint` is a jaxrl checkpoint (hf-to-jaxrl's
  output) or a training run directory (the --workdir of jaxrl sft / grpo: its latest params,
  with the config and tokenizer of the model.hf_path it started from).

  A LoRA checkpoint (model.lora.rank > 0) is written either merged (merge=True: W + (alpha/r)
  BA in each weight's dtype, a plain model any HF loader reads) or as what a PEFT user expects:
  OUT holds the adapter (adapter_model.safetensors, adapter_config.json) and the tokenizer
  files, and adapter_config.json's base_model_name_or_path names the base. That is the run's
  model.hf_path (absolute) when the run's base is that checkpoint's weights unchanged; when it
  is not (a preset's random base, or an init.checkpoint whose earlier adapters were merged into
  the base), the base is written too, to OUT/base, and named there."""
  base_path = ""
  if os.path.isdir(os.path.join(checkpoint, "checkpoints")):
    cfg, params, carried, base_path = _run_params(checkpoint, mesh)
  else:
    cfg, _, params = load_params(checkpoint, mesh, "learner")
    carried = os.path.join(checkpoint, "hf")
  extra = None
  if carried and os.path.isfile(os.path.join(carried, "config.json")):
    with open(os.path.join(carried, "config.json")) as f:
      extra = json.load(f)
  if merge and not cfg.lora_rank:
    raise ConfigError(f"--merge: {checkpoint!r} has no LoRA adapters (its model.lora.rank is "
                      "0), so there is nothing to merge: drop --merge.")
  if merge:
    params, cfg = lora.merge_lora(cfg, params), lora.base_config(cfg)
  elif cfg.lora_rank:
    return _export_lora(out, cfg, params, carried, base_path, extra, max_shard_bytes)
  files = save_hf(out, cfg, params, max_shard_bytes=max_shard_bytes, extra_config=extra)
  if jax.process_index() == 0 and os.path.isdir(carried):
    files += _carry(carried, out)
  return files


def _export_lora(out, cfg, params, carried, base_path, extra, max_shard_bytes) -> list[str]:
  """The PEFT adapter in OUT, naming its base: base_path when given, else OUT/base (written
  here: the params' base weights as a full HF checkpoint)."""
  from jaxrl.io import peft
  base, _ = lora.split_lora(params)
  if cfg.lora_quantize:  # QLoRA: the base the adapters trained against, dequantised
    base = quant.dequantized_base(cfg, base)
  files = []
  if not base_path:
    base_path = os.path.join(os.path.abspath(out), "base")
    files += [os.path.join("base", f) for f in save_hf(
        base_path, lora.base_config(cfg), base, max_shard_bytes=max_shard_bytes,
        extra_config=extra)]
    if jax.process_index() == 0 and os.path.isdir(carried):
      files += [os.path.join("base", f) for f in _carry(carried, base_path)]
  files += peft.save_peft(out, cfg, params, base_model_name_or_path=base_path)
  if jax.process_index() == 0 and os.path.isdir(carried):
    files += _carry(carried, out)
  return files


def _run_params(run_dir: str, mesh: Mesh):
  """(cfg, params, hf_dir, base_path) of a training run: the model its config.json names, the
  latest checkpoint's params, the HF directory it started from ("" for a preset), and, for a
  LoRA run whose frozen base is that directory's weights unchanged (no init.checkpoint), its
  absolute path ("" otherwise)."""
  file = os.path.join(run_dir, "config.json")
  if not os.path.isfile(file):
    raise ConfigError(f"{run_dir!r} holds checkpoints/ but no config.json: give the run "
                      "directory a jaxrl trainer wrote.")
  with open(file) as f:
    config = ml_collections.ConfigDict(json.load(f))
  cfg = config_lib.model_config(config)
  _, shapes, axes = abstract_model(cfg)
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, tree_shardings(shapes, axes, mesh, "learner"))
  params = restore_params(run_dir, target, key="--checkpoint")
  return cfg, params, config.model.get("hf_path") or "", frozen_base_path(config)


def frozen_base_path(config) -> str:
  """The HF directory whose weights are a LoRA run's frozen base, unchanged (absolute): its
  model.hf_path when no init.checkpoint replaced them; "" when the base is not on disk as an
  HF checkpoint (a preset's random init, or an init.checkpoint whose adapters were merged in)."""
  hf_path = config.model.get("hf_path") or ""
  init = config.get("init") or {}
  return os.path.abspath(hf_path) if hf_path and not init.get("checkpoint") else ""


def params_from_config(config, mesh: Mesh, layout: str = "learner"):
  """(cfg, graphdef, params) for a config's model section: the weights of model.hf_path when
  it is set (with the section's overrides, e.g. model.param_dtype), else a random init."""
  cfg = config_lib.model_config(config)
  path = config.model.get("hf_path") or ""
  if not path:
    graphdef, params = init_params(cfg, mesh, layout, seed=config.get("seed", 0))
    return cfg, graphdef, params
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ConfigError(f"model.hf_path={path!r} holds no config.json: download or copy the "
                      "Hugging Face checkpoint there (config.json, *.safetensors, tokenizer).")
  return load_hf(path, mesh, layout, cfg=cfg)
