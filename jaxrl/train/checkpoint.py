"""Checkpoints: an orbax CheckpointManager over DIR/checkpoints holding the train state (params,
optimizer state, step, RNG) and each process's data-iterator state.

Saving is asynchronous: the arrays are copied off the train state before save() returns (the
next step donates that state), then written in the background. The data-iterator state is a
JSON snapshot taken at save() time, one file per process (each process reads its own shard);
snapshotting here, instead of handing orbax the live iterator, keeps a background write from
seeing an iterator that has already moved on.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

# restore_params reads this module's checkpoints into a layout; it lives with the other param
# readers in jaxrl.io.params and is re-exported here for the trainers that import it from here.
from jaxrl.io.params import restore_params  # noqa: F401


class DataStateHandler(ocp.CheckpointHandler):
  """Writes/reads this process's iterator state as process_<i>-of-<n>.json."""

  def _file(self, directory: epath.Path) -> epath.Path:
    return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

  def save(self, directory: epath.Path, args: "DataStateSave"):
    self._file(directory).write_text(json.dumps(args.state))

  def restore(self, directory: epath.Path, args: "DataStateRestore | None" = None):
    f = self._file(directory)
    if not f.exists():
      raise FileNotFoundError(f"{f} is missing: this checkpoint was written by a different "
                              "number of processes, so the data position cannot be restored.")
    return json.loads(f.read_text())

  def metadata(self, directory):
    return None

  def structure(self, directory):
    return None

  def finalize(self, directory):
    pass

  def close(self):
    pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
  state: Any


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
  pass


class Checkpointer:
  """save(step, state, data_state) / restore(abstract_state) over one directory."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    self.directory = epath.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=async_save),
        item_names=("state", "data"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: Any) -> None:
    if step in self.manager.all_steps():
      return  # already saved (e.g. an interrupt right after a periodic save)
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=DataStateSave(data_state)), force=True)

  def restore(self, abstract_state, step: int | None = None):
    """(state, data_state) at `step` (default: latest), placed with the abstract state's
    shardings: each device reads only its own shards."""
    step = self.latest_step() if step is None else step
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=DataStateRestore()))
    return out.state, out.data

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_state(state_shapes, shardings):
  """ShapeDtypeStructs carrying shardings: what restore needs to place each shard."""
  return jax.tree.map(lambda s, shd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shd),
                      state_shapes, shardings)
