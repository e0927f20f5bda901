"""Configs: Python files whose get_config(arg) returns an ml_collections ConfigDict.

    jaxrl <command> --config configs/x.py[:arg] [--config.a.b=value ...]

`arg` switches several fields at once (big_vision style). Every field can be overridden from
the command line; an unknown key, a value of the wrong type or a value outside a key's choices
fails with one sentence naming the key and what is valid. A config file may also define
`sweep()`, which yields dicts of overrides, one per run.

This module knows the sections every command shares (seed, layout, mesh, model, and the
placement and plan sections built from the layers below). A command's own sections (a trainer's
algo, data, optim, ...; `jaxrl sample`'s sampling) are its own: its module lists their choices
in its `CHOICES`, which reach `validate` as an argument (from the trainer's Run
(jaxrl.train.run), and from the CLI, `jaxrl launch` and `jaxrl sweep` before a run starts).
Nothing here imports a trainer, and nothing registers choices here at import time.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import ml_collections

from jaxrl.errors import ConfigError, check_choice
from jaxrl.models import PRESETS, ModelConfig, model_config_from
from jaxrl.models.config import DTYPES, model_section_fields
from jaxrl.models.hf_config import config_from_hf, read_hf_config
from jaxrl.parallel import LAYOUTS
from jaxrl.parallel.plan import DEVICE_MEMORY_GIB, plan_config
from jaxrl.parallel.sync import PLACEMENTS, SYNC_DTYPES, placement_config

# Keys of the shared sections whose value must be one of a fixed set. Read-only: a trainer's keys
# stay in the trainer (its CHOICES) and reach `validate` as an argument.
BASE_CHOICES: Mapping[str, Iterable[str]] = MappingProxyType({
    "layout": LAYOUTS,
    "model.preset": PRESETS,
    "model.dtype": DTYPES,
    "model.param_dtype": DTYPES,
    "placement.mode": PLACEMENTS,
    "placement.sync_dtype": SYNC_DTYPES,
    "placement.ref_dtype": SYNC_DTYPES,
    "plan.device": ("", *DEVICE_MEMORY_GIB),
})
# Keys that accept "auto" for -1.
_AUTO_KEYS = ("mesh.data", "mesh.fsdp", "mesh.tensor", "placement.sampler_mesh.data",
              "placement.sampler_mesh.fsdp", "placement.sampler_mesh.tensor")


def base_config() -> ml_collections.ConfigDict:
  """Fields every command shares: seed, mesh, layout and model."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.layout = "learner"
  # Axis sizes of the (data, fsdp, tensor) mesh; -1 ("auto") takes the remaining devices.
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
  # `preset` names a ModelConfig; every other field left None keeps the preset's value.
  c.model = ml_collections.ConfigDict({k: None for k in model_section_fields()})
  c.model.preset = "tiny"
  # A Hugging Face checkpoint directory: its config.json replaces the preset and its weights
  # replace the random init (jaxrl.io.hf.params_from_config).
  c.model.hf_path = ""
  # LoRA (docs/guides/lora.md): rank 0 is off; scale = alpha / rank; targets "attn" (q,k,v,o),
  # "all-linear" (and gate,up,down) or a comma list of those names; quantize "int8": the
  # frozen base in int8 with per-channel scales (QLoRA), "" in model.param_dtype.
  c.model.lora = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0,
                                                targets="attn", quantize=""))
  return c


# ----------------------------------------------------------------------------- loading


def load_python_file(path: str, *, prefix: str, what: str, missing: str):
  """The Python file at `path` run as a module named prefix + its stem: a config file, a user's
  environment file. A missing file raises ConfigError "{what} {path!r} does not exist: {missing}";
  one that fails to run, "{what} {path} failed to load: <the error>"."""
  if not os.path.isfile(path):
    raise ConfigError(f"{what} {path!r} does not exist: {missing}")
  name = prefix + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except ConfigError:
    raise
  except Exception as e:  # a broken file is still a config error, named by file and line
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
    where = f"{path}:{lines[-1]}" if lines else path
    raise ConfigError(f"{what} {where} failed to load: {type(e).__name__}: {e}{_moved(e)}.") from e
  return module


# Modules that moved, for a config written against the old name (2026-12-07: the trainers).
MOVED = {"jaxrl.rl": "jaxrl.algorithms", "jaxrl.train.sft": "jaxrl.algorithms.sft",
         "jaxrl.train.rm": "jaxrl.algorithms.rm", "jaxrl.train.dpo": "jaxrl.algorithms.dpo"}


def _moved(e: Exception) -> str:
  """" (OLD is now NEW: import it from there)" where `e` failed to import a moved module."""
  if not isinstance(e, ImportError) or not e.name:
    return ""
  name = e.name + (f".{e.name_from}" if getattr(e, "name_from", None) else "")
  old = next((o for o in MOVED if name == o or name.startswith(o + ".")), None)
  return f" ({old} is now {MOVED[old]}: import it from there)" if old else ""


def _load_module(path: str):
  module = load_python_file(path, prefix="jaxrl_config_", what="config file",
                            missing="pass --config=configs/<name>.py (optionally with :arg).")
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path} defines no get_config(arg=None): add one that "
                      "returns an ml_collections.ConfigDict.")
  return module


def split_spec(spec: str) -> tuple[str, str | None]:
  path, _, arg = spec.partition(":")
  return path, (arg or None)


def load_config(spec: str, overrides: Iterable[str] = (),
                choices: Mapping[str, Iterable[str]] | None = None) -> ml_collections.ConfigDict:
  """Loads `path[:arg]`, applies `a.b=value` overrides, validates (the shared sections, and the
  keys in `choices`: a trainer's CHOICES), returns the config."""
  path, arg = split_spec(spec)
  module = _load_module(path)
  getter = module.get_config
  takes_arg = bool(inspect.signature(getter).parameters)
  if arg is not None and not takes_arg:
    raise ConfigError(f"config file {path} takes no argument but ':{arg}' was given: drop it.")
  try:
    config = getter(arg) if takes_arg else getter()
  except ConfigError:
    raise
  except Exception as e:
    raise ConfigError(f"{path}: get_config({arg!r}) failed: {type(e).__name__}: {e}.") from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"{path}: get_config must return an ml_collections.ConfigDict, "
                      f"not {type(config).__name__}.")
  apply_overrides(config, overrides)
  validate(config, choices)
  return config


def load_sweep(spec: str) -> list[dict[str, Any]]:
  """The override dicts of the config file's sweep(), or [{}] when it has none."""
  path, _ = split_spec(spec)
  module = _load_module(path)
  if not hasattr(module, "sweep"):
    return [{}]
  runs = list(module.sweep())
  for i, run in enumerate(runs):
    if not isinstance(run, dict):
      raise ConfigError(f"{path}: sweep() item {i} is a {type(run).__name__}, not a dict of "
                        "overrides like {'model.preset': 'tiny'}.")
  return runs


# ----------------------------------------------------------------------------- overrides


def _keys(section: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  out = []
  for k, v in section.items():
    full = prefix + k
    out += _keys(v, full + ".") if isinstance(v, ml_collections.ConfigDict) else [full]
  return out


def _coerce(key: str, text: Any, current: Any) -> Any:
  if not isinstance(text, str):
    return text  # programmatic overrides (sweeps) already carry typed values
  if key in _AUTO_KEYS and text.lower() == "auto":
    return -1
  try:
    if isinstance(current, bool):
      low = text.lower()
      if low in ("true", "1", "yes"):
        return True
      if low in ("false", "0", "no"):
        return False
      raise ValueError
    if isinstance(current, int):
      return int(text)
    if isinstance(current, float):
      return float(text)
    if isinstance(current, str):
      return text
    if isinstance(current, (tuple, list)):
      value = ast.literal_eval(text)
      if not isinstance(value, (tuple, list)):
        raise ValueError
      return type(current)(value)
  except (ValueError, SyntaxError):
    kind = ("true or false" if isinstance(current, bool) else
            {int: "an integer", float: "a number"}.get(type(current), "a Python literal"))
    raise ConfigError(f"--config.{key}={text!r} is not {kind}: give a value of that type.") \
        from None
  # current is None: the key takes any literal; anything that is not one is a string
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def apply_overrides(config: ml_collections.ConfigDict, overrides: Iterable[str] | dict) -> None:
  """Applies `a.b=value` strings (or a {key: value} dict) in place, naming bad keys."""
  items = overrides.items() if isinstance(overrides, dict) else (
      _split_override(o) for o in overrides)
  for key, text in items:
    parts = key.split(".")
    section = config
    for i, part in enumerate(parts):
      if not isinstance(section, ml_collections.ConfigDict) or part not in section:
        where = ".".join(parts[:i]) or "the top level"
        valid = sorted(section.keys()) if isinstance(section, ml_collections.ConfigDict) else []
        close = difflib.get_close_matches(part, valid, n=1)
        hint = f" Did you mean {'.'.join(parts[:i] + [close[0]])!r}?" if close else ""
        raise ConfigError(f"--config.{key}: there is no key {part!r} in {where}.{hint} "
                          f"Valid keys there: {', '.join(valid)}.")
      if i < len(parts) - 1:
        section = section[part]
    current = section[parts[-1]]
    if isinstance(current, ml_collections.ConfigDict):
      raise ConfigError(f"--config.{key} is a section, not a value: set one of its keys: "
                        f"{', '.join(_keys(current, key + '.'))}.")
    value = _coerce(key, text, current)
    with section.unlocked():
      try:
        section[parts[-1]] = value
      except TypeError as e:
        raise ConfigError(f"--config.{key}={text!r} has the wrong type: {e}.") from None


def _split_override(text: str) -> tuple[str, str]:
  key, eq, value = text.partition("=")
  key = key.removeprefix("--config.").removeprefix("config.")
  if not eq or not key:
    raise ConfigError(f"override {text!r} is not of the form --config.a.b=value.")
  return key, value


# ----------------------------------------------------------------------------- validation


def _get(config, key):
  node = config
  for part in key.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return None
    node = node[part]
  return node


def validate(config: ml_collections.ConfigDict,
             choices: Mapping[str, Iterable[str]] | None = None) -> None:
  """Checks every key with fixed choices (the shared sections' and `choices`, a trainer's own,
  whose section functions check their ranges), the train and eval sections' ranges, the model
  section and the mesh, without devices."""
  check_choices(config, BASE_CHOICES)
  check_choices(config, choices or {})
  check_loop_sections(config)
  if "model" in config:
    cfg = model_config(config)
    tensor = _get(config, "mesh.tensor")
    if isinstance(tensor, int) and tensor > 0 and cfg.num_heads % tensor:
      raise ConfigError(f"model.num_heads={cfg.num_heads} is not divisible by the "
                        f"tensor-parallel size {tensor}: choose mesh.tensor so that it divides "
                        f"{cfg.num_heads}.")
  if "mesh" in config:
    for axis in ("data", "fsdp", "tensor"):
      v = config.mesh[axis]
      if not isinstance(v, int) or v == 0 or v < -1:
        raise ConfigError(f"mesh.{axis}={v!r} is not a valid axis size: use a positive "
                          "integer, or -1 (auto).")


def check_choices(config: ml_collections.ConfigDict,
                  choices: Mapping[str, Iterable[str]]) -> None:
  """Each `key` of `choices` the config has must hold one of its values. A value that is a
  function instead checks a whole section's ranges (e.g. "optim": optim.check_section): it is
  called with the config when the config has that section."""
  for key, valid in choices.items():
    value = _get(config, key)
    if value is None:
      continue
    if callable(valid):
      valid(config)
    else:
      validate_choice(key, value, valid)


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_at_least(config: ml_collections.ConfigDict, low: int | float, *keys: str) -> None:
  """Each of `keys` the config has must be a number >= `low`."""
  for key in keys:
    value = _get(config, key)
    if value is not None and (not _number(value) or value < low):
      raise ConfigError(f"{key}={value!r} must be at least {low}: set --config.{key} to "
                        f"{low} or more.")


def check_positive(config: ml_collections.ConfigDict, *keys: str, example: str = "1") -> None:
  """Each of `keys` the config has must be a number > 0."""
  for key in keys:
    value = _get(config, key)
    if value is not None and (not _number(value) or not value > 0):
      raise ConfigError(f"{key}={value!r} must be positive: set e.g. "
                        f"--config.{key}={example}.")


def check_unit(config: ml_collections.ConfigDict, key: str, *, off: str) -> None:
  """`key` (a probability such as top_p), when the config has it, must be in (0, 1]."""
  value = _get(config, key)
  if value is not None and (not _number(value) or not 0 < value <= 1):
    raise ConfigError(f"{key}={value!r} must be in (0, 1]: {off}.")


# Top-level keys any command's config may carry: base_config's, and the placement, plan and
# distributed sections a real-model config file shares between its variants.
SHARED_SECTIONS = ("seed", "layout", "mesh", "model", "placement", "plan", "distributed")
# Sections a trainer reads with a default when a config leaves them out.
OPTIONAL_SECTIONS = ("distributed", "plan")


def check_sections(config: ml_collections.ConfigDict, command: str,
                   sections: Callable[[str], Iterable[str]], commands: Iterable[str], *,
                   spec: str = "") -> None:
  """A config for another command fails here, naming it, not later with an AttributeError:
  every top-level key must be one `command` reads (`sections(command)`: its default config's)
  or a shared one, and every section `command` reads must be there (but the optional ones,
  OPTIONAL_SECTIONS). `commands` are the ones a config may be meant for instead: the first that
  fits it is named."""
  shared, own = set(SHARED_SECTIONS), set(sections(command))
  extra = [k for k in config if k not in shared and k not in own]
  missing = sorted(own - set(config) - set(OPTIONAL_SECTIONS))
  if not extra and not missing:
    return
  fits = [c for c in commands if c != command
          and set(config) <= shared | set(sections(c))
          and not set(sections(c)) - set(config) - set(OPTIONAL_SECTIONS)]
  this = f"this config{f' ({spec})' if spec else ''}"
  if extra:
    what = f"{this} has section{'s' if len(extra) > 1 else ''} {', '.join(extra)} that " \
           f"`jaxrl {command}` does not read"
  else:
    what = f"{this} lacks section{'s' if len(missing) > 1 else ''} {', '.join(missing)}, " \
           f"which `jaxrl {command}` reads"
  if fits:
    raise ConfigError(f"{what}: it looks like a `jaxrl {fits[0]}` config; run "
                      f"`jaxrl {fits[0]}`.")
  fix = (f"remove {'them' if len(extra) > 1 else 'it'}, or start" if extra else "start")
  raise ConfigError(f"{what}: {fix} from the config of `jaxrl {command}` "
                    f"(configs/{command}_tiny.py).")


def eval_keys() -> dict:
  """The held-out evaluator's keys (jaxrl.evals), beside a trainer's every/examples/batch_size:
  GRPO's eval section carries them, and `jaxrl eval` reads them from any config (these
  defaults fill the keys a config lacks)."""
  return dict(
      n=0,              # samples per prompt at `temperature` (0: greedy accuracy only)
      k=(),             # pass@k, mean@k and maj@k for each k (each k <= n), e.g. (1, 4)
      temperature=1.0,  # the n samples' temperature
      reward="",        # the checker: "task", a registered reward, or "" (data.task's
                        # checker, else the first of `rewards`)
      spot_check=8,     # prompts whose completions GRPO writes to DIR/samples/step_N.jsonl
  )


def check_loop_sections(config: ml_collections.ConfigDict) -> None:
  """The ranges of the train and eval sections every trainer has and the shared loop reads
  (jaxrl.train.loop): steps, log_every, save_every >= 1 (a 0 divides by zero after the
  compile); eval.every >= 0 (0 = no periodic eval); the eval batch >= 1; and the evaluator's
  keys (eval_keys) where a config has them."""
  check_at_least(config, 1, "train.steps", "train.log_every", "train.save_every",
                 "train.keep_checkpoints", "eval.batch_size")
  # GRPO's eval.max_new_tokens 0 means rollout.max_new_tokens; everyone else's decodes that many.
  check_at_least(config, 0 if "rollout" in config else 1, "eval.max_new_tokens")
  check_at_least(config, 0, "eval.every", "eval.examples", "eval.n", "eval.spot_check")
  check_positive(config, "eval.temperature", example="1.0")
  ks, n = _get(config, "eval.k"), _get(config, "eval.n")
  if ks is None:
    return
  if not isinstance(ks, (tuple, list)) or not all(
      isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks):
    raise ConfigError(f"eval.k={ks!r} must be a tuple of integers >= 1: set e.g. "
                      "--config.eval.k='(1, 4)'.")
  if ks and (not isinstance(n, int) or max(ks) > n):
    raise ConfigError(f"eval.k={tuple(ks)} needs at least {max(ks)} samples per prompt but "
                      f"eval.n={n!r}: set --config.eval.n={max(ks)} or more.")


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig of a config's `model` section, with every override type-checked."""
  section = config.model
  base = hf_base(config)
  if base is None:
    base = PRESETS.get(section.preset)
  if base is None:
    validate_choice("model.preset", section.preset, PRESETS)
  fixed = {}
  for f in dataclasses.fields(ModelConfig):
    value = section.get(f.name)
    default = getattr(base, f.name)
    if value is None or default is None or f.name == "rope_scaling":
      continue
    want = type(default)
    if isinstance(value, str) and want is not str:  # e.g. "true" left as text by a sweep
      value = _coerce(f"model.{f.name}", value, default)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
      raise ConfigError(f"model.{f.name}={value!r} has the wrong type: expected "
                        f"{want.__name__}.")
    fixed[f.name] = value
  return model_config_from({**dict(section), **fixed}, base)


def hf_base(config: ml_collections.ConfigDict) -> ModelConfig | None:
  """The ModelConfig of model.hf_path's config.json; None when hf_path is unset, or names a
  directory not there yet (then the preset's shapes stand in, so `plan` works before the
  download, and loading the weights fails naming the path)."""
  path = config.model.get("hf_path") or ""
  if not path or not os.path.isfile(os.path.join(path, "config.json")):
    return None
  return config_from_hf(read_hf_config(path), where=os.path.join(path, "config.json"))


def validate_choice(key: str, value: Any, choices: Iterable[str]) -> None:
  check_choice(key, value, choices)


def iter_config_files(root: str = "configs") -> Iterator[str]:
  for name in sorted(os.listdir(root)):
    if name.endswith(".py") and not name.startswith("_"):
      yield os.path.join(root, name)


# The ready-made real-model configs' chips (8-chip slices) and their plan.device names.
# CHIP -> plan.device. The mesh takes every chip the slice has (mesh.fsdp = -1), so "v5e-4" (a
# 4-chip v5e slice, for the LoRA variants that fit one) differs from "v5e" only in its sizing.
REAL_CHIPS = {"v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e", "v5e-4": "tpu-v5e"}
# CHIP -> its slice's topology (plan.topology): `jaxrl plan` on a machine without that slice
# plans the topology's abstract devices, as `--compile` compiles for them.
SLICE_TOPOLOGY = {"v5e": "v5e:2x4", "v5p": "v5p:2x2x1", "v6e": "v6e:2x4", "v5e-4": "v5e:2x2"}


def hf_model_config(arg, *, preset: str, checkpoint: str, fixture: str, sft_config,
                    grpo_config, chip: str = "v5e", remat: str = "full", accum_steps: int = 1,
                    ref_dtype: str = "", sampler_mesh: tuple[int, int] | None = None):
  """The ready-made real-model configs (configs/qwen3.py, configs/qwen2p5.py, configs/llama3.py
  and the older single-model files): a local HF checkpoint on an 8-chip slice of `chip`, fp32
  master weights (and Adam state) with bf16 compute, the trainer's sections, and the memory
  knobs (model.remat, optim.accum_steps; for GRPO the reference's dtype, placement.ref_dtype,
  and the sampler's (data, tensor) mesh) chosen so the compiled programs fit the chip
  (docs/guides/scale.md has the compiler's figures for each). The config file passes the
  trainers' default_config functions (this module imports no trainer).

  arg: "" or "grpo" (GRPO: 16 prompts x 8 completions per step, 512 prompt + 1536 completion
  tokens, 64 decode slots; actor + reference colocated with the sampler), "sft" (SFT: 64
  sequences of 2048 tokens per step), "fixture" (GRPO on a tiny HF fixture, runs on CPU in
  seconds).
  """
  if arg not in (None, "", "grpo", "sft", "fixture"):
    raise ValueError(f"unknown arg {arg!r}: use '', 'grpo', 'sft' or 'fixture'")
  if chip not in REAL_CHIPS:
    raise ValueError(f"unknown chip {chip!r}: use one of {', '.join(REAL_CHIPS)}")
  if arg == "sft":
    c = sft_config()
    c.data.update(seq_len=2048, batch_size=64)
    c.optim.update(lr=1e-5, warmup_steps=20)
    c.eval.update(max_new_tokens=32, batch_size=64)
  else:
    c = grpo_config()
    c.rollout.update(prompts_per_step=16, group_size=8, prompt_len=512, max_new_tokens=1536,
                     slots=64, grow_cache=False)
    c.optim.update(lr=1e-6)
    c.eval.update(batch_size=64)
  c.model.preset = preset
  c.model.hf_path = checkpoint
  # fp32 master weights (and Adam state) on the learner; the sampler gets a bf16 copy.
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16"
  c.model.remat = remat
  # 256 positions per log-prob chunk: what the table in docs/guides/scale.md was compiled with
  # (the model's default is 128, which saves a little more on v5e; re-measure before moving).
  c.model.logits_chunk = 256
  c.optim.accum_steps = accum_steps
  c.mesh.fsdp = -1  # learner: FSDP over every chip (8 on v5e-8 / v6e-8; v5p-8 has 4 chips)
  c.placement = placement_config()
  c.placement.sampler_mesh.data, c.placement.sampler_mesh.tensor = sampler_mesh or (-1, 2)
  c.placement.sync_dtype = "bfloat16"
  c.placement.ref_dtype = ref_dtype
  c.plan = plan_config()
  c.plan.device = REAL_CHIPS[chip]
  c.plan.topology = SLICE_TOPOLOGY[chip]
  if arg == "fixture":
    c.model.hf_path = fixture
    c.model.param_dtype = c.model.dtype = "float32"
    c.model.remat = "none"
    c.model.logits_chunk = None  # the model's default (a tiny vocabulary never chunks)
    c.optim.accum_steps = 1
    c.mesh.fsdp, c.mesh.tensor = -1, 1
    c.placement.sampler_mesh.data, c.placement.sampler_mesh.tensor = -1, 1
    c.placement.sync_dtype = ""
    c.rollout.update(prompts_per_step=4, group_size=4, prompt_len=0, max_new_tokens=8,
                     slots=16, grow_cache=True)
    c.train.update(steps=2, log_every=1, save_every=2)
    c.eval.update(every=2, examples=8, batch_size=8)
    c.plan.device = c.plan.topology = ""
  return c


def lora_arg(arg) -> tuple[str | None, str]:
  """(arg without a "lora" or "qlora" part, that part or ""): "8b,grpo,v5e,qlora" ->
  ("8b,grpo,v5e", "qlora"), for the ready-made configs' LoRA variants (with_lora)."""
  parts = [x.strip() for x in (arg or "").split(",") if x.strip()]
  kind = next((x for x in parts if x in ("lora", "qlora")), "")
  if not kind:
    return arg, ""
  rest = [x for x in parts if x not in ("lora", "qlora")]
  return ",".join(rest) or None, kind


def with_lora(c: ml_collections.ConfigDict, *, rank: int = 16, alpha: float = 32.0,
              targets: str = "all-linear", lr_scale: float = 10.0,
              quantize: str = "") -> ml_collections.ConfigDict:
  """A ready-made config's LoRA variant (docs/guides/lora.md): adapters of `rank` on every
  linear weight, the learning rate `lr_scale` times the full fine-tune's (LoRA's usual
  ratio), and the frozen base in bfloat16 (only the float32 adapters and their Adam moments
  need master precision), which halves the base's bytes on every chip. The fixture keeps
  float32 (its logits are checked against transformers' in float32). quantize="int8" (the
  "qlora" variants) holds that base's linear weights in int8 (jaxrl.models.quant)."""
  c.model.lora.update(rank=rank, alpha=alpha, targets=targets, dropout=0.0, quantize=quantize)
  c.optim.lr = c.optim.lr * lr_scale
  if "placement" in c:  # the reference is the policy's own frozen base: no copy to cast
    c.placement.ref_dtype = ""
  if c.model.get("param_dtype") == "float32" and c.model.get("dtype") == "bfloat16":
    c.model.param_dtype = "bfloat16"
  return c


def family_config(arg, *, models: dict, default: str, sft_config, grpo_config, fixture: str,
                  sizing: dict | None = None):
  """A model family's ready-made configs from one file: arg = "MODEL[,TRAINER][,CHIP]" (e.g.
  "8b,sft,v5p"; TRAINER grpo | sft, default grpo; CHIP v5e | v5p | v6e, default v5e), or
  "fixture" (a GRPO pulse on the family's tiny HF fixture, on CPU). `models` maps MODEL to
  (preset, local HF checkpoint dir); `sizing` maps (MODEL, TRAINER, CHIP) to the memory knobs
  {"remat": ..., "accum_steps": ..., "ref_dtype": ..., "sampler_mesh": (data, tensor)} the
  compiler's figures chose (defaults below and in hf_model_config)."""
  if arg == "fixture":
    preset, ckpt = models[default]
    return hf_model_config("fixture", preset=preset, checkpoint=ckpt, fixture=fixture,
                           sft_config=sft_config, grpo_config=grpo_config)
  parts = [x.strip() for x in (arg or default).split(",")]
  model = parts[0]
  trainer = next((x for x in parts[1:] if x in ("sft", "grpo")), "grpo")
  chip = next((x for x in parts[1:] if x in REAL_CHIPS), "v5e")
  unknown = [x for x in parts[1:] if x not in ("sft", "grpo", *REAL_CHIPS)]
  if model not in models or unknown:
    raise ValueError(f"unknown arg {arg!r}: use MODEL[,sft|grpo][,v5e|v5p|v6e|v5e-4] with "
                     f"MODEL one of {', '.join(models)}, or 'fixture'")
  preset, ckpt = models[model]
  # Full remat everywhere; micro-batches by size (a 4B model's activations at one micro-batch
  # over a v5e chip's 16 GiB): 1 below 2B parameters, 4 up to 5B, 8 above.
  n = PRESETS[preset].num_params
  knobs = {"remat": "full", "accum_steps": 1 if n < 2e9 else 4 if n < 5e9 else 8,
           **(sizing or {}).get((model, trainer, chip), {})}
  return hf_model_config(trainer, preset=preset, checkpoint=ckpt, fixture=fixture,
                         sft_config=sft_config, grpo_config=grpo_config, chip=chip, **knobs)
