"""Data files on disk, read into plain rows: JSONL, Parquet, Arrow, and Hugging Face `datasets`
directories written by `save_to_disk`. Parquet and Arrow are read with pyarrow; the `datasets`
package is not needed, and nothing is downloaded.

    read_records(path, fields=None)  every row as a dict, or one ConfigError naming the file,
                                     the row and the field
    rows(path, fields=None)          (where, row) pairs, a bad row as a BadRow in its place (the
                                     record readers in records.py count or raise those)
    file_format(path)                "jsonl" | "parquet" | "arrow" | "saved", or None
    write_gsm8k_fixture(dir)         a tiny GSM8K-format Parquet data set (train and test)

What each path may be:

    *.jsonl, *.json   one JSON object per line (blank lines are layout)
    *.parquet         one Parquet file, e.g. GSM8K's main/train-00000-of-00001.parquet
    *.arrow           one Arrow IPC file, stream or file format
    a directory       one split saved by datasets' Dataset.save_to_disk: state.json,
                      dataset_info.json and data-*.arrow files (Arrow IPC streams). A
                      DatasetDict's top directory holds one such directory per split: give one.

`fields` maps source columns to jaxrl's field names, e.g. {"question": "prompt"} for GSM8K
(config: data.fields). Columns it does not name keep their names, so extras (a "level", a
"solution") reach the reward functions. Rows of a table are named as "FILE row I", I counted
from 0 as `dataset[I]` counts them; JSONL rows by their line, from 1 as editors do. A null cell is
a missing field.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Mapping

from jaxrl.errors import ConfigError

FORMATS = ("jsonl", "parquet", "arrow", "saved")
_WHAT = {"jsonl": "a JSONL file", "parquet": "a Parquet file", "arrow": "an Arrow file",
         "saved": "a directory saved with datasets' save_to_disk"}
ANY_DATA = "a .jsonl, .parquet or .arrow file, a save_to_disk directory or array_record files"
_SAVED_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")
_BATCH_ROWS = 1024


class BadRow(ConfigError):
  """A bad row; the reader turns it into an error or a counted skip."""


def file_format(path: str) -> str | None:
  """The format `path` names, by its extension (or, for a directory, by what save_to_disk puts
  in one); None for anything else (array_record files, globs, unknown extensions)."""
  if path.endswith((".jsonl", ".json")):
    return "jsonl"
  if path.endswith(".parquet"):
    return "parquet"
  if path.endswith(".arrow"):
    return "arrow"
  if os.path.isdir(path) and (any(os.path.isfile(os.path.join(path, m)) for m in _SAVED_MARKERS)
                              or glob.glob(os.path.join(path, "data-*.arrow"))):
    return "saved"
  return None


def unknown_format(path: str) -> ConfigError:
  """The one sentence for a path that is none of the formats jaxrl reads."""
  ext = os.path.splitext(path)[1]
  shape = (f"is a directory without datasets' save_to_disk files (state.json, data-*.arrow) "
           f"or array_record files" if os.path.isdir(path) else
           f"has the extension {ext!r}, which jaxrl does not read" if ext else
           "has no extension jaxrl knows")
  return ConfigError(f"data file {path!r} {shape}: give a .jsonl, .parquet or .arrow file, a "
                     "directory saved with datasets' save_to_disk, or array_record files.")


def check_file(path: str, what: str = "data file", *, give: str = "a JSONL file") -> None:
  """A path that must name a readable file: one sentence when it is missing or a directory."""
  if os.path.isdir(path):
    raise ConfigError(f"{what} {path!r} is a directory, not a file: give the path of {give} "
                      "(e.g. one inside it).")
  if not os.path.isfile(path):
    raise ConfigError(f"{what} {path!r} does not exist: give the path of {give}.")


def check_fields(fields) -> dict[str, str]:
  """data.fields as a plain {source column: jaxrl field} dict ({} when empty), or one sentence
  saying what is wrong with it."""
  if not fields:
    return {}
  if hasattr(fields, "to_dict"):  # an ml_collections ConfigDict
    fields = fields.to_dict()
  example = "e.g. {'question': 'prompt'}"
  if not isinstance(fields, Mapping):
    raise ConfigError(f"data.fields={fields!r} is not a mapping: give source column -> jaxrl "
                      f"field, {example}.")
  for src, dst in fields.items():
    if not (isinstance(src, str) and isinstance(dst, str) and src and dst):
      raise ConfigError(f"data.fields entry {src!r}: {dst!r} is not a pair of names: give source "
                        f"column -> jaxrl field, {example}.")
  targets = list(fields.values())
  twice = sorted({t for t in targets if targets.count(t) > 1})
  if twice:
    raise ConfigError(f"data.fields maps two columns to {twice[0]!r}: keep one of them.")
  return dict(fields)


def rename(obj, fields: dict[str, str], at: str):
  """The row `obj` with its `fields` columns renamed, or a BadRow when a column is missing or a
  renamed one would overwrite a column of the same name."""
  if not fields or not isinstance(obj, dict):
    return obj
  out = {k: v for k, v in obj.items() if k not in fields}
  for src, dst in fields.items():
    if src not in obj:
      return BadRow(f"{at}: field {src!r} is missing (data.fields maps it to {dst!r}): give "
                    "every row one, or change data.fields.")
    if dst in out:
      return BadRow(f"{at}: field {dst!r} is there already and data.fields maps {src!r} to it "
                    "too: drop one of them.")
    out[dst] = obj[src]
  return out


# ----------------------------------------------------------------------------- JSONL


def text_lines(path: str):
  """(line number, text) of a UTF-8 text file, blank lines included. A byte-order mark is
  dropped (some editors write one; it is harmless); bytes that are not UTF-8 fail with one
  sentence naming the line, rather than a UnicodeDecodeError from the middle of a read."""
  with open(path, "rb") as f:
    for n, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
      except UnicodeDecodeError as e:
        raise ConfigError(f"{path} line {n} is not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                          f"byte {e.start + 1} of the line): save it as UTF-8.") from None
      yield n, line


def json_rows(path: str):
  """(where, object or BadRow) of each non-blank line of a JSONL file."""
  lines = 0
  for n, line in text_lines(path):
    if not line.strip():
      continue  # blank lines (a trailing newline, a gap) are layout, not rows
    lines += 1
    at = f"{path} line {n}"
    try:
      yield at, json.loads(line)
    except json.JSONDecodeError as e:
      yield at, BadRow(f"{at}: the row is not valid JSON ({e.msg} at column {e.colno}): "
                       "write one JSON object per line.")
  if not lines:
    raise ConfigError(f"data file {path} is empty: write one JSON object per line into it.")


# ----------------------------------------------------------------------------- Parquet, Arrow


def _unreadable(path: str, fmt: str, e: Exception) -> ConfigError:
  reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
  return ConfigError(f"{path} is not a readable {fmt} file (pyarrow: {reason}): check that it "
                     f"is one and is complete.")


class _Batches:
  """A file's schema and its record batches, read lazily."""

  def __init__(self, schema, batches):
    self.schema, self._batches = schema, batches

  def __iter__(self):
    return self._batches()


def _ipc_reader(path: str) -> _Batches:
  """The Arrow IPC file at `path`, in the file format (random access) or the stream format,
  which save_to_disk writes."""
  import pyarrow as pa
  try:
    r = pa.ipc.open_file(pa.memory_map(path))
    return _Batches(r.schema, lambda: (r.get_batch(i) for i in range(r.num_record_batches)))
  except pa.ArrowInvalid:
    r = pa.ipc.open_stream(pa.memory_map(path))
    return _Batches(r.schema, lambda: iter(r))


def _saved_files(path: str) -> list[str]:
  """The data-*.arrow files of a save_to_disk directory, in state.json's order."""
  if os.path.isfile(os.path.join(path, "dataset_dict.json")):
    splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    example = os.path.join(path, splits[0] if splits else "train")
    raise ConfigError(f"{path} holds a DatasetDict (splits {', '.join(splits) or 'none'}): give "
                      f"one split's directory, e.g. {example}.")
  state = os.path.join(path, "state.json")
  if os.path.isfile(state):
    try:
      with open(state, encoding="utf-8") as f:
        names = [d["filename"] for d in json.load(f)["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
      raise ConfigError(f"{state} is not a datasets state.json with a _data_files list "
                        f"({type(e).__name__}: {e}): save the dataset again.") from None
    files = [os.path.join(path, n) for n in names]
  else:
    files = sorted(glob.glob(os.path.join(path, "data-*.arrow")))
  if not files:
    raise ConfigError(f"{path} has no data-*.arrow files: give a directory written by "
                      "Dataset.save_to_disk.")
  for f in files:
    check_file(f, "data file", give="the Arrow file state.json lists (save the dataset again)")
  return files


def _tables(path: str, fmt: str) -> Iterator[tuple[str, object]]:
  """(file, _Batches) of each file behind `path`."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  if fmt == "saved":
    for f in _saved_files(path):
      try:
        yield f, _ipc_reader(f)
      except (pa.ArrowException, OSError) as e:
        raise _unreadable(f, "Arrow", e) from None
    return
  check_file(path, give=_WHAT[fmt])
  try:
    if fmt == "parquet":
      pf = pq.ParquetFile(path)
      yield path, _Batches(pf.schema_arrow, lambda: pf.iter_batches(batch_size=_BATCH_ROWS))
    else:
      yield path, _ipc_reader(path)
  except (pa.ArrowException, OSError) as e:
    raise _unreadable(path, "Parquet" if fmt == "parquet" else "Arrow", e) from None


def _check_columns(path: str, names: list[str], fields: dict[str, str]) -> None:
  for src, dst in fields.items():
    if src not in names:
      raise ConfigError(f"{path}: column {src!r}, which data.fields maps to {dst!r}, is not "
                        f"there: its columns are {', '.join(names)}.")
    if dst in names and dst not in fields:
      raise ConfigError(f"{path}: column {dst!r} is there already and data.fields maps {src!r} "
                        "to it too: drop one of them from data.fields.")


def table_rows(path: str, fmt: str, fields: dict[str, str] | None = None):
  """(where, row or BadRow) of a Parquet or Arrow file, or of a save_to_disk directory (its row
  numbers run on across its files, as the dataset's do)."""
  import pyarrow as pa
  fields = fields or {}
  i = 0
  for f, reader in _tables(path, fmt):
    _check_columns(f, list(reader.schema.names), fields)
    try:
      for batch in reader:
        for row in batch.to_pylist():
          at = f"{path} row {i}"
          i += 1
          yield at, rename({k: v for k, v in row.items() if v is not None}, fields, at)
    except (pa.ArrowException, OSError) as e:
      raise _unreadable(f, "Parquet" if fmt == "parquet" else "Arrow", e) from None
  if not i:
    raise ConfigError(f"data file {path} has no rows: give one with at least one record.")


# ----------------------------------------------------------------------------- one entry point


def rows(path: str, fields=None):
  """(where, row or BadRow) of the data at `path`, any format file_format knows, with `fields`
  renamed; file-level problems (missing, unreadable, empty, unknown format) raise at once."""
  fields = check_fields(fields)
  if not os.path.exists(path):
    check_file(path, give=ANY_DATA)
  fmt = file_format(path)
  if fmt is None:
    raise unknown_format(path)
  if fmt == "jsonl":
    check_file(path)
    return ((at, rename(obj, fields, at)) for at, obj in json_rows(path))
  return table_rows(path, fmt, fields)


def read_records(path: str, fields=None) -> list[dict]:
  """Every row of the data at `path` as a dict (columns renamed by `fields`), or one ConfigError
  naming the file, the row and the field. Rows are not checked against a record kind: the
  trainers' readers (jaxrl.data.records.read_records) do that."""
  out = []
  for at, obj in rows(path, fields):
    if isinstance(obj, BadRow):
      raise ConfigError(str(obj))
    if not isinstance(obj, dict):
      raise ConfigError(f"{at}: the row is a JSON {type(obj).__name__}, not an object: write "
                        "one JSON object per line.")
    out.append(obj)
  return out


# ----------------------------------------------------------------------------- a fixture


def write_gsm8k_fixture(directory: str, *, n_train: int = 512, n_test: int = 64, seed: int = 0,
                        max_operand: int = 30) -> dict[str, str]:
  """Writes a tiny GSM8K-format data set, train.parquet and test.parquet in `directory`, and
  returns their paths by split.

  Rows are {"question": "What is 12 + 7?", "answer": "12 + 7 = 19\\n#### 19"}: GSM8K's columns
  and its "rationale, then #### N" answer, on sums a tiny model can learn. Deterministic in
  `seed`; the two splits share no question. Used by the tests and the GSM8K recipe
  (configs/gsm8k_qwen3.py), which maps question -> prompt with data.fields.
  """
  import numpy as np
  import pyarrow as pa
  import pyarrow.parquet as pq
  pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
  if n_train + n_test > len(pairs):
    raise ConfigError(f"n_train + n_test = {n_train + n_test} is more than the "
                      f"{len(pairs)} distinct sums up to {max_operand}: raise max_operand.")
  order = np.random.default_rng(seed).permutation(len(pairs))
  os.makedirs(directory, exist_ok=True)
  out = {}
  for split, idx in (("train", order[:n_train]), ("test", order[n_train:n_train + n_test])):
    qs = [f"What is {pairs[i][0]} + {pairs[i][1]}?" for i in idx]
    ans = [f"{pairs[i][0]} + {pairs[i][1]} = {sum(pairs[i])}\n#### {sum(pairs[i])}" for i in idx]
    out[split] = os.path.join(directory, f"{split}.parquet")
    pq.write_table(pa.table({"question": qs, "answer": ans}), out[split])
  return out
