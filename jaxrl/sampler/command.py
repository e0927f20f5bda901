"""`jaxrl sample`: completions for a JSONL file of prompts, printed and written to the workdir.

--checkpoint takes a run directory of `jaxrl sft` or `jaxrl grpo` (or its checkpoints/): its latest
params are read straight into the sampler layout. Without it the model is a random init of the
config's model (useful for checking the plumbing only).
"""

from __future__ import annotations

import json
import os

import jax

from jaxrl import config as config_lib
from jaxrl.data import ByteTokenizer
from jaxrl.data.records import check_file, text_lines
from jaxrl.errors import ConfigError
from jaxrl.io.params import restore_params
from jaxrl.parallel import init_params, mesh_from_config
from jaxrl.sampler.engine import Engine
from jaxrl.sampler.rollout import generate, metrics
from jaxrl.sampler.sampling import from_config
from jaxrl.train import rundir
from jaxrl.train.rundir import RunDir


def read_prompts(path: str) -> list[dict]:
  """The records of a prompts JSONL file; blank lines are skipped, bad ones named by line. A
  byte-order mark is dropped and bytes that are not UTF-8 are named (jaxrl.data.text_lines)."""
  check_file(path, "prompts file",
             give="a JSONL file with one JSON object holding a \"prompt\" string per line")
  records = []
  for lineno, line in text_lines(path):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{path}, line {lineno}: not valid JSON ({e.msg}): write one object "
                        "per line, like {\"prompt\": \"2+2=\"}.") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
      raise ConfigError(f"{path}, line {lineno}: field \"prompt\" is missing or not a string: "
                        "write one object per line, like {\"prompt\": \"2+2=\"}.")
    records.append(record)
  if not records:
    raise ConfigError(f"prompts file {path} holds no prompts: add lines like "
                      "{\"prompt\": \"2+2=\"}.")
  return records


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
  if config.model.get("hf_path"):
    # This command reads the byte tokenizer and a run's checkpoint only; an HF model's weights
    # and tokenizer are not wired here, and a random init must never pass for them.
    raise ConfigError(f"model.hf_path={config.model.hf_path!r} is not supported by `jaxrl "
                      "sample` yet (it would sample random weights): drop it, and pass "
                      "--checkpoint with a jaxrl sft or grpo run directory instead.")
  # A training run's dir is not overwritten: its config.json would be replaced by this one.
  rundir.check_owner(workdir, command="sample")
  records = read_prompts(prompts_path)
  s = config.sampling
  n = s.n if n is None else n
  if n < 1:
    raise ConfigError(f"--n {n} asks for no samples: give 1 or more per prompt.")
  tok = ByteTokenizer()
  cfg = config_lib.model_config(config)
  if tok.vocab_size > cfg.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.vocab_size} is smaller than the byte tokenizer's "
                      f"{tok.vocab_size} ids: choose a preset with a vocabulary of at least "
                      f"{tok.vocab_size}.")
  sp = from_config(s, eos_id=tok.eos_id)
  mesh = mesh_from_config(config.mesh)
  graphdef, params = init_params(cfg, mesh, "sampler", seed=config.seed)
  if checkpoint:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            params)
    params = restore_params(checkpoint, abstract, key="--checkpoint")
  engine = Engine(graphdef, cfg, mesh, sampling=sp)
  prompts = [tok.encode(r["prompt"], bos=True) for r in records]
  rollout = generate(engine, params, prompts, n=n, seed=config.seed, slots=s.slots,
                     steps_per_call=s.steps_per_call, continuous=s.batching == "continuous",
                     grow_cache=s.get("grow_cache", True),
                     pad_id=tok.pad_id, progress=progress)

  run = RunDir(workdir)  # config.json and summary.json as every command writes them
  if not rundir.read_run(workdir):
    rundir.write_run(workdir, {"command": "sample"})
  run.write_config(config)
  path = os.path.join(workdir, "completions.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    for i in range(len(rollout.lengths)):
      p = int(rollout.prompt_index[i])
      ids = rollout.completion_ids[i, :rollout.lengths[i]].tolist()
      row = {"prompt": records[p]["prompt"], "prompt_index": p, "sample": i % n,
             "completion": tok.decode(ids), "completion_ids": ids,
             "logprobs": rollout.logprobs[i, :rollout.lengths[i]].tolist(),
             "finish_reason": rollout.finish_reasons[i]}
      f.write(json.dumps(row) + "\n")
      out(f"[{p}.{i % n}] {records[p]['prompt']!r} -> {row['completion']!r} "
          f"({len(ids)} tokens, {row['finish_reason']})")
  summary = {**metrics(rollout), **{f"sampler/{k}": v for k, v in rollout.stats.items()}}
  run.write_summary(summary)
  st = rollout.stats
  out(f"{len(rollout.lengths)} completions ({len(records)} prompts x {n}), "
      f"{st['tokens_generated']} tokens in {st['wall_s']:.2f} s ({st['tokens_per_s']:.0f} tok/s "
      f"incl. compile; prefill {st['prefill_s']:.2f} s, decode {st['decode_s']:.2f} s, slot "
      f"utilisation {st['slot_utilisation']:.0%}) -> {path}")
  return {"rollout": rollout, "path": path}
