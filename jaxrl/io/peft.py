"""LoRA adapters in and out: jaxrl's own adapter checkpoint (orbax) and Hugging Face PEFT's.

A LoRA run's adapters (jaxrl.models.lora: `layers/<i>/attn/q_lora/lora_a` [in, r], `lora_b`
[r, out], over each weight flattened to [in, out]) travel in two formats:

  jaxrl     DIR/config.json (the ModelConfig, lora_* fields included) + DIR/adapters/ (orbax,
            the adapter sub-tree alone, as jaxrl.io.params saves whole params): a few MB that
            go back onto any copy of the same base (save_adapters / load_adapters).
  PEFT      DIR/adapter_model.safetensors + DIR/adapter_config.json, what
            `PeftModel.from_pretrained(base, DIR)`, transformers' `from_pretrained(DIR)` and
            vLLM's `LoRARequest(name, id, DIR)` read (save_peft / load_peft).

PEFT's tensor map (adapter name dropped, as PEFT saves it; nn.Linear weights are [out, in]):
  base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight [r, in]
                                                    <-> layers.{i}.attn.{q,k,v,o}_lora.lora_a.T
  base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_B.weight [out, r]
                                                    <-> layers.{i}.attn.{q,k,v,o}_lora.lora_b.T
  base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
                                                    <-> layers.{i}.mlp.{gate,up,down}_lora...
Only transposes: jaxrl's adapters live on the weights already flattened the way HF's rows and
columns run (q's [D, N, H] flattens to [D, N*H], whose column n*H + h is HF q_proj's row n*H + h;
jaxrl.io.hf's _heads_in / _heads_out do the same reshape), so no head permutation is needed.
Both sides scale by lora_alpha / r (PEFT's default; use_rslora's alpha / sqrt(r) is read by
folding sqrt(r) into alpha).

Why write the safetensors and JSON ourselves rather than import peft: peft needs torch, which
jaxrl never imports at run time; the format is two files, and the round trip is checked against
real PEFT by a committed fixture (tests/fixtures/peft/, made by
tests/fixtures/make_peft_fixture.py).
"""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jaxrl.errors import ConfigError
from jaxrl.io.params import (_saved_tree, check_structure, config_from_dict, config_to_dict,
                              save_safetensors)
from jaxrl.models import lora
from jaxrl.models.config import LORA_WEIGHTS, ModelConfig
from jaxrl.models.hf_config import CORRUPT, read_json
from jaxrl.models.llama import abstract_model, is_stacked, per_layer
from jaxrl.parallel.layouts import tree_shardings

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
PREFIX = "base_model.model.model.layers"
# jaxrl weight name -> (its module in a layer, HF's module name under it)
HF_MODULES = {"q": ("attn", "self_attn.q_proj"), "k": ("attn", "self_attn.k_proj"),
              "v": ("attn", "self_attn.v_proj"), "o": ("attn", "self_attn.o_proj"),
              "gate": ("mlp", "mlp.gate_proj"), "up": ("mlp", "mlp.up_proj"),
              "down": ("mlp", "mlp.down_proj")}
_TARGET_OF = {hf.rsplit(".", 1)[1]: name for name, (_, hf) in HF_MODULES.items()}  # q_proj -> q


# ----------------------------------------------------------------------------- the map


def peft_names(cfg: ModelConfig) -> dict[tuple, str]:
  """jaxrl adapter path (layer indices as ints) -> PEFT tensor name, for every adapter of cfg."""
  out = {}
  for i in range(cfg.num_layers):
    for name in cfg.lora_targets:
      sub, hf = HF_MODULES[name]
      for mine, theirs in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
        out[("layers", i, sub, f"{name}{lora.SUFFIX}", mine)] = f"{PREFIX}.{i}.{hf}.{theirs}.weight"
  return out


def _peft_shape(cfg: ModelConfig, path: tuple) -> tuple[int, int]:
  d_in, d_out = cfg.lora_shape(path[3][:-len(lora.SUFFIX)])
  return (cfg.lora_rank, d_in) if path[-1] == "lora_a" else (d_out, cfg.lora_rank)


def _path_of(keypath) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in keypath)


def adapter_shardings(cfg: ModelConfig, mesh: Mesh, layout: str = "learner"):
  """(abstract adapters with their shardings, the adapters' shardings): the adapter sub-tree of
  cfg's parameters, placed as the layout places them beside their weights."""
  _, shapes, axes = abstract_model(cfg)
  shardings = tree_shardings(shapes, axes, mesh, layout)
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
  return lora.partition(target, lora.is_lora_path), lora.partition(shardings, lora.is_lora_path)


def _host(x) -> np.ndarray:
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ----------------------------------------------------------------------------- PEFT out


def adapter_config(cfg: ModelConfig, *, base_model_name_or_path: str = "") -> dict:
  """PEFT's adapter_config.json for cfg's adapters (LoraConfig's fields; vLLM reads r,
  lora_alpha, target_modules, bias, modules_to_save, use_rslora and use_dora)."""
  return {
      "peft_type": "LORA", "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path or None,
      "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
      "target_modules": [HF_MODULES[t][1].rsplit(".", 1)[1] for t in cfg.lora_targets],
      "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
      "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
      "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False,
      "use_dora": False, "revision": None,
  }


def save_peft(out: str, cfg: ModelConfig, params, *,
              base_model_name_or_path: str = "") -> list[str]:
  """Writes OUT/adapter_model.safetensors and OUT/adapter_config.json from the adapters in
  `params` (whole params or the adapters alone). Only process 0 writes. Returns the files."""
  if not cfg.lora_rank:
    raise ConfigError("this model has no LoRA adapters (model.lora.rank is 0): export its "
                      "full weights with `jaxrl convert jaxrl-to-hf` instead.")
  names = peft_names(cfg)
  _, adapters = lora.split_lora(params)
  flat = per_layer({_path_of(p): x for p, x in jax.tree_util.tree_flatten_with_path(adapters)[0]},
                   cfg.num_layers)
  if set(flat) != set(names):
    missing = sorted(map(str, set(names) - set(flat)))
    extra = sorted(map(str, set(flat) - set(names)))
    raise ConfigError(f"the adapters do not match the config's model.lora section: missing "
                      f"{missing[:2]}, unexpected {extra[:2]}.")
  tensors = {names[p]: np.ascontiguousarray(_host(x).T) for p, x in flat.items()}
  if jax.process_index() == 0:
    os.makedirs(out, exist_ok=True)
    save_safetensors(tensors, os.path.join(out, PEFT_WEIGHTS))
    with open(os.path.join(out, PEFT_CONFIG), "w") as f:
      json.dump(adapter_config(cfg, base_model_name_or_path=base_model_name_or_path), f,
                indent=2)
  return [PEFT_WEIGHTS, PEFT_CONFIG]


# ----------------------------------------------------------------------------- PEFT in


def read_adapter_config(path: str) -> dict:
  """DIR/adapter_config.json, checked to be a LoRA adapter jaxrl can run: one sentence naming
  the file and key otherwise."""
  file = os.path.join(path, PEFT_CONFIG)
  if not os.path.isfile(file):
    raise ConfigError(f"{path!r} holds no {PEFT_CONFIG}: give a PEFT adapter directory (what "
                      "save_pretrained of a PeftModel writes).")
  conf = read_json(file)
  if not isinstance(conf, dict):
    raise ConfigError(f"{file} is not a JSON object: {CORRUPT}.")
  if str(conf.get("peft_type", "")).upper() != "LORA":
    raise ConfigError(f"{file}: peft_type is {conf.get('peft_type')!r}; jaxrl reads LORA "
                      "adapters only.")
  for key, ok, why in (
      ("use_dora", lambda v: not v, "DoRA's magnitude vectors have no place in jaxrl's adapters"),
      ("bias", lambda v: v in (None, "none"), "trained biases are not part of jaxrl's adapters"),
      ("modules_to_save", lambda v: not v, "fully trained modules are not adapters"),
      ("rank_pattern", lambda v: not v, "jaxrl's adapters share one rank"),
      ("alpha_pattern", lambda v: not v, "jaxrl's adapters share one alpha"),
      ("layers_to_transform", lambda v: v is None, "jaxrl adapts every layer"),
      ("fan_in_fan_out", lambda v: not v, "it is for GPT-2's Conv1D layers"),
      ("lora_bias", lambda v: not v, "jaxrl's adapters have no bias"),
      ("use_qalora", lambda v: not v, "jaxrl's adapters are plain LoRA"),
      ("layer_replication", lambda v: not v, "jaxrl adapts each layer once"),
      ("target_parameters", lambda v: not v, "jaxrl adapts modules, not parameters"),
      ("trainable_token_indices", lambda v: not v, "jaxrl trains no embedding rows"),
  ):
    if not ok(conf.get(key)):
      raise ConfigError(f"{file}: {key}={conf.get(key)!r} is not supported ({why}); export the "
                        f"adapter with {key} at its default.")
  return conf


def _targets_of(conf: dict, file: str) -> tuple[str, ...]:
  modules = conf.get("target_modules")
  if modules == "all-linear":
    return LORA_WEIGHTS
  if isinstance(modules, str) or not modules:
    raise ConfigError(f"{file}: target_modules={modules!r} must be a list of module names "
                      f"(of {', '.join(_TARGET_OF)}) or 'all-linear'.")
  names = set()
  for m in modules:
    short = str(m).rsplit(".", 1)[-1]
    if short not in _TARGET_OF:
      raise ConfigError(f"{file}: target_modules names {m!r}, which jaxrl cannot adapt: use "
                        f"{', '.join(_TARGET_OF)}.")
    names.add(_TARGET_OF[short])
  return tuple(t for t in LORA_WEIGHTS if t in names)


def peft_lora_section(path: str) -> dict:
  """The model.lora section {rank, alpha, dropout, targets} that runs DIR's adapter as PEFT
  does (use_rslora's alpha / sqrt(r) scale folded into alpha)."""
  conf = read_adapter_config(path)
  file = os.path.join(path, PEFT_CONFIG)
  r = conf.get("r")
  if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
    raise ConfigError(f"{file}: r={r!r} must be a positive integer.")
  alpha = float(conf.get("lora_alpha", 8))
  if conf.get("use_rslora"):
    alpha *= math.sqrt(r)
  return {"rank": r, "alpha": alpha, "dropout": float(conf.get("lora_dropout") or 0.0),
          "targets": ",".join(_targets_of(conf, file))}


def load_peft(path: str, cfg: ModelConfig, mesh: Mesh, layout: str = "learner"):
  """The adapters of a PEFT adapter directory as cfg's adapter sub-tree (float32), placed in
  `layout` on `mesh`. cfg's model.lora section must be the adapter's (peft_lora_section gives
  it): a different rank, alpha or target, or a tensor missing, extra or of another shape, is
  one sentence naming the file and the tensor."""
  from safetensors import SafetensorError, safe_open
  file = os.path.join(path, PEFT_CONFIG)
  want = peft_lora_section(path)
  have = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha,
          "targets": ",".join(cfg.lora_targets)}
  for key in ("rank", "targets", "alpha"):
    if key == "alpha" and math.isclose(want[key], have[key], rel_tol=1e-6):
      continue
    if want[key] != have[key]:
      raise ConfigError(f"{file}: the adapter has {key} {want[key]!r} but model.lora.{key} is "
                        f"{have[key]!r}: set --config.model.lora.{key}={want[key]!r} (the "
                        "adapter's own).")
  weights = os.path.join(path, PEFT_WEIGHTS)
  if not os.path.isfile(weights):
    raise ConfigError(f"{path!r} holds no {PEFT_WEIGHTS} (jaxrl reads PEFT's safetensors, not "
                      "adapter_model.bin): save the adapter with safe_serialization=True.")
  names = peft_names(cfg)
  try:
    with safe_open(weights, framework="np") as f:
      keys = set(f.keys())
      by_name = {}
      for name in keys:
        by_name[name] = f.get_tensor(name)
  except (SafetensorError, OSError) as e:
    raise ConfigError(f"{weights} could not be read as safetensors ({e}): {CORRUPT}.") from None
  # Some writers keep the adapter's name ("...q_proj.lora_A.default.weight"); read those too.
  by_name = {k.replace(".default.weight", ".weight"): v for k, v in by_name.items()}
  extra = sorted(set(by_name) - set(names.values()))
  if extra:
    raise ConfigError(f"{weights}: tensor {extra[0]} has no place in this model's adapters "
                      f"(layers {cfg.num_layers}, targets {','.join(cfg.lora_targets)}): give "
                      "the adapter trained on this base.")
  abstract, _ = adapter_shardings(cfg, mesh, layout)

  def tensor(p):
    name = names[p]
    if name not in by_name:
      raise ConfigError(f"{weights}: tensor {name} is missing: the adapter does not adapt "
                        "every layer the config's targets name.")
    x = by_name[name]
    if tuple(x.shape) != _peft_shape(cfg, p):
      raise ConfigError(f"{weights}: tensor {name} has shape {list(x.shape)} but this model "
                        f"needs {list(_peft_shape(cfg, p))}: the adapter was trained on another "
                        "base (or another rank).")
    return np.ascontiguousarray(x.astype(np.float32).T)

  def one(keypath, a):
    p = _path_of(keypath)
    host = (np.stack([tensor(("layers", i, *p[1:])) for i in range(cfg.num_layers)])
            if is_stacked(p) else tensor(p)).astype(a.dtype)
    return jax.make_array_from_callback(a.shape, a.sharding, lambda ix: host[ix])

  return jax.tree_util.tree_map_with_path(one, abstract)


def apply_peft(path: str, cfg: ModelConfig, params, mesh: Mesh, layout: str = "learner"):
  """params (a LoRA model of cfg: its base) with their adapters replaced by DIR's."""
  return lora.combine(lora.split_lora(params)[0], load_peft(path, cfg, mesh, layout))


# ----------------------------------------------------------------------------- jaxrl format


def save_adapters(path: str, cfg: ModelConfig, params) -> None:
  """Writes PATH/config.json (the ModelConfig) and PATH/adapters (orbax): the adapters alone,
  whole params or the adapter sub-tree given. Every process must call it."""
  if not cfg.lora_rank:
    raise ConfigError("this model has no LoRA adapters (model.lora.rank is 0): save its params "
                      "with jaxrl.io.params.save_params instead.")
  _, adapters = lora.split_lora(params)
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(path, "adapters"), adapters, force=True)
  ckpt.wait_until_finished()
  if jax.process_index() == 0:
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(config_to_dict(cfg), f, indent=2)


def load_adapters(path: str, cfg: ModelConfig, mesh: Mesh, layout: str = "learner"):
  """The adapters save_adapters wrote, checked against cfg tensor by tensor and placed in
  `layout` on `mesh`; put them on a base with jaxrl.models.lora.combine(base, adapters)."""
  file = os.path.join(path, "config.json")
  where = os.path.join(os.path.abspath(path), "adapters")
  if not os.path.isfile(file) or not os.path.isdir(where):
    raise ConfigError(f"{path!r} is not a jaxrl adapter checkpoint: it needs config.json and "
                      "adapters/ (written by jaxrl.io.peft.save_adapters).")
  saved = config_from_dict(read_json(file), where=file)
  if saved.lora_alpha != cfg.lora_alpha:
    raise ConfigError(f"{file}: the adapters were trained with model.lora.alpha="
                      f"{saved.lora_alpha} but the config has {cfg.lora_alpha}: set "
                      f"--config.model.lora.alpha={saved.lora_alpha}.")
  abstract, _ = adapter_shardings(cfg, mesh, layout)
  check_structure(_saved_tree(where), abstract, where=f"{path!r}",
                  fix="set model.lora (rank, targets) and the model to those it was saved with")
  return ocp.StandardCheckpointer().restore(where, abstract)


def describe(path: str, *, out=print) -> None:
  """Says what a PEFT adapter directory holds and how to load it."""
  conf = read_adapter_config(path)
  base = conf.get("base_model_name_or_path") or "(no base named)"
  size = os.path.getsize(os.path.join(path, PEFT_WEIGHTS))
  out(f"PEFT LoRA adapter: r={conf['r']}, lora_alpha={conf['lora_alpha']}, targets "
      f"{','.join(conf['target_modules'])}, {size / 2**20:.2f} MiB -> {path}")
  out(f"base: {base}  (load: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained"
      f"(base), {path!r}); vLLM: LoRARequest(name, 1, {path!r}); or rerun with --merge for "
      "full weights)")
