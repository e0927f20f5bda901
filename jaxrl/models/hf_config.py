"""Hugging Face config.json <-> ModelConfig: which architectures jaxrl reads and how their
fields map. Pure description (no tensors, no layouts), so that the config loader can resolve
model.hf_path to its shapes without reaching up into jaxrl.io."""

from __future__ import annotations

import json
import os

from jaxrl.errors import ConfigError
from jaxrl.models.config import ModelConfig, RopeScaling

# architectures[0] -> (family, model_type). The family sets qkv bias and qk-norm.
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
}
_MODEL_TYPES = {mt: (fam, arch) for arch, (fam, mt) in ARCHITECTURES.items()}


CORRUPT = "the checkpoint is damaged or partly downloaded: download it again"


def read_json(file: str):
  """A checkpoint's JSON file (config.json, tokenizer_config.json, the safetensors index); one
  sentence naming the file when it is not JSON, rather than a JSONDecodeError."""
  try:
    with open(file, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{file} is not valid JSON ({e.msg} at line {e.lineno} column "
                      f"{e.colno}): {CORRUPT}.") from None
  except UnicodeDecodeError:
    raise ConfigError(f"{file} is not UTF-8 text: {CORRUPT}.") from None


def read_hf_config(path: str) -> dict:
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file):
    raise ConfigError(f"{path!r} holds no config.json: point at a Hugging Face checkpoint "
                      "directory (config.json plus *.safetensors).")
  hf = read_json(file)
  if not isinstance(hf, dict):
    raise ConfigError(f"{file} holds a JSON {type(hf).__name__}, not an object: {CORRUPT}.")
  return hf


def family_of(hf: dict, where: str = "config.json") -> str:
  archs = hf.get("architectures") or []
  for arch in archs:
    if arch in ARCHITECTURES:
      return ARCHITECTURES[arch][0]
  if not archs and hf.get("model_type") in _MODEL_TYPES:
    return _MODEL_TYPES[hf["model_type"]][0]
  name = archs[0] if archs else f"model_type {hf.get('model_type')!r}"
  raise ConfigError(f"{where}: architecture {name} is not supported: jaxrl reads "
                    f"{', '.join(ARCHITECTURES)}.")


def _rope(hf: dict, where: str) -> tuple[float, RopeScaling | None]:
  # transformers >= 5 nests both under rope_parameters; older configs keep them top level.
  params = dict(hf.get("rope_parameters") or {})
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
  scaling = hf.get("rope_scaling") or (params if params.get("rope_type") else None)
  if not scaling:
    return theta, None
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise ConfigError(f"{where}: rope_scaling type {kind!r} is not supported: jaxrl implements "
                      "'llama3' scaling (and none).")
  return theta, RopeScaling(factor=float(scaling["factor"]),
                            low_freq_factor=float(scaling["low_freq_factor"]),
                            high_freq_factor=float(scaling["high_freq_factor"]),
                            original_max_position=int(
                                scaling["original_max_position_embeddings"]))


def config_from_hf(hf: dict, *, param_dtype: str | None = None,
                   where: str = "config.json") -> ModelConfig:
  """A ModelConfig from a parsed config.json. param_dtype defaults to the checkpoint's own
  (float16 checkpoints load as float32, which holds every float16 value exactly)."""
  family = family_of(hf, where)
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ConfigError(f"{where}: hidden_act={act!r} is not supported: jaxrl's MLP is SwiGLU "
                      "(silu).")
  if hf.get("mlp_bias"):
    raise ConfigError(f"{where}: mlp_bias=true is not supported (no jaxrl family has MLP "
                      "biases).")
  if family == "llama" and hf.get("attention_bias"):
    raise ConfigError(f"{where}: attention_bias=true is not supported for Llama (it adds an "
                      "o_proj bias jaxrl does not have).")
  if family == "qwen3" and hf.get("attention_bias"):
    raise ConfigError(f"{where}: attention_bias=true is not supported for Qwen3.")
  if hf.get("use_sliding_window"):
    raise ConfigError(f"{where}: use_sliding_window=true is not supported: jaxrl attends to the "
                      "full sequence.")
  theta, scaling = _rope(hf, where)
  d, n = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  if param_dtype is None:
    dt = hf.get("dtype", hf.get("torch_dtype", "float32")) or "float32"
    param_dtype = "bfloat16" if dt == "bfloat16" else "float32"
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]), embed_dim=d, num_layers=int(hf["num_hidden_layers"]),
      num_heads=n, num_kv_heads=int(hf.get("num_key_value_heads") or n),
      head_dim=int(hf.get("head_dim") or d // n), mlp_dim=int(hf["intermediate_size"]),
      rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=int(hf.get("max_position_embeddings", 2048)),
      dtype=param_dtype, param_dtype=param_dtype)


def family_for(cfg: ModelConfig) -> str:
  """The HF family that holds a ModelConfig: qk-norm is Qwen3, qkv bias Qwen2, else Llama."""
  if cfg.qk_norm and cfg.qkv_bias:
    raise ConfigError("a model with both qk_norm and qkv_bias has no Hugging Face family "
                      "(Qwen3 has qk-norm without biases, Qwen2 biases without qk-norm).")
  return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def config_to_hf(cfg: ModelConfig, *, extra: dict | None = None) -> dict:
  """config.json for transformers. `extra` (e.g. bos/eos ids of an imported checkpoint) is
  merged in first, so the model fields always win."""
  family = family_for(cfg)
  arch = {fam: a for a, (fam, _) in ARCHITECTURES.items()}[family]
  out = dict(extra or {})
  for key in ("rope_parameters", "rope_scaling", "torch_dtype", "dtype", "transformers_version"):
    out.pop(key, None)
  out.update({
      "architectures": [arch], "model_type": ARCHITECTURES[arch][1],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_seq_len, "attention_dropout": 0.0,
      "torch_dtype": cfg.param_dtype, "use_cache": True,
  })
  if family == "llama":
    out.update({"attention_bias": False, "mlp_bias": False})
  if family == "qwen3":
    out["attention_bias"] = False
  if family == "qwen2":
    out["use_sliding_window"] = False
  s = cfg.rope_scaling
  out["rope_scaling"] = None if s is None else {
      "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
      "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings":
      s.original_max_position}
  return out
