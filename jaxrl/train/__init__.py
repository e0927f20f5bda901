"""The shared training machinery: optimizer, train state and step, checkpoints, run directory,
the loop (guards, progress, interrupts), evaluation, the Run skeleton that ties them together
(run.py). The trainers built on it are in jaxrl.algorithms."""

from __future__ import annotations

import sys

from jaxrl.errors import ConfigError
from jaxrl.parallel.distributed import maybe_initialize
from jaxrl.train.checkpoint import CheckpointFailed, Checkpointer
from jaxrl.train.loop import TrainingDiverged, resume, train_loop
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.train.run import Run
from jaxrl.train.rundir import RunDir, read_metrics
from jaxrl.train.state import TrainState, init_train_state, make_train_step, put_batch


def run_trainer(run_fn, args, overrides, load) -> None:
  """What every trainer command does: load the config, join the other processes (before any
  device is touched), then train. A diverged run, or one whose checkpoint could not be written,
  exits 1 with its one-line reason."""
  config = load(args, overrides)
  if not args.workdir:
    raise ConfigError("--workdir is required: give the run directory (re-using one resumes).")
  maybe_initialize(config.get("distributed"))
  try:
    run_fn(config, args.workdir)
  except (TrainingDiverged, CheckpointFailed) as e:
    print(f"jaxrl {args.command}: {e}", file=sys.stderr)
    raise SystemExit(1) from None


__all__ = ["Checkpointer", "Run", "RunDir", "TrainState", "TrainingDiverged", "init_train_state",
           "make_optimizer", "make_train_step", "optim_section", "put_batch", "read_metrics",
           "resume", "run_trainer", "train_loop"]
