"""Data sharding for trainers: a fixed number of shards, each process reading its own.

The global batch is the concatenation of one batch from each of `shards` shard iterators. A
process reads only the shards it owns, so with data.shards fixed a run sees the same global
batches whether it runs as one process or several (shards default to one per process).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl.errors import ConfigError


def data_shards(shards: int = 0) -> tuple[int, list[int]]:
  """(shard count, the shard indices this process reads). 0 means one shard per process."""
  n, p = jax.process_count(), jax.process_index()
  shards = shards or n
  if shards % n:
    raise ConfigError(f"data.shards={shards} is not a multiple of the {n} processes: use a "
                      f"multiple of {n} (or 0 for one shard per process).")
  per = shards // n
  return shards, list(range(p * per, (p + 1) * per))


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
