"""Data for trainers: the records (a file or a built-in task), and a fixed number of data shards,
each process reading its own.

The global batch is the concatenation of one batch from each of `shards` shard iterators. A
process reads only the shards it owns, so with data.shards fixed a run sees the same global
batches whether it runs as one process or several (shards default to one per process).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxrl.data import read_records
from jaxrl.errors import ConfigError


def load_task(config):
  """The built-in task data.task names (with its options, e.g. "addition:max_digits=3"), or
  None when it is empty."""
  if not config.data.task:
    return None
  from jaxrl.tasks import get_task
  return get_task(config.data.task)


def records(config, task, kind: str, *, build: Callable, eval_kind: str = "", what: str):
  """(train records, held-out records, train rows skipped) of a run.

  Train: data.train_file's records of `kind` (JSONL, Parquet, Arrow, a save_to_disk directory
  or array_record, columns renamed by data.fields), else the task's build("train",
  data.train_examples, seed). Held out: data.eval_file's records of `eval_kind` (default
  `kind`), else the task's build("test", eval.examples, seed + 1), else none. `what` names a
  train file's rows in the error when there is neither a task nor a file.
  """
  d, seed = config.data, config.seed

  def read(path, kind):
    return read_records(path, kind, on_bad_row=d.on_bad_row, fields=d.get("fields"))

  skipped = 0
  if d.train_file:
    train, skipped = read(d.train_file, kind)
  elif task is not None:
    train = build("train", d.train_examples, seed)
  else:
    raise ConfigError("data.task and data.train_file are both empty: set data.task to a "
                      f"built-in task (e.g. addition) or data.train_file to a JSONL of {what}.")
  if d.eval_file:
    held_out, _ = read(d.eval_file, eval_kind or kind)
  elif task is not None:
    held_out = build("test", config.eval.examples, seed + 1)
  else:
    held_out = []
  return train, held_out, skipped


def answers(config, task) -> list[dict] | None:
  """The task's held-out {prompt, answer} records (greedy exact match), or None."""
  if task is None:
    return None
  return task.records("test", config.eval.examples, config.seed + 1)


def data_shards(shards: int = 0) -> tuple[int, list[int]]:
  """(shard count, the shard indices this process reads). 0 means one shard per process."""
  n, p = jax.process_count(), jax.process_index()
  shards = shards or n
  if shards % n:
    raise ConfigError(f"data.shards={shards} is not a multiple of the {n} processes: use a "
                      f"multiple of {n} (or 0 for one shard per process).")
  per = shards // n
  return shards, list(range(p * per, (p + 1) * per))


def check_section(config) -> None:
  """A batch trainer's data section (SFT, reward model, DPO), at config load: at least one row
  per batch and one token per row; shards 0 means one per process."""
  from jaxrl import config as config_lib
  config_lib.check_at_least(config, 1, "data.batch_size", "data.seq_len")
  config_lib.check_at_least(config, 0, "data.shards", "data.train_examples")


def check_batch_size(batch_size: int, shards: int, replicas: int, accum: int) -> None:
  """The global batch must split evenly into the data shards, the mesh's batch shards
  (data x fsdp = `replicas`) and, within those, the accumulation micro-batches."""
  for what, n in ((f"data.shards={shards}", shards),
                  (f"the {replicas} batch shards of the mesh (data x fsdp)", replicas),
                  (f"optim.accum_steps={accum} x {replicas} batch shards", accum * replicas)):
    if n < 1 or batch_size % n:
      raise ConfigError(f"data.batch_size={batch_size} is not divisible by {what}: choose a "
                        f"batch size that is a multiple of {max(n, 1)}.")


class ShardedBatches:
  """Concatenates the batches of several shard iterators; checkpointable like each of them."""

  def __init__(self, iterators):
    self.iterators = list(iterators)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(it) for it in self.iterators]
    if len(parts) == 1:
      return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def get_state(self) -> dict:
    return {"shards": [it.get_state() for it in self.iterators]}

  def set_state(self, state: dict) -> None:
    if len(state["shards"]) != len(self.iterators):
      raise ConfigError(f"the checkpoint holds {len(state['shards'])} data shard(s) for this "
                        f"process but the run reads {len(self.iterators)}: resume with the "
                        "data.shards and process count it was saved with.")
    for it, s in zip(self.iterators, state["shards"]):
      it.set_state(s)
