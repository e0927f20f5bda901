"""`jaxrl eval`: a checkpoint's held-out metrics on a file of {"prompt", "answer"} records.

    jaxrl eval --config configs/grpo_tiny.py --checkpoint runs/grpo --data test.jsonl \
        [--workdir OUT] [--config.eval.n=8 --config.eval.k='(1, 4)' --config.eval.reward=...]

--checkpoint takes a run directory of `jaxrl sft` or `jaxrl grpo` (or its checkpoints/): its
latest params, restored into the config's model (every tensor checked). Without it the weights
are model.hf_path's; with neither there is nothing trained to evaluate, and the command says so
rather than scoring a random init. --data defaults to data.eval_file, else data.task's test split
(eval.examples prompts, as the trainers hold out). The config's eval section gives the checker
(eval.reward), n, k, temperature and max_new_tokens (jaxrl.config.eval_keys; keys a config lacks
take those defaults). Writes OUT/eval.json (the metrics and what produced them) and
OUT/completions.jsonl (every completion, greedy and sampled, with its extracted answer and
score); OUT defaults to RUN/eval.
"""

from __future__ import annotations

import json
import os
import time

import jax

from jaxrl import config as config_lib
from jaxrl.data import read_records
from jaxrl.data.hf_tokenizer import tokenizer_for
from jaxrl.errors import ConfigError
from jaxrl.evals.evaluator import Evaluator, checker_for
from jaxrl.io.params import restore_params
from jaxrl.models import abstract_model
from jaxrl.parallel import mesh_from_config, tree_shardings
from jaxrl.parallel.sync import sync
from jaxrl.train import rundir
from jaxrl.train.rundir import RunDir
from jaxrl.train.run import adopt_hf_path, adopt_lora

# `jaxrl eval` reads any trainer's config: beyond the shared sections, only the eval section's
# ranges, which jaxrl.config checks for every config (check_loop_sections).
CHOICES: dict = {}


def load(spec: str, overrides=()):
  """The config of `spec` with the evaluator's keys (jaxrl.config.eval_keys) added to an eval
  section that lacks them (an SFT or DPO config's), so --config.eval.n=8 works on any trainer's
  config; then the overrides, then the checks."""
  config = config_lib.load_config(spec, (), CHOICES)
  if "eval" in config:
    with config.eval.unlocked():
      for key, value in {**config_lib.eval_keys(), "max_new_tokens": 0}.items():
        if key not in config.eval:
          config.eval[key] = value
  config_lib.apply_overrides(config, overrides)
  config_lib.validate(config, CHOICES)
  return config


def settings(config) -> dict:
  """The eval section with jaxrl.config.eval_keys' defaults for the keys it lacks, and
  max_new_tokens resolved (GRPO's 0: rollout.max_new_tokens)."""
  if "eval" not in config:
    raise ConfigError("the config has no `eval` section: use a trainer's config (e.g. "
                      "configs/grpo_tiny.py), whose eval section jaxrl eval reads.")
  s = {**config_lib.eval_keys(), "examples": 256, "batch_size": 64, "max_new_tokens": 0,
       **config.eval.to_dict()}
  if not s["max_new_tokens"]:
    s["max_new_tokens"] = config.rollout.max_new_tokens if "rollout" in config else 0
  if s["max_new_tokens"] < 1:
    raise ConfigError("eval.max_new_tokens is not set: give --config.eval.max_new_tokens=N "
                      "(the tokens each completion may take).")
  return s


def held_out(config, data: str | None, s: dict) -> tuple[list[dict], str]:
  """(records, where they came from): --data, else data.eval_file, else data.task's test split
  (the trainers' held-out draw: eval.examples records at seed + 1). Files are read as the
  trainers read them: JSONL, Parquet, Arrow or a save_to_disk directory, data.fields renaming
  columns."""
  d = config.get("data") or {}
  path = data or d.get("eval_file") or ""
  if path:
    records, skipped = read_records(path, "rl", on_bad_row=d.get("on_bad_row", "error"),
                                    fields=d.get("fields"))
    return records, path + (f" ({skipped} bad rows skipped)" if skipped else "")
  if d.get("task"):
    from jaxrl.tasks import get_task
    task = get_task(d["task"])
    return task.records("test", s["examples"], config.seed + 1), f"{task.name}'s test split"
  raise ConfigError("jaxrl eval has no records: pass --data FILE (JSONL with one {\"prompt\", "
                    "\"answer\"} object a line, or Parquet / Arrow), or set data.eval_file or "
                    "data.task.")


def run_dir_of(checkpoint: str) -> str:
  """The run directory of --checkpoint, which may name it or its checkpoints/."""
  path = os.path.normpath(checkpoint)
  return os.path.dirname(path) if os.path.basename(path) == "checkpoints" else path


def load_params(config, cfg, mesh, checkpoint: str | None):
  """(graphdef, params in the learner layout, step or None): --checkpoint's latest params,
  else model.hf_path's weights."""
  if checkpoint:
    graphdef, shapes, axes = abstract_model(cfg)
    target = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                          shapes, tree_shardings(shapes, axes, mesh, "learner"))
    params = restore_params(checkpoint, target, key="--checkpoint")
    steps = rundir.checkpoint_steps(run_dir_of(checkpoint))
    return graphdef, params, steps[-1] if steps else None
  if config.model.get("hf_path"):
    from jaxrl.io.hf import params_from_config
    _, graphdef, params = params_from_config(config, mesh, "learner")
    return graphdef, params, None
  raise ConfigError("jaxrl eval needs --checkpoint RUN (a jaxrl sft or grpo run directory) or "
                    "model.hf_path: without either it would score randomly initialised weights.")


def run(config, *, checkpoint: str | None, data: str | None = None,
        workdir: str | None = None, out=print) -> dict:
  """Evaluates and writes WORKDIR/eval.json and WORKDIR/completions.jsonl; returns eval.json's
  contents."""
  if not workdir:
    if not checkpoint:
      raise ConfigError("jaxrl eval needs --workdir DIR (where eval.json and completions.jsonl "
                        "go) when there is no --checkpoint run directory to write under.")
    workdir = os.path.join(run_dir_of(checkpoint), "eval")
  config_lib.check_choices(config, CHOICES)
  config_lib.check_loop_sections(config)  # the CLI checked on load; a notebook may not have
  s = settings(config)
  # A training run's dir is not overwritten: its config.json would be replaced by this one.
  rundir.check_owner(workdir, command="eval")
  from jaxrl.train.data import load_task
  task = load_task(config) if "data" in config else None
  checker = checker_for(config, task)
  if checker is None:
    raise ConfigError("the config names no checker: set --config.eval.reward to a reward (e.g. "
                      "exact_match) or to task with data.task set.")
  records, where = held_out(config, data, s)
  if checkpoint:  # a run started from model.hf_path: its tokenizer, template and shapes
    adopt_hf_path(config, checkpoint, key="--checkpoint", say=out)
    adopt_lora(config, checkpoint, key="--checkpoint", say=out)
  cfg = config_lib.model_config(config)
  tokenizer = tokenizer_for(config)
  mesh = mesh_from_config(config.mesh)
  graphdef, params, step = load_params(config, cfg, mesh, checkpoint)
  main = jax.process_index() == 0  # every process evaluates the same; one writes
  run_dir = RunDir(workdir, write=main)  # a workdir that cannot be written: said now, not later
  _, shapes, axes = abstract_model(cfg)
  sampler_shd = tree_shardings(shapes, axes, mesh, "sampler")
  ev = Evaluator(graphdef, cfg, mesh, tokenizer, records, checker, batch=s["batch_size"],
                 max_new=s["max_new_tokens"], n=s["n"], ks=s["k"],
                 temperature=s["temperature"], seed=config.seed,
                 to_sampler=lambda p: sync(p, sampler_shd), data_cfg=config.get("data"))
  out(f"eval: {len(records)} prompts of {where}, checker {checker.name}, greedy"
      + (f" and {s['n']} samples per prompt at temperature {s['temperature']}" if s["n"] else "")
      + f", up to {s['max_new_tokens']} new tokens")
  t0 = time.perf_counter()
  metrics = ev(params)
  wall = time.perf_counter() - t0

  result = {"checkpoint": checkpoint or "", "hf_path": config.model.get("hf_path") or "",
            "step": step, "data": where, "prompts": len(records), "checker": checker.name,
            "n": s["n"], "k": list(s["k"]), "temperature": s["temperature"],
            "max_new_tokens": s["max_new_tokens"], "metrics": metrics,
            "timing_s": {"total": wall, **ev.timing}}
  path = os.path.join(workdir, "completions.jsonl")
  if not main:
    return result
  if not rundir.read_run(workdir):
    rundir.write_run(workdir, {"command": "eval"})
  run_dir.write_config(config)
  with open(path, "w", encoding="utf-8") as f:
    for row in ev.completions:
      f.write(json.dumps(row) + "\n")
  with open(os.path.join(workdir, "eval.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
    f.write("\n")
  for k, v in metrics.items():
    out(f"  {k:<20}{v:.4f}")
  out(f"{len(ev.completions)} completions -> {path}; metrics -> "
      f"{os.path.join(workdir, 'eval.json')} ({wall:.1f} s)")
  return result
