"""Model hyper-parameters and presets for the Llama family (Llama 3.x, Qwen2.5, Qwen3).

A preset is a plain ModelConfig. The real shapes follow each model's published config.json;
tests/test_presets.py checks their parameter counts with jax.eval_shape against the figures the
model cards publish.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl.errors import ConfigError, check_choice

DTYPES = ("float32", "bfloat16")

# model.remat: what each decoder block keeps for the backward (jax.checkpoint policies, see
# jaxrl.models.llama.REMAT_POLICIES). "none" keeps everything autodiff saves; "full" keeps
# only each block's input and recomputes the block in the backward; "dots_saveable" keeps every
# matmul's output (attention's [T, S] scores included); "dots_with_no_batch_dims_saveable"
# keeps the projections' and the MLP's outputs but recomputes attention's batched products.
REMAT = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")

# LoRA (model.lora.targets): the weights an adapter may sit beside, and the two named groups.
# "all-linear" is PEFT's name for every linear layer but the LM head.
LORA_WEIGHTS = ("q", "k", "v", "o", "gate", "up", "down")
LORA_GROUPS = {"attn": ("q", "k", "v", "o"), "all-linear": LORA_WEIGHTS}
# model.lora.quantize (jaxrl.models.quant.QUANTIZE): the frozen base's storage.
LORA_QUANTIZE = ("", "int8")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 frequency scaling (rope_type "llama3" in config.json)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-6
  qkv_bias: bool = False  # Qwen2 / Qwen2.5
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
  tie_embeddings: bool = False
  max_seq_len: int = 2048
  dtype: str = "float32"  # compute dtype of matmuls; logits and softmax are always fp32
  param_dtype: str = "float32"
  # Memory knobs: they change no parameter and no value, only what a learner program keeps live
  # (docs/design.md, "The model"). remat: one of REMAT, per decoder block. logits_chunk: the
  # positions per chunk of the LM head's log-softmax (jaxrl.models.logprobs), used when
  # vocab_size >= chunk_min_vocab (0 turns chunking off), so no [rows, T, V] float32 logits
  # exist in a learner program; small vocabularies (the tiny presets) stay unchunked.
  remat: str = "none"
  logits_chunk: int = 128
  chunk_min_vocab: int = 32768
  # scan_layers: the decoder layers as one stacked block (every parameter gains a leading
  # [num_layers] axis, logical name "layers") that full-sequence forwards run under
  # jax.lax.scan, so a program traces and compiles one layer, not num_layers; on for the
  # real-size presets. Off, the layers are a list of blocks (the tiny presets). The values are
  # the same either way (jaxrl.models.llama.stack_layers converts a checkpoint's params).
  scan_layers: bool = False
  # LoRA (the config's model.lora section; jaxrl.models.lora): rank 0 is off. When on, each
  # weight named in lora_targets gets an nnx.LoRA adapter beside it, adding
  # (lora_alpha / lora_rank) * dropout(x) @ A @ B to its product; B starts at zero.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_dropout: float = 0.0
  lora_targets: tuple[str, ...] = ()
  # QLoRA (model.lora.quantize; jaxrl.models.quant): "int8" holds the frozen base's linear
  # weights as int8 with per-output-channel scales; "" keeps them in param_dtype.
  lora_quantize: str = ""

  def __post_init__(self):
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ConfigError(
            f"model.{name}={getattr(self, name)!r} is not supported: choose one of {DTYPES}.")
    check_choice("model.remat", self.remat, REMAT)
    for name in ("logits_chunk", "chunk_min_vocab"):
      if int(getattr(self, name)) < 0:
        raise ConfigError(f"model.{name} must be 0 or more, got {getattr(self, name)}.")
    for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim", "max_seq_len"):
      if int(getattr(self, name)) <= 0:
        raise ConfigError(f"model.{name} must be a positive integer, got {getattr(self, name)}.")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads="
          f"{self.num_kv_heads}: grouped-query attention needs num_heads % num_kv_heads == 0.")
    if self.head_dim % 2:
      raise ConfigError(f"model.head_dim={self.head_dim} must be even for RoPE.")
    self._check_lora()

  def _check_lora(self):
    # A tuple, whatever came in (config.json holds a list): the config is hashed as static
    # jit state through the module's graphdef.
    object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
    if int(self.lora_rank) < 0:
      raise ConfigError(f"model.lora.rank must be 0 (off) or more, got {self.lora_rank}.")
    if not 0.0 <= float(self.lora_dropout) < 1.0:
      raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.lora_dropout}.")
    if self.lora_rank and float(self.lora_alpha) <= 0:
      raise ConfigError(f"model.lora.alpha must be positive, got {self.lora_alpha}.")
    for name in self.lora_targets:
      check_choice("model.lora.targets", name, LORA_WEIGHTS)
    if self.lora_quantize not in LORA_QUANTIZE:
      raise ConfigError(f"model.lora.quantize={self.lora_quantize!r} is not supported: use '' "
                        "(the base in model.param_dtype) or 'int8'.")
    if self.lora_quantize and not self.lora_rank:
      raise ConfigError(f"model.lora.quantize={self.lora_quantize!r} quantises a frozen base, "
                        "which needs LoRA: set model.lora.rank > 0, or model.lora.quantize=''.")
    if self.lora_rank and not self.lora_targets:
      raise ConfigError("model.lora.rank > 0 adapts no weight: set model.lora.targets to "
                        "'attn', 'all-linear' or a comma list of q,k,v,o,gate,up,down.")

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  @property
  def chunked_logits(self) -> bool:
    """Whether learner log-probs run the LM head in chunks of logits_chunk positions."""
    return self.logits_chunk > 0 and self.vocab_size >= self.chunk_min_vocab

  @property
  def num_params(self) -> int:
    """Parameter count from the shapes alone (tests cross-check it with eval_shape)."""
    d, n, k, h, f = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
    attn = d * n * h + 2 * d * k * h + n * h * d
    if self.qkv_bias:
      attn += n * h + 2 * k * h
    if self.qk_norm:
      attn += 2 * h
    layer = attn + 3 * d * f + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * layer + emb + d + self.num_lora_params

  def lora_shape(self, name: str) -> tuple[int, int]:
    """(in, out) of the flattened weight an adapter named `name` (one of LORA_WEIGHTS) adapts:
    q D -> N*H, k and v D -> K*H, o N*H -> D, gate and up D -> F, down F -> D."""
    d, n, k, h, f = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
    return {"q": (d, n * h), "k": (d, k * h), "v": (d, k * h), "o": (n * h, d),
            "gate": (d, f), "up": (d, f), "down": (f, d)}[name]

  @property
  def num_lora_params(self) -> int:
    """The adapters' parameters (0 with LoRA off): r * (in + out) per adapted weight."""
    if not self.lora_rank:
      return 0
    per_layer = sum(sum(self.lora_shape(t)) for t in self.lora_targets)
    return self.num_layers * self.lora_rank * per_layer


_L3_SCALING_32 = RopeScaling(factor=32.0)
_L3_SCALING_8 = RopeScaling(factor=8.0)


def _qwen2(vocab, d, layers, heads, kv, mlp, tied):
  return ModelConfig(vocab_size=vocab, embed_dim=d, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv, head_dim=d // heads, mlp_dim=mlp, rope_theta=1e6,
                     norm_eps=1e-6, qkv_bias=True, tie_embeddings=tied, max_seq_len=32768)


def _qwen3(d, layers, heads, kv, mlp, tied):
  return ModelConfig(vocab_size=151936, embed_dim=d, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv, head_dim=128, mlp_dim=mlp, rope_theta=1e6, norm_eps=1e-6,
                     qk_norm=True, tie_embeddings=tied, max_seq_len=40960)


def _llama3(d, layers, heads, kv, mlp, tied, scaling):
  return ModelConfig(vocab_size=128256, embed_dim=d, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv, head_dim=d // heads, mlp_dim=mlp, rope_theta=500_000.0,
                     rope_scaling=scaling, norm_eps=1e-5, tie_embeddings=tied,
                     max_seq_len=131072)


# Tiny presets (under 5M parameters) run on CPU in seconds. Each exercises one family's
# features; all have a vocabulary of 512, which fits the byte-level tokenizer (259 ids) with
# room, and head counts that divide a tensor-parallel size of 4.
_TINY = dict(vocab_size=512, embed_dim=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=32, mlp_dim=384, max_seq_len=512)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(**_TINY, rope_theta=10_000.0, tie_embeddings=True),
    "tiny-qwen2": ModelConfig(**_TINY, rope_theta=1e6, qkv_bias=True, tie_embeddings=True),
    "tiny-qwen3": ModelConfig(**_TINY, rope_theta=1e6, qk_norm=True),
    "tiny-llama3": ModelConfig(**_TINY, rope_theta=500_000.0, norm_eps=1e-5,
                               rope_scaling=RopeScaling(factor=8.0, original_max_position=128)),
    # A slightly larger tiny model for end-to-end learning tests and demos (about 3.3M).
    "small": ModelConfig(vocab_size=512, embed_dim=256, num_layers=4, num_heads=8,
                         num_kv_heads=4, head_dim=32, mlp_dim=768, max_seq_len=512,
                         tie_embeddings=True),
    # The sampler benchmark's shape (benchmarks/sampler.py), equal to its HF peer anchor:
    # Qwen2-style, 4,487,424 parameters.
    "bench": ModelConfig(vocab_size=512, embed_dim=256, num_layers=6, num_heads=4,
                         num_kv_heads=2, head_dim=64, mlp_dim=688, rope_theta=1e6,
                         qkv_bias=True, tie_embeddings=True, max_seq_len=2048),
    "qwen2.5-0.5b": _qwen2(151936, 896, 24, 14, 2, 4864, tied=True),
    "qwen2.5-1.5b": _qwen2(151936, 1536, 28, 12, 2, 8960, tied=True),
    "qwen2.5-7b": _qwen2(152064, 3584, 28, 28, 4, 18944, tied=False),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 8, 3072, tied=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 8, 6144, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 8, 9728, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 8, 12288, tied=False),
    "llama-3.2-1b": _llama3(2048, 16, 32, 8, 8192, tied=True, scaling=_L3_SCALING_32),
    "llama-3.2-3b": _llama3(3072, 28, 24, 8, 8192, tied=True, scaling=_L3_SCALING_32),
    "llama-3.1-8b": _llama3(4096, 32, 32, 8, 14336, tied=False, scaling=_L3_SCALING_8),
}

# Keys of a config's `model` section besides the ModelConfig fields. `hf_path` names a Hugging
# Face checkpoint directory whose config.json replaces the preset (see jaxrl.models.hf_config);
# `lora` is the LoRA section (rank, alpha, dropout, targets), which sets the lora_* fields.
_MODEL_SECTION_EXTRA = ("preset", "hf_path", "lora")
_LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_quantize")


def lora_targets_of(spec: Any) -> tuple[str, ...]:
  """model.lora.targets -> the adapted weights' names: "attn", "all-linear", a comma list of
  LORA_WEIGHTS (e.g. "q,v") or a sequence of them; order follows LORA_WEIGHTS."""
  if isinstance(spec, str):
    spec = LORA_GROUPS.get(spec.strip(), [t.strip() for t in spec.split(",") if t.strip()])
  names = tuple(spec or ())
  for name in names:
    if name not in LORA_WEIGHTS:
      raise ConfigError(f"model.lora.targets names {name!r}: use 'attn', 'all-linear' or a "
                        f"comma list of {','.join(LORA_WEIGHTS)}.")
  return tuple(t for t in LORA_WEIGHTS if t in names)


def lora_fields(section: Any) -> dict[str, Any]:
  """The ModelConfig lora_* fields of a model.lora section {rank, alpha, dropout, targets}
  (None for a key keeps the default; targets default to "attn" when rank > 0)."""
  section = dict(section or {})
  unknown = sorted(set(section) - {"rank", "alpha", "dropout", "targets", "quantize"})
  if unknown:
    raise ConfigError(f"model.lora.{unknown[0]} is not a LoRA key: the section takes rank, "
                      "alpha, dropout, targets and quantize.")
  out: dict[str, Any] = {}
  for key, want in (("rank", int), ("alpha", float), ("dropout", float)):
    value = section.get(key)
    if value is None:
      continue
    if isinstance(value, str):  # e.g. "8" left as text by a sweep
      try:
        value = float(value)
      except ValueError:
        pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        want is int and not float(value).is_integer()):
      raise ConfigError(f"model.lora.{key}={value!r} has the wrong type: expected "
                        f"{want.__name__}.")
    out[f"lora_{key}"] = want(value)
  rank = out.get("lora_rank", 0)
  targets = section.get("targets")
  out["lora_targets"] = lora_targets_of("attn" if targets is None else targets) if rank else ()
  quantize = section.get("quantize")
  if quantize is not None:
    if not isinstance(quantize, str):
      raise ConfigError(f"model.lora.quantize={quantize!r} has the wrong type: expected '' or "
                        "'int8'.")
    out["lora_quantize"] = quantize.strip()
  return out


def get_preset(name: str) -> ModelConfig:
  return PRESETS[check_choice("model.preset", name, PRESETS)]


def model_config_from(section: Any, base: ModelConfig | None = None) -> ModelConfig:
  """Builds a ModelConfig from a config's `model` section: the preset (or `base`), then every
  non-None field of the section that overrides it (e.g. --config.model.num_layers=4)."""
  base = get_preset(section["preset"]) if base is None else base
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  overrides = {}
  section = dict(section)
  if section.get("lora") is not None:
    overrides.update(lora_fields(section["lora"]))
  for key, value in section.items():
    if key in _MODEL_SECTION_EXTRA or value is None:
      continue
    if key not in fields:
      raise ConfigError(f"model.{key} is not a model field: valid fields are "
                        f"{', '.join(sorted(fields))}.")
    if key == "rope_scaling" and not isinstance(value, RopeScaling):
      value = RopeScaling(**dict(value))
    overrides[key] = value
  return base.replace(**overrides)


def model_section_fields() -> tuple[str, ...]:
  """The flat keys of a config's model section; the lora_* fields are set through the
  model.lora section instead."""
  return _MODEL_SECTION_EXTRA + tuple(f.name for f in dataclasses.fields(ModelConfig)
                                      if f.name not in _LORA_FIELDS)
