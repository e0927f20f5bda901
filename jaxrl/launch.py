"""Experiments: a config file's sweep() expanded into runs, each with its own workdir, run here
(one or N at a time), on a Cloud TPU VM (through tpu/*.sh), or as XManager work units.

    jaxrl launch --config configs/sft_tiny.py:runlocal --sweep --parallel 2 --workdir runs/exp
    jaxrl launch --config configs/sft_tiny.py --sweep --command sft --workdir gs://B/exp \
        --tpu my-tpu --zone us-west4-a --accelerator-type v5litepod-8 --dry-run

A run is named by its index and the overrides it adds (e.g. `001-lr=0.001`); its workdir is
ROOT/<name>, holding the resolved config.json before it starts. Every run's overrides are
applied and validated before anything starts, so a bad sweep fails at once, not at run 7.
Re-launching on the same ROOT resumes every run (each trainer resumes its own workdir).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.train.rundir import _write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = ("sft", "rm", "dpo", "grpo", "ppo")  # commands that take --workdir and resume on it


@dataclasses.dataclass
class Run:
  name: str                   # e.g. "001-lr=0.001": unique in the experiment, a directory name
  overrides: dict[str, Any]   # what the sweep adds to the config
  workdir: str                # ROOT/<name>
  argv: list[str]             # the jaxrl command line (without "jaxrl")
  config: dict                # the resolved config, as config.json holds it


def _value_text(v: Any) -> str:
  return repr(v) if isinstance(v, (tuple, list)) else str(v)


def run_name(i: int, overrides: dict[str, Any]) -> str:
  """`<index>-<last key part>=<value>,...`, cut to a length that paths and logs carry."""
  parts = ",".join(f"{k.split('.')[-1]}={_value_text(v)}" for k, v in overrides.items())
  name = f"{i:03d}" + (f"-{parts}" if parts else "")
  return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)[:80]


def command_of(config) -> str:
  """The trainer a config is for, from the section only it has (a config with none is SFT's):
  `jaxrl launch`'s default --command."""
  for section, command in (("critic", "ppo"), ("rollout", "grpo"), ("ref", "dpo"),
                           ("head", "rm")):
    if section in config:
      return command
  return "sft"


def parse_seeds(text: str) -> list[int]:
  """`--seeds 0-4` (a range, both ends in), `0,3,7`, or a mix (`0-2,9`), in order, no repeats."""
  seeds = []
  try:
    for part in (p.strip() for p in text.split(",")):
      lo, _, hi = part.partition("-") if not part.startswith("-") else (part, "", "")
      seeds += range(int(lo), int(hi) + 1) if hi else [int(lo)]
  except ValueError:
    raise ConfigError(f"--seeds {text!r}: give seeds as a range or a comma list of "
                      "non-negative integers, like 0-4 or 0,3,7.") from None
  if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
    raise ConfigError(f"--seeds {text!r}: give seeds as a range or a comma list of distinct "
                      "non-negative integers, like 0-4 or 0,3,7.")
  return seeds


def sweep_items(spec: str, overrides: list[str] = (), *, sweep: bool = True, choices=None,
                check: Callable[[Any], None] | None = None, seeds: list[int] | None = None):
  """[(item, its --config.k=v arguments, its config)] for each of `spec`'s sweep() items (one
  empty item without `sweep`). Every item's config is loaded and validated here (against
  `choices` too: the trainer's CHOICES), so a bad one is a ConfigError naming it before any run
  starts; `check(config)` adds the caller's own checks (the CLI's: the command's sections).
  With `seeds`, each item runs once per seed (the top-level `seed`, which draws the init, the
  data order and the samples), seed varying fastest. `jaxrl sweep` and `jaxrl launch` share it."""
  items = config_lib.load_sweep(spec) if sweep else [{}]
  if not items:
    raise ConfigError(f"{config_lib.split_spec(spec)[0]}: sweep() yielded no runs.")
  if seeds is not None:
    if any("seed" in item for item in items):
      raise ConfigError(f"{config_lib.split_spec(spec)[0]}: its sweep() sets `seed` already: "
                        "drop --seeds, or the seed from sweep().")
    items = [{**item, "seed": s} for item in items for s in seeds]
  out = []
  for i, item in enumerate(items):
    extra = [f"--config.{k}={_value_text(v)}" for k, v in item.items()]
    try:
      config = config_lib.load_config(spec, [*overrides, *extra], choices)
      if check is not None:
        check(config)
    except ConfigError as e:
      raise ConfigError(f"sweep run {i} ({item}): {e}") from None
    out.append((item, extra, config))
  return out


def expand(spec: str, *, command: str, root: str, overrides: list[str] = (),
           sweep: bool = True, choices=None, check: Callable[[Any], None] | None = None,
           seeds: list[int] | None = None) -> list[Run]:
  """The runs of `spec`'s sweep() (one run without `sweep`), each checked against the config
  and `choices` (the command's trainer's CHOICES)."""
  if command not in TRAINERS:
    raise ConfigError(f"jaxrl launch --command {command!r}: launch runs trainers that write a "
                      f"workdir; choose one of {', '.join(TRAINERS)}.")
  runs = []
  for i, (item, extra, config) in enumerate(sweep_items(spec, overrides, sweep=sweep,
                                                        choices=choices, check=check, seeds=seeds)):
    name = run_name(i, item)
    workdir = _join(root, name)
    argv = [command, "--config", spec, *overrides, *extra, "--workdir", workdir]
    resolved = json.loads(json.dumps(config.to_dict(), default=str))
    runs.append(Run(name, dict(item), workdir, argv, resolved))
  return runs


def _join(root: str, name: str) -> str:
  return f"{root.rstrip('/')}/{name}" if "://" in root else os.path.join(root, name)


def write_experiment(runs: list[Run], root: str, spec: str) -> None:
  """ROOT/experiment.json (the runs and their overrides) and each ROOT/<name>/config.json,
  written as the trainers write theirs, so a resumed trainer sees no difference."""
  os.makedirs(root, exist_ok=True)
  for run in runs:
    os.makedirs(run.workdir, exist_ok=True)
    _write_json(os.path.join(run.workdir, "config.json"), run.config)
  _write_json(os.path.join(root, "experiment.json"), {
      "config": spec, "runs": [{"name": r.name, "overrides": r.overrides, "workdir": r.workdir,
                                "command": ["jaxrl", *r.argv]} for r in runs]})


def describe(runs: list[Run], out=print) -> None:
  for run in runs:
    out(f"[{run.name}] " + (" ".join(f"{k}={_value_text(v)}" for k, v in run.overrides.items())
                           or "(the config as it is)"))
    out("    jaxrl " + shlex.join(run.argv))


# ----------------------------------------------------------------------------- local


@dataclasses.dataclass
class Result:
  name: str
  returncode: int
  wall_s: float
  log: str


def run_local(runs: list[Run], *, parallel: int = 1, out=print, poll_s: float = 0.2,
              env: dict | None = None) -> list[Result]:
  """Runs each `jaxrl <argv>` as a subprocess, `parallel` at a time, its stdout and stderr in
  <workdir>/launch.log. Ctrl-C or SIGTERM passes one SIGTERM to each running one (each saves a
  checkpoint and stops), waits for them, then returns."""
  if parallel < 1:
    raise ConfigError(f"--parallel {parallel}: run at least 1 at a time.")
  pending, active, results = list(runs), {}, {}
  stop, signalled = [], set()
  # Ctrl-C too, so that no KeyboardInterrupt leaves the runs behind unwatched mid-save.
  previous = {s: signal.signal(s, lambda *_: stop.append(True))
              for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    while (pending and not stop) or active:
      while pending and len(active) < parallel and not stop:
        run = pending.pop(0)
        os.makedirs(run.workdir, exist_ok=True)
        log = os.path.join(run.workdir, "launch.log")
        f = open(log, "ab")
        proc = subprocess.Popen([sys.executable, "-m", "jaxrl", *run.argv], stdout=f,
                                stderr=subprocess.STDOUT, env=env)
        active[run.name] = (proc, f, time.perf_counter(), log)
        out(f"started  {run.name} (pid {proc.pid}; log {log})")
      time.sleep(poll_s)
      if stop:
        # One SIGTERM each, then wait: a run saves and stops on the first, and a repeated
        # signal must not be what a run is busy absorbing while it writes its checkpoint.
        for proc, *_ in active.values():
          if proc.poll() is None and proc.pid not in signalled:
            proc.send_signal(signal.SIGTERM)
            signalled.add(proc.pid)
      for name, (proc, f, t0, log) in list(active.items()):
        if proc.poll() is None:
          continue
        f.close()
        results[name] = Result(name, proc.returncode, time.perf_counter() - t0, log)
        state = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}; see {log})"
        out(f"finished {name}: {state} in {results[name].wall_s:.1f} s")
        del active[name]
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for run in pending:
    out(f"not started: {run.name} (stopped)")
  return [results[r.name] for r in runs if r.name in results]


# ----------------------------------------------------------------------------- TPU


def _repo_relative(spec: str) -> str:
  """The config path as the TPU workers see it: relative to the checkout setup.sh copied."""
  path, arg = config_lib.split_spec(spec)
  full = os.path.abspath(path)
  if os.path.commonpath([full, ROOT]) != ROOT:
    raise ConfigError(f"--config {path} is outside the checkout ({ROOT}): tpu/setup.sh copies "
                      "only the checkout to the workers; put the config under configs/.")
  rel = os.path.relpath(full, ROOT)
  return rel + (f":{arg}" if arg is not None else "")


def tpu_commands(runs: list[Run], spec: str, *, name: str, zone: str, experiment: str,
                 accelerator_type: str = "", workers: int = 0, project: str = "",
                 log_dir: str = "runs/tpu-logs", setup: bool = True,
                 dry_run: bool = False) -> list[list[str]]:
  """The tpu/*.sh invocations that run the experiment on a TPU VM, one run after another:
  setup.sh once (code to every worker; the workdir's bucket mounted), then run.sh per run."""
  if not (accelerator_type or workers):
    raise ConfigError("jaxrl launch --tpu needs --accelerator-type (e.g. v5litepod-8) or "
                      "--workers N, to know how many workers' logs to collect.")
  rel = _repo_relative(spec)
  common = ["--name", name, "--zone", zone] + (["--project", project] if project else [])
  dry = ["--dry-run"] if dry_run else []
  cmds = []
  if setup:
    bucket = []
    root = runs[0].workdir if runs else ""
    if root.startswith("gs://"):
      bucket = ["--bucket", root[len("gs://"):].split("/")[0]]
    cmds.append(["bash", os.path.join(ROOT, "tpu", "setup.sh"), *common, *bucket, *dry])
  size = (["--accelerator-type", accelerator_type] if accelerator_type else
          ["--workers", str(workers)])
  for run in runs:
    argv = [rel if a == spec else a for a in run.argv]
    cmds.append(["bash", os.path.join(ROOT, "tpu", "run.sh"), *common, *size,
                 "--run-name", f"{experiment}-{run.name}", "--log-dir", log_dir, *dry, "--",
                 *argv])
  return cmds


def run_tpu(cmds: list[list[str]], *, out=print) -> int:
  """Runs the tpu/*.sh commands in order; stops at the first failure (its exit status)."""
  for cmd in cmds:
    out("$ " + shlex.join(cmd))
    sys.stdout.flush()  # before the script's own output
    rc = subprocess.run(cmd).returncode
    if rc:
      out(f"stopped: {os.path.basename(cmd[1])} exited with status {rc}")
      return rc
  return 0


# ----------------------------------------------------------------------------- XManager

# XManager resource names per TPU generation (xm.ResourceType members).
_XM_TPU = {"v2": "TPU_V2", "v3": "TPU_V3", "v4": "TPU_V4", "v5p": "TPU_V5P",
           "v5litepod": "TPU_V5E", "v5e": "TPU_V5E", "v6e": "TPU_V6E"}


def xm_job_specs(runs: list[Run], spec: str, *, accelerator_type: str,
                 experiment: str) -> list[dict]:
  """One XManager work unit per run, as plain data (tpu/xm_launch.py turns each into an
  xm.Job; a test checks these without xmanager installed).

  args: the jaxrl command line inside the container (the checkout is the working directory);
  requirements: {xm resource name: chips}; env: what every TPU job needs to find its peers."""
  gen, _, size = accelerator_type.rpartition("-")
  if gen not in _XM_TPU or not size.isdigit():
    raise ConfigError(f"--accelerator-type {accelerator_type!r}: use <generation>-<size> with "
                      f"generation one of {', '.join(sorted(_XM_TPU))}, e.g. v5litepod-8.")
  # v5e/v6e sizes count chips; v2-v5p sizes count TensorCores (2 per chip).
  chips = int(size) if gen in ("v5litepod", "v5e", "v6e") else int(size) // 2
  rel = _repo_relative(spec)
  specs = []
  for run in runs:
    specs.append({
        "name": f"{experiment}/{run.name}",
        "args": ["jaxrl", *[rel if a == spec else a for a in run.argv]],
        "overrides": dict(run.overrides),
        "workdir": run.workdir,
        "requirements": {_XM_TPU[gen]: chips},
        "accelerator_type": accelerator_type,
        "env": {"JAXRL_DISTRIBUTED": "auto"} if _hosts(gen, int(size)) > 1 else {},
    })
  return specs


def _hosts(gen: str, size: int) -> int:
  per_host = 4 if gen in ("v5litepod", "v5e", "v6e") else 8
  return 1 if size <= 8 else size // per_host
