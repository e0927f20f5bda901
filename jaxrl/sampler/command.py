"""`jaxrl sample`: completions for a JSONL file of prompts, printed and written to the workdir.

The model is, in order:
  --checkpoint RUN     a `jaxrl sft` / `grpo` / `dpo` run directory (or its checkpoints/): its
                       latest params, with the tokenizer of the model.hf_path the run started
                       from (its config.json records it), else the byte tokenizer of a preset;
  model.hf_path=DIR    a Hugging Face checkpoint: its weights (jaxrl.io.hf), its tokenizer,
                       chat template and stop ids (eos, plus generation_config.json's);
  neither              the preset's random init, with the byte tokenizer (plumbing checks only;
                       it says so).
A config that names model.hf_path never samples random weights: a directory without its
config.json, weights or tokenizer is an error.

Prompt files (JSONL, Parquet, Arrow or a save_to_disk directory; data.fields renames columns)
hold {"prompt": ...}, {"messages": [...]} or {"prompt_ids": [...]} rows (extra fields such as
"answer" are kept); a bad row is named by file, line and field. Prompts are
rendered as everywhere else (jaxrl.data.prompts: chat-templated for an instruct checkpoint, per
the config's data section). Each completion is one JSONL row in DIR/completions.jsonl:
prompt_index, sample, prompt (and messages), prompt_text and prompt_ids (what the model was
given), completion, completion_ids, logprobs (per token, as the sampler reports them) and
finish_reason: "eos" (an eos id), "stop" (one of sampling.stop_ids) or "length".
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from jaxrl import config as config_lib
from jaxrl.data.hf_tokenizer import eos_ids, tokenizer_for
from jaxrl.data.prompts import render_prompt_text, render_prompts
from jaxrl.data.files import file_format
from jaxrl.data.records import check_file, read_records, where
from jaxrl.errors import ConfigError
from jaxrl.io.hf import params_from_config
from jaxrl.io.params import restore_params
from jaxrl.models.llama import abstract_model
from jaxrl.parallel import init_params, mesh_from_config
from jaxrl.parallel.layouts import tree_shardings
from jaxrl.sampler.engine import Engine
from jaxrl.sampler.rollout import generate, metrics
from jaxrl.sampler.sampling import from_config
from jaxrl.train import rundir
from jaxrl.train.rundir import RunDir
from jaxrl.train.run import adopt_hf_path, adopt_lora

EXAMPLE = '{"prompt": "2+2="} or {"messages": [{"role": "user", "content": "2+2="}]}'


def read_prompts(path: str, *, on_bad_row: str = "error", fields=None) -> list[dict]:
  """The rows of a prompts file ("prompt", "messages" or "prompt_ids"; jaxrl.data.records kind
  "prompt"): JSONL (blank lines skipped), Parquet, Arrow or a save_to_disk directory, columns
  renamed by `fields` (data.fields); a bad row named by file, line (or row) and field."""
  if file_format(path) is None or not os.path.exists(path):
    check_file(path, "prompts file", give=f"a JSONL file with one object like {EXAMPLE} a line")
  records, _ = read_records(path, "prompt", on_bad_row=on_bad_row, fields=fields)
  if not records:
    raise ConfigError(f"prompts file {path} holds no usable prompts: add lines like {EXAMPLE}.")
  return records


def _is_hf_dir(path: str) -> bool:
  """A Hugging Face checkpoint directory (config.json and safetensors), not a jaxrl run."""
  return (os.path.isfile(os.path.join(path, "config.json")) and
          not os.path.isdir(os.path.join(path, "checkpoints")) and
          any(f.endswith(".safetensors") for f in os.listdir(path)))


def load_model(config, mesh, *, checkpoint: str | None, out=print):
  """(cfg, graphdef, params, tokenizer) in the sampler layout: see the module doc for which
  weights and tokenizer. `config.model.hf_path` is set from the run when --checkpoint names
  one that started from a checkpoint."""
  if checkpoint and _is_hf_dir(checkpoint):
    here = config.model.get("hf_path") or ""
    if here and os.path.abspath(here) != os.path.abspath(checkpoint):
      raise ConfigError(f"--checkpoint={checkpoint!r} is a Hugging Face checkpoint but "
                        f"model.hf_path={here!r} names another: give one of them.")
    config.model.hf_path, checkpoint = checkpoint, None
  if checkpoint:
    adopt_hf_path(config, checkpoint, key="--checkpoint", say=out)
    adopt_lora(config, checkpoint, key="--checkpoint", say=out)
  tokenizer = tokenizer_for(config)  # the checkpoint's own when model.hf_path is set
  cfg = config_lib.model_config(config)
  if checkpoint:
    graphdef, shapes, axes = abstract_model(cfg)
    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            shapes, tree_shardings(shapes, axes, mesh, "sampler"))
    params = restore_params(checkpoint, abstract, key="--checkpoint")
  elif config.model.get("hf_path"):
    cfg, graphdef, params = params_from_config(config, mesh, "sampler")  # real weights or error
  else:
    out(f"note: no --checkpoint and no model.hf_path: sampling the {config.model.preset!r} "
        "preset's random init (a plumbing check, not a model)")
    graphdef, params = init_params(cfg, mesh, "sampler", seed=config.seed)
  return cfg, graphdef, params, tokenizer


def check_section(config) -> None:
  """The sampling section's counts, at config load (temperature, top-k, top-p and min-p are
  checked by jaxrl.sampler.SamplingParams, with the sampler's own wording)."""
  config_lib.check_at_least(config, 1, "sampling.max_new_tokens", "sampling.n", "sampling.slots",
                            "sampling.steps_per_call")


# The sampling section's keys with fixed choices, and its ranges. The section is this command's
# (a config file like configs/sample_tiny.py writes it), so they live here, not in jaxrl.config.
CHOICES = {"sampling.mode": ("sample", "greedy"), "sampling.batching": ("continuous", "static"),
           "sampling": check_section}


def run(config, *, prompts_path: str, workdir: str | None, n: int | None = None,
        checkpoint: str | None = None, progress: bool = True, out=print) -> dict:
  if not workdir:
    raise ConfigError("jaxrl sample needs --workdir DIR: the completions are written to "
                      "DIR/completions.jsonl.")
  if "sampling" not in config:
    raise ConfigError("the config has no `sampling` section: use configs/sample_tiny.py or add "
                      "one like it.")
  config_lib.check_choices(config, CHOICES)  # the CLI checked them on load; a notebook may not
  # A training run's dir is not overwritten: its config.json would be replaced by this one.
  rundir.check_owner(workdir, command="sample")
  data = config.get("data")
  records = read_prompts(prompts_path, on_bad_row=(data or {}).get("on_bad_row", "error"),
                         fields=(data or {}).get("fields"))
  s = config.sampling
  n = s.n if n is None else n
  if n < 1:
    raise ConfigError(f"--n {n} asks for no samples: give 1 or more per prompt.")
  mesh = mesh_from_config(config.mesh)
  cfg, graphdef, params, tok = load_model(config, mesh, checkpoint=checkpoint, out=out)
  prompts = render_prompts(records, tok, data)
  for i, (r, ids) in enumerate(zip(records, prompts)):
    if max(ids) >= cfg.vocab_size:
      raise ConfigError(f"{where(r, i)}: field 'prompt_ids' holds id {max(ids)}, past the "
                        f"model's vocabulary of {cfg.vocab_size}: give ids of this model's "
                        "tokenizer.")
  eos = eos_ids(tok)
  sp = from_config(s, eos_id=tok.eos_id)
  # generation_config.json's other eos ids stop a completion as the tokenizer's eos does.
  sp = dataclasses.replace(sp, stop_ids=tuple(dict.fromkeys((*sp.stop_ids, *eos[1:]))))
  engine = Engine(graphdef, cfg, mesh, sampling=sp)
  rollout = generate(engine, params, prompts, n=n, seed=config.seed, slots=s.slots,
                     steps_per_call=s.steps_per_call, continuous=s.batching == "continuous",
                     grow_cache=s.get("grow_cache", True),
                     pad_id=tok.pad_id, progress=progress)

  run = RunDir(workdir)  # config.json and summary.json as every command writes them
  if not rundir.read_run(workdir):
    rundir.write_run(workdir, {"command": "sample"})
  run.write_config(config)
  path = os.path.join(workdir, "completions.jsonl")
  reasons: dict[str, int] = {}
  with open(path, "w", encoding="utf-8") as f:
    for i in range(len(rollout.lengths)):
      p = int(rollout.prompt_index[i])
      r = records[p]
      ids = rollout.completion_ids[i, :rollout.lengths[i]].tolist()
      reason = rollout.finish_reasons[i]
      if reason == "stop":
        reason = "eos" if ids and ids[-1] in eos else "stop"
      reasons[reason] = reasons.get(reason, 0) + 1
      row = {"prompt_index": p, "sample": i % n, "prompt": r.get("prompt"),
             **({"messages": r["messages"]} if r.get("messages") else {}),
             **({"answer": r["answer"]} if "answer" in r else {}),
             "prompt_text": render_prompt_text(r, tok, data), "prompt_ids": prompts[p],
             "completion": tok.decode(ids), "completion_ids": ids,
             "logprobs": rollout.logprobs[i, :rollout.lengths[i]].tolist(),
             "finish_reason": reason}
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
      shown = r.get("prompt") if r.get("prompt") is not None else row["prompt_text"]
      out(f"[{p}.{i % n}] {shown!r} -> {row['completion']!r} "
          f"({len(ids)} tokens, {reason})")
  summary = {**metrics(rollout), **{f"sampler/{k}": v for k, v in rollout.stats.items()},
             **{f"finish/{k}": v for k, v in sorted(reasons.items())}}
  run.write_summary(summary)
  st = rollout.stats
  out(f"{len(rollout.lengths)} completions ({len(records)} prompts x {n}), "
      f"{st['tokens_generated']} tokens in {st['wall_s']:.2f} s ({st['tokens_per_s']:.0f} tok/s "
      f"incl. compile; prefill {st['prefill_s']:.2f} s, decode {st['decode_s']:.2f} s, slot "
      f"utilisation {st['slot_utilisation']:.0%}) -> {path}")
  return {"rollout": rollout, "path": path}
