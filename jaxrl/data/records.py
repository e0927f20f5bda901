"""Record formats and their readers: JSONL, Parquet, Arrow and `datasets` save_to_disk
directories (read by jaxrl/data/files.py), and array_record files such as TFDS writes.

    sft     {"prompt": str, "completion": str}  or  {"messages": [{"role", "content"}, ...]}
    rl      {"prompt": str, "answer": str, ...}  or  {"messages": [...], "answer": str, ...}
            (the prompt's turns, ending in the user's); extra fields are kept for rewards
    prompt  what `jaxrl sample` and eval read: an rl row whose "answer" is optional, or
            {"prompt_ids": [int, ...]} (token ids, fed as they are)
    prefs   {"prompt": str, "chosen": str, "rejected": str}  or the chat variant of public
            binarized sets (UltraFeedback): "chosen"/"rejected" are message lists that end in the
            assistant's turn ("prompt" optional; the earlier turns are the prompt)
    kto     {"prompt": str, "completion": str, "label": bool}   unpaired (KTO)

Every bad row (not JSON, not an object, a field missing, of the wrong type or empty) raises a
ConfigError naming the file, the line and the field. With on_bad_row="skip" it is skipped
instead, counted, and the count is returned and logged: nothing is dropped silently.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterable

from jaxrl.data import files
from jaxrl.data.files import BadRow, check_file, text_lines  # noqa: F401 - their home was here
from jaxrl.errors import ConfigError, check_choice

log = logging.getLogger(__name__)

KINDS = ("sft", "rl", "prefs", "kto", "prompt")
ON_BAD_ROW = ("error", "skip")
ROLES = ("system", "user", "assistant", "tool")
_FIELDS = {"sft": ("prompt", "completion"), "rl": ("prompt", "answer"),
           "prefs": ("prompt", "chosen", "rejected"), "kto": ("prompt", "completion"),
           "prompt": ("prompt",)}


class Record(dict):
  """A record that remembers where it came from (`source`, e.g. "data.jsonl line 3").

  It compares equal to the plain dict with the same fields, so round trips stay simple; the
  source only lets later stages (e.g. the over-long check at tokenisation) name the line.
  """

  source: str | None = None

  def __reduce__(self):  # keep `source` across pickling (grain worker processes)
    return (_make_record, (dict(self), self.source))


def _make_record(fields: dict, source: str | None) -> Record:
  r = Record(fields)
  r.source = source
  return r


def where(record, index: int) -> str:
  """How an error names a record: its file and line when known, else its index."""
  return getattr(record, "source", None) or f"record {index}"


def _text(obj: dict, field: str, at: str) -> str:
  if field not in obj:
    raise BadRow(f"{at}: field {field!r} is missing: every row needs a non-empty {field!r} "
                 "string.")
  value = obj[field]
  if not isinstance(value, str):
    raise BadRow(f"{at}: field {field!r} is a {type(value).__name__}, not a string: write it "
                 "as a JSON string.")
  if not value.strip():
    raise BadRow(f"{at}: field {field!r} is empty: give it some text or remove the row.")
  return value


def messages_to_sft(messages: list[dict]) -> tuple[str, str]:
  """(prompt, completion) of a chat: the completion is the final assistant turn.

  One user turn (optionally after a system turn) becomes the prompt as is, so a chat record
  and a {"prompt", "completion"} record with the same text train identically. Longer chats
  render every earlier turn as "role: content" lines and end the prompt with "assistant: ".
  Only the final assistant turn is trained on.
  """
  *context, last = messages
  return context_text(context), last["content"]


def context_text(context: list[dict]) -> str:
  """The text form of a chat's turns before an assistant's answer, for tokenizers without a
  chat template: one user turn as is, a system and a user turn joined by a blank line, longer
  chats as "role: content" lines ending in "assistant: "."""
  if len(context) == 1 and context[0]["role"] == "user":
    return context[0]["content"]
  if [m["role"] for m in context] == ["system", "user"]:
    return context[0]["content"] + "\n\n" + context[1]["content"]
  lines = "".join(f"{m['role']}: {m['content']}\n" for m in context)
  return lines + "assistant: "


def _check_messages(obj: dict, at: str, *, context: bool = False) -> list[dict]:
  """The validated message list obj["messages"]: a chat ending in the assistant's turn, or
  with context=True the turns before one (ending in the user's)."""
  messages = obj["messages"]
  if not isinstance(messages, list):
    raise BadRow(f"{at}: field 'messages' is a {type(messages).__name__}, not a list of "
                 "{\"role\", \"content\"} objects.")
  if len(messages) < (1 if context else 2):
    raise BadRow(f"{at}: field 'messages' has {len(messages)} turn(s): give at least one "
                 "turn before the final assistant turn.")
  out = []
  for i, m in enumerate(messages):
    f = f"messages[{i}]"
    if not isinstance(m, dict):
      raise BadRow(f"{at}: field {f!r} is a {type(m).__name__}, not a {{\"role\", "
                   "\"content\"} object.")
    role = _text(m, "role", f"{at} {f}")
    if role not in ROLES:
      raise BadRow(f"{at}: field '{f}.role' is {role!r}: use one of {', '.join(ROLES)}.")
    out.append({"role": role, "content": _text(m, "content", f"{at} {f}")})
  if context:
    if out[-1]["role"] != "user":
      raise BadRow(f"{at}: field 'messages[{len(out) - 1}].role' is {out[-1]['role']!r}: the "
                   "prompt's last turn must be the user's.")
    return out
  if out[-1]["role"] != "assistant":
    raise BadRow(f"{at}: field 'messages[{len(out) - 1}].role' is {out[-1]['role']!r}: the "
                 "final turn must be the assistant's, since it is what is trained.")
  return out


def check_record(obj, kind: str, at: str) -> dict:
  """The record `obj` of `kind`, validated and normalised, or BadRow naming `at` and the field.

  SFT chat records are normalised to {"prompt", "completion"} (see `messages_to_sft`).
  """
  if not isinstance(obj, dict):
    raise BadRow(f"{at}: the row is a JSON {type(obj).__name__}, not an object with fields "
                 f"{', '.join(_FIELDS[kind])}.")
  if kind == "sft" and "messages" in obj:
    messages = _check_messages(obj, at)
    # The text form serves tokenizers without a chat template; a chat tokenizer renders the
    # messages with its own template (jaxrl/data/pipeline.py). A record normalised before
    # (it has both) keeps its text form.
    prompt, completion = ((obj["prompt"], obj["completion"]) if "prompt" in obj
                          else messages_to_sft(messages))
    return {"prompt": prompt, "completion": completion, "messages": messages}
  if kind == "prefs" and (isinstance(obj.get("chosen"), list) or
                          isinstance(obj.get("rejected"), list)):
    return _chat_pair(obj, at)
  if kind in ("rl", "prompt"):
    return _prompt_row(obj, kind, at)
  out = {}
  for field in _FIELDS[kind]:
    out[field] = _text(obj, field, at)
  if kind == "prefs" and "messages" in obj:  # a chat pair normalised before: its prompt turns
    out["messages"] = _check_messages(obj, at, context=True)
  if kind == "kto":
    label = obj.get("label")
    if not isinstance(label, bool):
      raise BadRow(f"{at}: field 'label' is {'missing' if 'label' not in obj else repr(label)}:"
                   " give true (a desirable completion) or false (an undesirable one).")
    out["label"] = label
  return out


def _prompt_row(obj: dict, kind: str, at: str) -> dict:
  """An RL or prompt row: every field kept (extras go on to reward functions), the prompt given
  as "prompt" text, as "messages" (the turns before the answer, ending in the user's; their
  text form becomes "prompt" unless one is given), or for kind "prompt" as "prompt_ids"."""
  out = dict(obj)
  if kind == "prompt" and "prompt_ids" in obj:
    ids = obj["prompt_ids"]
    if not (isinstance(ids, list) and ids and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
      raise BadRow(f"{at}: field 'prompt_ids' is not a non-empty list of token ids (integers "
                   ">= 0): write it like [9707, 11, 1879].")
    if "prompt" in obj:
      _text(obj, "prompt", at)
  elif "messages" in obj:
    out["messages"] = _check_messages(obj, at, context=True)
    out["prompt"] = (_text(obj, "prompt", at) if "prompt" in obj
                     else context_text(out["messages"]))
  else:
    if "prompt" not in obj:
      raise BadRow(f"{at}: field 'prompt' is missing: every row needs a non-empty 'prompt' "
                   "string or a 'messages' list of {\"role\", \"content\"} turns.")
    out["prompt"] = _text(obj, "prompt", at)
  if kind == "rl":
    out["answer"] = _text(obj, "answer", at)
  return out


def _chat_pair(obj: dict, at: str) -> dict:
  """{"prompt", "chosen", "rejected"} of a chat pair: each side is the earlier turns plus the
  final assistant turn; both sides must share those earlier turns, which become the prompt."""
  sides = {}
  for field in ("chosen", "rejected"):
    if field not in obj:
      raise BadRow(f"{at}: field {field!r} is missing: every row needs 'chosen' and "
                   "'rejected'.")
    if not isinstance(obj[field], list):
      raise BadRow(f"{at}: field {field!r} is a {type(obj[field]).__name__} while the other "
                   "side is a message list: write both as message lists or both as strings.")
    sides[field] = _check_messages({"messages": obj[field]}, f"{at} {field}")
  context = sides["chosen"][:-1]
  if sides["rejected"][:-1] != context:
    raise BadRow(f"{at}: fields 'chosen' and 'rejected' differ before their final assistant "
                 "turn: a pair must answer the same conversation.")
  prompt, chosen = messages_to_sft(sides["chosen"])
  if "prompt" in obj:
    given = _text(obj, "prompt", at)
    user = [m["content"] for m in context if m["role"] == "user"]
    if given.strip() not in (u.strip() for u in user) and given.strip() != prompt.strip():
      raise BadRow(f"{at}: field 'prompt' is not the user turn of 'chosen': drop 'prompt' or "
                   "make it match the conversation.")
  return {"prompt": prompt, "chosen": chosen, "rejected": sides["rejected"][-1]["content"],
          "messages": context}


def _collect(rows: Iterable[tuple[str, object]], kind: str, on_bad_row: str,
             name: str) -> tuple[list[dict], int]:
  check_choice("kind", kind, KINDS)
  check_choice("on_bad_row", on_bad_row, ON_BAD_ROW)
  records, skipped, first = [], 0, None
  for at, obj in rows:
    try:
      if isinstance(obj, BadRow):
        raise obj
      rec = Record(check_record(obj, kind, at))
    except BadRow as e:
      if on_bad_row == "error":
        raise ConfigError(f"{str(e).rstrip('.')} (or set on_bad_row=skip).") from None
      skipped, first = skipped + 1, first or str(e)
      continue
    rec.source = at
    records.append(rec)
  if skipped:
    log.warning("%s: skipped %d bad row(s) of %d; the first: %s", name, skipped,
                skipped + len(records), first)
  return records, skipped


def read_jsonl(path: str, kind: str, *, on_bad_row: str = "error",
               fields: dict[str, str] | None = None) -> tuple[list[dict], int]:
  """(records, skipped) of a JSONL file of `kind` ("sft", "rl", "prefs" or "kto").

  Each record remembers its file and line (see `Record`). Bad rows raise ConfigError naming
  the file, the line and the field, or with on_bad_row="skip" are skipped and counted.
  `fields` renames keys, e.g. {"question": "prompt"} (data.fields).
  """
  fields = files.check_fields(fields)
  check_file(path)
  return _collect(((at, files.rename(obj, fields, at)) for at, obj in files.json_rows(path)),
                  kind, on_bad_row, path)


def write_jsonl(path: str, records: Iterable[dict]) -> int:
  """Writes one JSON object per line (UTF-8, not ASCII-escaped); returns the count."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  n = 0
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(dict(r), ensure_ascii=False) + "\n")
      n += 1
  return n


# ----------------------------------------------------------------------------- array_record


def _varint(buf: bytes, i: int) -> tuple[int, int]:
  shift = value = 0
  while True:
    b = buf[i]
    i += 1
    value |= (b & 0x7F) << shift
    if b < 0x80:
      return value, i
    shift += 7


def _fields(buf: bytes):
  """(field number, wire type, value) of a protobuf message, by the wire format alone."""
  i = 0
  while i < len(buf):
    key, i = _varint(buf, i)
    num, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _varint(buf, i)
    elif wire == 2:
      size, i = _varint(buf, i)
      value, i = buf[i:i + size], i + size
    elif wire == 5:
      value, i = buf[i:i + 4], i + 4
    elif wire == 1:
      value, i = buf[i:i + 8], i + 8
    else:
      raise ValueError(f"unsupported protobuf wire type {wire}")
    if i > len(buf):
      raise ValueError("truncated protobuf message")
    yield num, wire, value


def parse_example(buf: bytes) -> dict:
  """A serialized tf.train.Example as {name: value}, without TensorFlow.

  Example = {1: Features}; Features = {1: map<string, Feature>}; Feature is one of
  bytes_list (1), float_list (2), int64_list (3), each {1: repeated value}. A one-element
  bytes list becomes a str (UTF-8), which is how TFDS stores text features; longer lists stay
  lists. Float and int64 features are decoded too, so RL records pass them on as extras.
  """
  import struct
  out = {}
  for num, _, features in _fields(buf):
    if num != 1:
      continue
    for fnum, _, entry in _fields(features):
      if fnum != 1:
        continue
      name, feature = None, b""
      for enum, _, v in _fields(entry):
        if enum == 1:
          name = v.decode("utf-8")
        elif enum == 2:
          feature = v
      values = []
      for kind_num, _, lst in _fields(feature):
        for vnum, wire, v in _fields(lst):
          if vnum != 1:
            continue
          if kind_num == 1:
            values.append(v.decode("utf-8", errors="replace"))
          elif kind_num == 2:
            values += ([struct.unpack("<f", v)[0]] if wire == 5 else
                       list(struct.unpack(f"<{len(v) // 4}f", v)))
          elif kind_num == 3:
            if wire == 0:
              values.append(v - (1 << 64) if v >= 1 << 63 else v)
            else:  # packed int64s
              j = 0
              while j < len(v):
                x, j = _varint(v, j)
                values.append(x - (1 << 64) if x >= 1 << 63 else x)
      out[name] = values[0] if len(values) == 1 else values
  return out


def decode_record(raw: bytes):
  """A record's bytes as a dict: a JSON object, else a serialized tf.train.Example."""
  stripped = raw.lstrip()
  if stripped[:1] == b"{":
    return json.loads(raw.decode("utf-8"))
  return parse_example(raw)


def array_record_paths(path: str) -> list[str]:
  """The array_record files behind `path`: a file, a glob, or a TFDS directory (and split)."""
  if os.path.isdir(path):
    found = sorted(glob.glob(os.path.join(path, "*.array_record*")))
  elif os.path.isfile(path):
    found = [path]
  else:
    found = sorted(glob.glob(path))
  if not found:
    raise ConfigError(f"no array_record files at {path!r}: give a file, a glob, or a TFDS "
                      "dataset directory holding *.array_record-* files.")
  return found


def read_array_record(path: str, kind: str, *, on_bad_row: str = "error",
                      fields: dict[str, str] | None = None) -> tuple[list[dict], int]:
  """(records, skipped) of array_record files (e.g. a TFDS dataset built as array_record).

  `path` is a file, a glob (e.g. ".../gsm8k-train.array_record*") or a directory. Each record
  is a JSON object or a tf.train.Example, read with grain's ArrayRecordDataSource; no
  TensorFlow is needed. `fields` renames dataset features to record fields, e.g.
  {"question": "prompt", "answer": "answer"}. Errors name the file and the record index.
  """
  from grain.sources import ArrayRecordDataSource
  files = array_record_paths(path)
  source = ArrayRecordDataSource(files)
  # The data source numbers records across files; errors name the file and its own index.
  bounds, total = [], 0
  for f in files:
    n = len(ArrayRecordDataSource([f]))
    bounds.append((total, total + n, f))
    total += n

  def rows():
    for lo, hi, f in bounds:
      for i in range(lo, hi):
        at = f"{f} record {i - lo}"
        try:
          obj = decode_record(source[i])
        except (ValueError, UnicodeDecodeError, IndexError) as e:
          yield at, BadRow(f"{at}: the record is neither a JSON object nor a tf.train.Example "
                           f"({e}).")
          continue
        if fields and isinstance(obj, dict):
          obj = {fields.get(k, k): v for k, v in obj.items()}
        yield at, obj

  return _collect(rows(), kind, on_bad_row, path)


def read_records(path: str, kind: str, *, on_bad_row: str = "error",
                 fields: dict[str, str] | None = None) -> tuple[list[dict], int]:
  """(records, skipped) of the data at `path`, every trainer's reader: JSONL, Parquet, Arrow or
  a `datasets` save_to_disk directory (jaxrl/data/files.py), else array_record files (a file
  with array_record in its name, a glob, or a TFDS directory). `fields` renames source columns
  to record fields (data.fields), e.g. {"question": "prompt"}."""
  fields = files.check_fields(fields)
  if files.file_format(path) is not None:
    return _collect(files.rows(path, fields), kind, on_bad_row, path)
  if ("array_record" in os.path.basename(path) or any(c in path for c in "*?[")
      or (os.path.isdir(path) and glob.glob(os.path.join(path, "*.array_record*")))):
    return read_array_record(path, kind, on_bad_row=on_bad_row, fields=fields)
  if not os.path.exists(path):
    check_file(path, give=files.ANY_DATA)
  raise files.unknown_format(path)
