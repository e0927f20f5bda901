"""Checkpoints: an orbax CheckpointManager over DIR/checkpoints holding the train state (params,
optimizer state, step, RNG) and each process's data-iterator state.

Saving is asynchronous: the arrays are copied off the train state before save() returns (the
next step donates that state), then written in the background. The data-iterator state is a
JSON snapshot taken at save() time, one file per process (each process reads its own shard);
snapshotting here, instead of handing orbax the live iterator, keeps a background write from
seeing an iterator that has already moved on.

A step directory is a checkpoint only once committed (orbax writes N.orbax-checkpoint-tmp-*
and renames it to N). A write that fails (a full disk, a read-only directory) raises
CheckpointFailed, one sentence naming the path and the last good checkpoint; orbax would log
the traceback and carry on. Old checkpoints are renamed into checkpoints/deleting/ before they
are removed, so a kill during that cleanup never leaves a half-deleted step where a step is
looked for; that folder and uncommitted temporaries are removed when the directory is next
opened.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import sys
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


class CheckpointFailed(RuntimeError):
  """A checkpoint could not be written; the message names the path and the last good one."""


_DELETING = "deleting"  # old steps are renamed here, then removed


class _Caught(logging.Filter):
  """Keeps the exceptions orbax logs, with their tracebacks, instead of printing them: a failed
  background write is logged there (from its own thread), not raised."""

  def __init__(self):
    super().__init__()
    self.errors: list[BaseException] = []

  def filter(self, record):
    if (record.levelno >= logging.ERROR and "orbax" in record.pathname and record.exc_info
        and record.exc_info[1] is not None):
      self.errors.append(record.exc_info[1])
      return False
    return True


def _quiet_failed_writes() -> None:
  """When one write of a checkpoint fails, orbax's event loop closes under its sibling writes,
  and each prints a traceback as it finishes (tensorstore's callback, through
  sys.unraisablehook, and asyncio's "Task exception was never retrieved"). CheckpointFailed
  says it once; these would bury it."""
  if getattr(sys.unraisablehook, "_jaxrl", False):
    return
  previous = sys.unraisablehook

  def hook(u):
    if not (u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed"):
      previous(u)

  hook._jaxrl = True
  sys.unraisablehook = hook
  logging.getLogger("asyncio").addFilter(
      lambda r: not ("never retrieved" in r.getMessage() and "orbax" in r.getMessage()))


class Checkpointer:
  """save(step, state, data_state) / restore(abstract_state) over one directory."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    self.directory = epath.Path(directory).absolute()
    if jax.process_index() == 0:
      self._remove_leftovers()
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=async_save,
                                             todelete_subdir=_DELETING),
        item_names=("state", "data"))
    self._pending: int | None = None  # the step being written in the background
    self._lost_any = None  # several processes: whether any lost a write (made on first use)
    self.failed: CheckpointFailed | None = None
    self._caught = _Caught()
    logging.getLogger("absl").addFilter(self._caught)
    _quiet_failed_writes()

  def _remove_leftovers(self) -> None:
    """Uncommitted temporaries (a kill during a write) and steps renamed for deletion (a kill
    during cleanup): none is a checkpoint, and orbax would warn about each one."""
    if not self.directory.exists():
      return
    for p in self.directory.iterdir():
      if ".orbax-checkpoint-tmp" in p.name or p.name == _DELETING:
        shutil.rmtree(p, ignore_errors=True)

  def committed_steps(self) -> list[int]:
    """The steps on disk whose write completed (read from the directory, not orbax's cache)."""
    if not self.directory.exists():
      return []
    return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: Any) -> None:
    if step in self.manager.all_steps():
      return  # already saved (e.g. an interrupt right after a periodic save)
    self.wait()  # orbax waits for the previous write here anyway; this checks it landed
    self._probe(step)
    self._guard(lambda: self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=DataStateSave(data_state)), force=True), step)
    self._pending = step

  def _probe(self, step: int) -> None:
    """Each process writes and removes a small file in the directory first. Orbax creates the
    step's directory in a background thread, and when that fails (a read-only directory) the
    save waits out a 5-minute barrier and reports only the timeout: this finds out at once,
    with the OS's words."""
    probe = self.directory / f".write-probe-{jax.process_index()}"
    error = None
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      probe.write_text(str(step))
      probe.unlink()
    except OSError as e:
      error = e
    # Not agreed across processes here: a collective at this point interleaves with orbax's
    # own barriers (two-process runs failed with a barrier name mismatch). A process that
    # fails stops; the others find out at their next save's barrier.
    if error is not None:
      self._fail(step, error)

  def restore(self, abstract_state, step: int | None = None):
    """(state, data_state) at `step` (default: latest), placed with the abstract state's
    shardings: each device reads only its own shards."""
    step = self.latest_step() if step is None else step
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=DataStateRestore()))
    return out.state, out.data

  def wait(self) -> None:
    """Blocks until the background write is over; raises CheckpointFailed unless it was
    committed. Old steps renamed for deletion are removed here."""
    step, self._pending = self._pending, None
    self._guard(self.manager.wait_until_finished, step)
    if step is not None:
      # Process 0 looks (orbax's finalize logs a failure and returns); all of them stop.
      lost = jax.process_index() == 0 and step not in self.committed_steps()
      if jax.process_count() > 1:  # the store, not a device program (distributed.any_process)
        if self._lost_any is None:
          from jaxrl.parallel.distributed import any_process  # noqa: PLC0415
          self._lost_any = any_process("checkpoint_lost")
        lost = self._lost_any(lost)
      if lost:
        self._fail(step, None)
    if jax.process_index() == 0:
      shutil.rmtree(self.directory / _DELETING, ignore_errors=True)

  def check(self) -> None:
    """Raises CheckpointFailed as soon as a background write is over and was not committed,
    without waiting for one still in flight: the loop calls it at each log step."""
    # With several processes each could see its write end at a different step, and wait()
    # agrees across them, so they find out at the next save instead.
    if (self._pending is not None and jax.process_count() == 1
        and not self.manager.is_saving_in_progress()):
      self.wait()

  def close(self) -> None:
    try:
      if self.failed is None:
        self.wait()
    finally:
      try:
        self.manager.close()
      except Exception:
        if self.failed is None:
          raise
      finally:  # after a failed write, orbax's background threads may still log their
        # teardown ("cannot schedule new futures after shutdown", seen once in 2 CI runs):
        # the filter stays, and CheckpointFailed's one sentence is all the user reads
        if self.failed is None:
          logging.getLogger("absl").removeFilter(self._caught)

  def _guard(self, fn, step: int | None) -> None:
    """Runs an orbax call that may write; what it raises, or what orbax logged as failed
    meanwhile, becomes CheckpointFailed."""
    if self.failed is not None:
      raise self.failed
    try:
      fn()
    except Exception as e:  # noqa: BLE001 - any failed write stops the run, in one sentence
      self._fail(step, e)
    if self._caught.errors:
      self._fail(step, self._caught.errors[0])

  def _fail(self, step: int | None, error: BaseException | None):
    self._caught.errors.clear()
    # The failed write's partial files are no checkpoint; on a full disk they are also what
    # keeps the run from writing its summary.json (an 8 MiB tmpfs: the half-written step filled
    # it). Removed once no write is in flight; committed steps are never touched.
    if jax.process_index() == 0:
      try:
        if not self.manager.is_saving_in_progress():
          self._remove_leftovers()
      except Exception:  # noqa: BLE001 - the failure below is what the user must read
        pass
    good = [s for s in self.committed_steps() if s != step]
    last = (f"the last good checkpoint is step {good[-1]} in {self.directory}" if good
            else f"no checkpoint in {self.directory} is complete")
    what = f"writing the checkpoint of step {step}" if step is not None else "writing a checkpoint"
    self.failed = CheckpointFailed(
        f"{what} to {self.directory} failed ({_reason(error)}): training stopped; {last}. "
        "Free space or make the directory writable, then re-run the same command to resume.")
    raise self.failed from None


_OS_ERRORS = [os.strerror(e) for e in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                        errno.EIO)]


def _reason(error: BaseException | None) -> str:
  """The OS's words for why a write failed ("No space left on device"), found in the error
  chain or, as tensorstore wraps them, in its message; else the error's first line."""
  if error is None:
    return "the step was not committed"
  seen, e = set(), error
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.strerror:
      return e.strerror
    words = next((w for w in _OS_ERRORS if w in str(e)), None)
    if words:
      return words
    e = e.__cause__ or e.__context__
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def abstract_state(state_shapes, shardings):
  """ShapeDtypeStructs carrying shardings: what restore needs to place each shard."""
  return jax.tree.map(lambda s, shd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shd),
                      state_shapes, shardings)
