"""The run directory every command writes (docs/design.md):

    DIR/run.json         the run's owner: the command and the model signature (see claim())
    DIR/config.json      the resolved config, and under "backend" what the process runs on
    DIR/config.prev.json the config.json a resume with a changed config replaced
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
from jaxrl.errors import ConfigError


def _read_json(workdir: str, name: str) -> dict | None:
  """DIR/name as a dict; None when DIR has none."""
  try:
    with open(os.path.join(workdir, name)) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def read_config(workdir: str) -> dict | None:
  """The resolved config a run wrote to DIR/config.json, as a dict; None when DIR has none."""
  return _read_json(workdir, "config.json")


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
      # A resume on another device count is a supported move (the demo resumes a 1-device
      # SFT on 8), recorded in config.json but not a config change worth a note.
      changed = [k for k in sorted(set(flat_old) | set(flat_new))
                 if flat_old.get(k) != flat_new.get(k) and k != "backend.devices"]
      if changed:
        out("note: the config differs from the one in config.json: " + ", ".join(
            f"{k}: {flat_old.get(k)!r} -> {flat_new.get(k)!r}" for k in changed))
    if self.write:
      _write_json(self.path("config.json"), {**config.to_dict(), "backend": backend})

  def read_config(self) -> dict | None:
    return read_config(self.workdir)

  def truncate_metrics(self, after_step: int) -> None:
    """Keeps only the metrics logged up to `after_step` (none when it is negative): on resume
    from that checkpoint the later steps run again, and each step must appear once. A line
    torn by a kill mid-write is dropped with them. Rewritten beside and renamed, so a kill
    here loses nothing."""
    path = self.path("metrics.jsonl")
    if not self.write or not os.path.exists(path):
      return
    keep = [r for r in _read_rows(path) if r.get("step", 0) <= after_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in keep)
    os.replace(tmp, path)

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


# ----------------------------------------------------------------------------- ownership
#
# DIR/run.json says which command wrote DIR and for which model: {"command": "sft", "model":
# {ModelConfig fields}, "params": {"layers.0.attn.q": [[D, N, H], "float32"], ...}}. A resume
# checks both before anything in DIR is written, so a DPO run cannot take over an SFT run's dir
# and a changed architecture never reaches orbax's restore.


def read_run(workdir: str) -> dict | None:
  """DIR/run.json as a dict; None when DIR has none."""
  return _read_json(workdir, "run.json")


def infer_command(config: dict) -> str | None:
  """The trainer a config.json was written by, from the sections only that trainer has; None
  when the sections do not say (a config.json from before run.json existed)."""
  for section, command in (("critic", "ppo"), ("rollout", "grpo"), ("ref", "dpo"),
                           ("head", "rm"), ("sampling", "sample")):
    if section in config:
      return command
  if "data" in config and "train" in config and "init" not in config:
    return "sft"
  return None


def checkpoint_steps(workdir: str) -> list[int]:
  """The committed checkpoint steps in DIR/checkpoints (orbax names each step's directory by
  its number; one still being written carries a suffix and is not counted)."""
  try:
    names = os.listdir(os.path.join(workdir, "checkpoints"))
  except (FileNotFoundError, NotADirectoryError):
    return []
  return sorted(int(n) for n in names if n.isdigit())


def check_owner(workdir: str, *, command: str, model: dict | None = None,
                params: dict | None = None, steps: int | None = None) -> None:
  """Raises the one-sentence ConfigError when DIR belongs to another command or model, or holds
  a checkpoint past `steps`; reads DIR and writes nothing. `model` is the ModelConfig as a dict
  and `params` the model signature ({path: [shape, dtype]}) of this run; without them only the
  command is checked."""
  run = read_run(workdir)
  if run is None:
    old = read_config(workdir) if os.path.isfile(os.path.join(workdir, "config.json")) else None
    if old is None:
      run = {}
    else:  # written before run.json existed: what its config.json says, where it says it
      run = {"command": infer_command(old)}
      sig = _legacy_signature(old)
      if sig is not None:
        run.update(sig)
  was = run.get("command")
  if was and was != command:
    raise ConfigError(f"{workdir} was written by `jaxrl {was}`, not `jaxrl {command}`: use a "
                      "new --workdir.")
  old_params = run.get("params")
  if params is not None and old_params is not None and old_params != params:
    old_model = run.get("model") or {}
    model = model or {}
    for k in [k for k in _SHAPING if k in model] + [k for k in model if k not in _SHAPING]:
      v = model[k]
      if k in old_model and json.dumps(old_model[k]) != json.dumps(v, default=str):
        raise ConfigError(f"model.{k} is {old_model[k]!r} in {workdir}'s run, {v!r} now: drop "
                          "the override or use a new --workdir.")
    for k in sorted(set(old_params) | set(params)):
      a, b = old_params.get(k), params.get(k)
      if a != b:
        raise ConfigError(f"parameter {k} is {_sig_text(a)} in {workdir}'s run, {_sig_text(b)} "
                          "now: use the model that run trained, or a new --workdir.")
  done = checkpoint_steps(workdir)
  if steps is not None and done and done[-1] > steps:
    raise ConfigError(f"train.steps={steps} is below step {done[-1]} of the latest checkpoint in "
                      f"{workdir}: pass --config.train.steps={done[-1]} or more, or use a new "
                      "--workdir.")


# The ModelConfig fields that shape the parameters, named first when a model differs.
_SHAPING = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "mlp_dim", "qkv_bias", "qk_norm", "tie_embeddings", "param_dtype")


def write_run(workdir: str, record: dict) -> None:
  """Writes DIR/run.json, keeping fields an earlier write added (e.g. a data fingerprint)."""
  old = read_run(workdir) or {}
  _write_json(os.path.join(workdir, "run.json"), {**old, **record})


def model_signature(cfg) -> tuple[dict, dict]:
  """(the ModelConfig as a JSON dict, {param path: [shape, dtype]}) of the policy model."""
  import dataclasses

  import jax

  from jaxrl.models.llama import abstract_model
  _, shapes, _ = abstract_model(cfg)
  params = {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path):
            [list(x.shape), str(x.dtype)]
            for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]}
  return json.loads(json.dumps(dataclasses.asdict(cfg), default=str)), params


def _legacy_signature(old: dict) -> dict | None:
  """The model signature of an old config.json's model section; None when it cannot be built
  (e.g. its model.hf_path is gone)."""
  try:
    import ml_collections

    from jaxrl import config as config_lib
    cfg = config_lib.model_config(ml_collections.ConfigDict(old))
  except Exception:  # an unreadable old section is no reason to refuse the dir
    return None
  model, params = model_signature(cfg)
  return {"model": model, "params": params}


def _sig_text(sig) -> str:
  return "absent" if sig is None else f"{sig[1]} {sig[0]}"


def backup_config(workdir: str, config) -> bool:
  """Copies DIR/config.json to DIR/config.prev.json when `config` differs from it (the backend
  aside), so a resume with overrides keeps what it replaced. True when it did."""
  old = read_config(workdir)
  if old is None:
    return False
  flat_old = {k: v for k, v in _flatten(old).items() if not k.startswith("backend.")}
  flat_new = _flatten(json.loads(json.dumps(config.to_dict(), default=str)))
  if flat_old == flat_new:
    return False
  import shutil
  shutil.copyfile(os.path.join(workdir, "config.json"), os.path.join(workdir, "config.prev.json"))
  return True


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
  """metrics.jsonl's rows, without a last line torn by a kill mid-write."""
  return _read_rows(os.path.join(workdir, "metrics.jsonl"))


def _read_rows(path: str) -> list[dict]:
  rows = []
  with open(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        pass  # blank, or torn by a kill while it was written (that step is logged again)
  return rows


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
