"""The run directory every command writes (docs/design.md):

    DIR/config.json      the resolved config, and under "backend" what the process runs on
    DIR/metrics.jsonl    one JSON object per log step: {"step": s, "loss": ..., ...}
    DIR/tb/              TensorBoard scalars (events.out.tfevents.*)
    DIR/checkpoints/     orbax (see checkpoint.py)
    DIR/summary.json     written at the end: status, final step, last metrics, wall time,
                         and "backend" again

"backend" is jaxrl.backends.describe(): the platform, the allocator, the attention and dot
kernels, each with why (on CPU, what JAXRL_TCMALLOC, JAXRL_CPU_KERNELS and JAXRL_CPU_DOTS chose),
so a run's numbers can be traced to the kernels that made them.

Only process 0 writes files here; other processes get a RunDir that writes nothing, so call
sites need no `if process_index == 0`.

The TensorBoard writer is a few lines of protobuf wire format and TFRecord framing, so neither
TensorFlow nor tensorboardX is needed to write events that TensorBoard reads.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from typing import Any

from jaxrl import backends


def read_config(workdir: str) -> dict | None:
  """The resolved config a run wrote to DIR/config.json, as a dict; None when DIR has none."""
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


class RunDir:

  def __init__(self, workdir: str, *, write: bool = True):
    self.workdir = workdir
    self.write = write
    self.checkpoints = os.path.join(workdir, "checkpoints")
    self._tb = None
    if write:
      # One sentence before any work, not an OSError from the first metrics row or checkpoint;
      # a throwaway file tests writability (root passes permission bits, not a read-only mount).
      import tempfile

      from jaxrl.errors import ConfigError
      if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir {workdir} is a file, not a directory: give a directory "
                          "(a new one starts a run; a run's directory resumes it).")
      try:
        os.makedirs(workdir, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
          pass
      except OSError as e:
        raise ConfigError(f"--workdir {workdir} cannot be written ({e.strerror or e}): give a "
                          "directory you can write to.") from None

  def path(self, name: str) -> str:
    return os.path.join(self.workdir, name)

  def write_config(self, config, *, out=None) -> None:
    """Writes config.json (the config and the backend). Resuming with a changed config is
    allowed (e.g. more steps), but never silent: with `out`, the keys that differ from the
    existing config.json are said (the backend's too, where that file records one)."""
    old = self.read_config() if out is not None else None
    backend = backends.describe()
    if old is not None:
      # Through JSON, as config.json was written, so a tuple and its list compare equal.
      flat_old = _flatten(old)
      new = config.to_dict() if "backend" not in old else {**config.to_dict(), "backend": backend}
      flat_new = _flatten(json.loads(json.dumps(new, default=str)))
      changed = [k for k in sorted(set(flat_old) | set(flat_new))
                 if flat_old.get(k) != flat_new.get(k)]
      if changed:
        out("note: the config differs from the one in config.json: " + ", ".join(
            f"{k}: {flat_old.get(k)!r} -> {flat_new.get(k)!r}" for k in changed))
    if self.write:
      _write_json(self.path("config.json"), {**config.to_dict(), "backend": backend})

  def read_config(self) -> dict | None:
    return read_config(self.workdir)

  def truncate_metrics(self, after_step: int) -> None:
    """Drops metrics logged past `after_step`: on resume from that checkpoint those steps run
    again, and each step must appear once."""
    path = self.path("metrics.jsonl")
    if not self.write or not os.path.exists(path):
      return
    with open(path) as f:
      keep = [line for line in f if line.strip() and json.loads(line)["step"] <= after_step]
    with open(path, "w") as f:
      f.writelines(keep)

  def log(self, step: int, metrics: dict[str, float]) -> None:
    if not self.write:
      return
    row = {"step": int(step), **{k: _num(v) for k, v in metrics.items()}}
    with open(self.path("metrics.jsonl"), "a") as f:
      f.write(json.dumps(row) + "\n")
    if self._tb is None:
      self._tb = EventWriter(self.path("tb"))
    self._tb.scalars(step, metrics)

  def write_summary(self, summary: dict[str, Any]) -> None:
    if self.write:
      _write_json(self.path("summary.json"), {**summary, "backend": backends.describe()})

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def logged_before(workdir: str, step: int) -> tuple[dict, dict]:
  """(the last logged row's metrics, the latest eval/* metrics) at or before `step`, from
  metrics.jsonl ({} when nothing is logged): what a resumed run's summary starts from, so that
  re-running a finished run keeps its numbers instead of writing empty ones."""
  try:
    rows = [r for r in read_metrics(workdir) if r.get("step", 0) <= step]
  except FileNotFoundError:
    return {}, {}
  last = {k: v for k, v in rows[-1].items() if k != "step"} if rows else {}
  evals = next(({k: v for k, v in r.items() if k.startswith("eval/")} for r in reversed(rows)
                if any(k.startswith("eval/") for k in r)), {})
  return last, evals


def read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def _flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
  return out


def _num(v):
  v = float(v)
  return v if math.isfinite(v) else str(v)  # JSON has no NaN; "nan" stays readable


def _write_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True, default=str)
    f.write("\n")
  os.replace(tmp, path)  # a reader never sees half a file


# ----------------------------------------------------------------------------- TensorBoard


def _crc32c_table():
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    table.append(c)
  return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  c = 0xFFFFFFFF
  for b in data:
    c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
  return c ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  c = crc32c(data)
  return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    out.append(b | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(num: int, wire: int) -> bytes:
  return _varint((num << 3) | wire)


def _bytes_field(num: int, payload: bytes) -> bytes:
  return _field(num, 2) + _varint(len(payload)) + payload


def event_bytes(wall_time: float, *, step: int | None = None, file_version: str | None = None,
                scalars: dict[str, float] | None = None) -> bytes:
  """A serialized tensorflow.Event: wall_time=1 (double), step=2 (int64), file_version=3,
  summary=5 holding Summary.value=1 of {tag=1, simple_value=2 (float)}."""
  out = _field(1, 1) + struct.pack("<d", wall_time)
  if step is not None:
    out += _field(2, 0) + _varint(step & 0xFFFFFFFFFFFFFFFF)
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  if scalars:
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5) + struct.pack("<f", v))
        for tag, v in scalars.items())
    out += _bytes_field(5, values)
  return out


def tfrecord(data: bytes) -> bytes:
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", _masked_crc(length)) + data +
          struct.pack("<I", _masked_crc(data)))


class EventWriter:
  """Appends scalar summaries to DIR/events.out.tfevents.<time>.<host>."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    self._f = open(os.path.join(logdir, name), "ab")
    self._f.write(tfrecord(event_bytes(time.time(), file_version="brain.Event:2")))
    self._f.flush()

  def scalars(self, step: int, values: dict[str, float]) -> None:
    values = {k: float(v) for k, v in values.items()}
    self._f.write(tfrecord(event_bytes(time.time(), step=int(step), scalars=values)))
    self._f.flush()

  def close(self) -> None:
    self._f.close()
