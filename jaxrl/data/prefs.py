"""Preference data: pairs for reward models and the DPO family, unpaired labels for KTO.

    read_prefs(path)        {"prompt", "chosen", "rejected"} JSONL (or UltraFeedback-style chat)
    clean_prefs(records)    exact and normalised de-duplication, n-gram decontamination
    fingerprint(records)    a content hash, recorded in the run dir: which data a run saw
    task_prefs(task, ...)   pairs from a built-in task, optionally from a biased labeller
    prefs_batches(...)      [B, 2, S] batches: axis 1 is (chosen, rejected)
    read_kto / kto_batches  {"prompt", "completion", "label"} rows and [B, S] batches + label

A pair's two rows are laid out exactly like SFT rows (jaxrl/data/pipeline.py): bos + prompt +
response + eos, inputs = seq[:-1], targets = seq[1:], loss_mask on the response and the eos.
Keeping the pair on one row of the batch puts both sides on the same device when the batch is
sharded over its first axis; a trainer reshapes [B, 2, S] to [2B, S] for one forward.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Sequence

import grain
import numpy as np

from jaxrl.data.pipeline import (check_length, encode_turn, epochs, example, pad_to, prepare,
                                 shard_indices)
from jaxrl.data.records import read_records
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.errors import ConfigError, check_choice
from jaxrl.tasks import Task, get_task

BIASES = ("none", "longer")
SIDES = ("chosen", "rejected")


def read_prefs(path: str, *, on_bad_row: str = "error",
               fields: dict[str, str] | None = None) -> tuple[list[dict], int]:
  """(records, skipped) of a preference file: JSONL, Parquet, Arrow, a save_to_disk directory
  or array_record (e.g. a TFDS build), columns renamed by `fields` (data.fields)."""
  return read_records(path, "prefs", on_bad_row=on_bad_row, fields=fields)


def read_kto(path: str, *, on_bad_row: str = "error",
             fields: dict[str, str] | None = None) -> tuple[list[dict], int]:
  """(records, skipped) of an unpaired KTO file: {"prompt", "completion", "label": bool}."""
  return read_records(path, "kto", on_bad_row=on_bad_row, fields=fields)


# ----------------------------------------------------------------------------- cleaning


def normalize_text(text: str) -> str:
  """The form duplicates are compared in: case-folded, whitespace collapsed, a trailing
  period dropped. Digits and symbols stay (in "12+34=" they are the content)."""
  return re.sub(r"\s+", " ", text.casefold()).strip().removesuffix(".").rstrip()


def _words(text: str) -> list[str]:
  return re.findall(r"\w+|[^\w\s]", normalize_text(text))


def _ngrams(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
  return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def clean_prefs(records: Sequence[dict], *, eval_prompts: Iterable[str] = (),
                ngram: int = 8) -> tuple[list[dict], dict[str, int]]:
  """(kept records, report) after de-duplication and decontamination, in the input's order.

  Removed, and counted in the report:
    duplicates_exact       the same (prompt, chosen, rejected) as an earlier pair;
    duplicates_normalized  the same after `normalize_text` (case, spacing, final period);
    ties                   chosen and rejected equal after normalisation: no preference;
    contaminated           the prompt shares an n-gram of words with an eval prompt. An eval
                           prompt shorter than `ngram` words is matched as a whole (so short
                           prompts, like a task's "12+34=", are still caught).
  """
  if not isinstance(ngram, int) or ngram < 1:
    raise ConfigError(f"ngram={ngram!r} is not valid: give a positive number of words.")
  by_len: dict[int, set[tuple[str, ...]]] = {}
  for p in eval_prompts:
    w = _words(p)
    if w:
      n = min(ngram, len(w))
      by_len.setdefault(n, set()).update(_ngrams(w, n))
  seen_exact, seen_norm = set(), set()
  report = dict(read=len(records), duplicates_exact=0, duplicates_normalized=0, ties=0,
                contaminated=0, kept=0)
  kept = []
  for r in records:
    key = (r["prompt"], r["chosen"], r["rejected"])
    if key in seen_exact:
      report["duplicates_exact"] += 1
      continue
    seen_exact.add(key)
    norm = tuple(normalize_text(k) for k in key)
    if norm in seen_norm:
      report["duplicates_normalized"] += 1
      continue
    seen_norm.add(norm)
    if norm[1] == norm[2]:
      report["ties"] += 1
      continue
    w = _words(r["prompt"])
    if any(_ngrams(w, n) & grams for n, grams in by_len.items()):
      report["contaminated"] += 1
      continue
    kept.append(r)
  report["kept"] = len(kept)
  return kept, report


def fingerprint(records: Iterable[dict]) -> str:
  """sha256 of the records' content in order: the same data gives the same fingerprint on
  any machine (the record's file and line are not part of it)."""
  h = hashlib.sha256()
  for r in records:
    h.update(json.dumps(dict(r), sort_keys=True, ensure_ascii=False).encode())
    h.update(b"\n")
  return "sha256:" + h.hexdigest()


# ----------------------------------------------------------------------------- built-in pairs


def task_prefs(task, split: str, n: int, seed: int, *, bias: str = "none",
               bias_rate: float = 1.0) -> list[dict]:
  """`n` preference pairs from a built-in task (a Task or a name like "addition").

  Honest pairs: chosen = the correct answer, rejected = a plausible wrong one (the task's own
  corruption). bias="longer" models a labeller who prefers the longer answer regardless of
  correctness: for a fraction `bias_rate` of the pairs, chosen = a wrong answer made longer
  (the correct answer with 1-3 characters appended) and rejected = the correct answer. A
  reward model trained on those pairs learns length, not correctness: a proxy to hack.
  """
  task = task if isinstance(task, Task) else get_task(task)
  check_choice("bias", bias, BIASES)
  if not 0.0 <= bias_rate <= 1.0:
    raise ConfigError(f"bias_rate={bias_rate!r} is not valid: give a fraction in [0, 1].")
  pairs = task.records(split, n, seed)
  rng = np.random.default_rng([int(seed), 104729, zlib.crc32(task.name.encode())])
  biased = (set(rng.choice(n, size=round(bias_rate * n), replace=False).tolist())
            if bias != "none" and n else set())
  out = []
  for i, r in enumerate(pairs):
    prompt, answer = r["prompt"], r["answer"]
    if i in biased:
      tail = "".join(rng.choice(list(_tail_alphabet(answer)), size=int(rng.integers(1, 4))))
      out.append({"prompt": prompt, "chosen": answer + tail, "rejected": answer})
    else:
      out.append({"prompt": prompt, "chosen": answer,
                  "rejected": task.corrupt(rng, prompt, answer)})
  return out


def _tail_alphabet(answer: str) -> str:
  """Characters a longer wrong answer is padded with: digits for numbers, else letters."""
  return "0123456789" if answer.isdigit() else "abcdefghijklmnopqrstuvwxyz"


# ----------------------------------------------------------------------------- batches


def tokenize_pair(record: dict, tokenizer: Tokenizer, data_cfg=None) -> dict[str, np.ndarray]:
  """Both sides of a pair as SFT examples (unpadded), keyed "chosen" and "rejected", rendered
  as encode_turn says (chat-templated by default when the tokenizer has a template)."""
  context = record.get("messages")
  return {side: example(*encode_turn(record["prompt"], record[side], tokenizer, context,
                                     data_cfg))
          for side in SIDES}


def _iterator(examples: list, skipped: int, pad, *, kind: str, batch_size: int, seed: int,
              shuffle: bool, num_epochs: int | None, shard_index: int,
              shard_count: int, read: int) -> grain.DatasetIterator:
  if not examples:
    raise ConfigError(f"shard {shard_index} of {shard_count} has no usable {kind} rows "
                      f"({read} read, {skipped} skipped): give more data or fewer shards.")
  it = epochs(examples, seed=seed, shuffle=shuffle, num_epochs=num_epochs).map(pad)
  it = iter(it.batch(batch_size, drop_remainder=True))
  it.skipped = skipped
  return it


def prefs_batches(records: Sequence[dict], tokenizer: Tokenizer, *, seq_len: int,
                  batch_size: int, seed: int, shuffle: bool = True,
                  num_epochs: int | None = None, shard_index: int = 0, shard_count: int = 1,
                  on_bad_row: str = "error", data_cfg=None) -> grain.DatasetIterator:
  """A checkpointable iterator of pair batches: dicts of numpy arrays [batch_size, 2, seq_len]
  (inputs, targets, loss_mask, positions, segment_ids), axis 1 = (chosen, rejected).

  Arguments as `sft_batches`: batch_size is this process's local batch; shard `shard_index`
  of `shard_count` reads records with index % shard_count == shard_index; a bad or over-long
  pair raises ConfigError naming its file, line and side, or is skipped and counted.
  """
  indices = shard_indices(len(records), seq_len=seq_len, batch_size=batch_size,
                          num_epochs=num_epochs, shard_index=shard_index,
                          shard_count=shard_count)
  def encode(r, at):
    ex = tokenize_pair(r, tokenizer, data_cfg)
    for side in SIDES:
      check_length(ex[side], seq_len, at, side)
    return ex

  examples, skipped = prepare(records, indices, kind="prefs", encode=encode,
                              on_bad_row=on_bad_row)
  pad = pad_to(seq_len)

  def pad_pair(ex):
    rows = [pad(ex[side]) for side in SIDES]
    return {k: np.stack([row[k] for row in rows]) for k in rows[0]}

  return _iterator(examples, skipped, pad_pair, kind="prefs", batch_size=batch_size,
                   seed=seed, shuffle=shuffle, num_epochs=num_epochs, shard_index=shard_index,
                   shard_count=shard_count, read=len(indices))


def kto_batches(records: Sequence[dict], tokenizer: Tokenizer, *, seq_len: int,
                batch_size: int, seed: int, shuffle: bool = True,
                num_epochs: int | None = None, shard_index: int = 0, shard_count: int = 1,
                on_bad_row: str = "error", data_cfg=None) -> grain.DatasetIterator:
  """A checkpointable iterator of KTO batches: SFT rows [batch_size, seq_len] plus "label"
  [batch_size] float32 (1.0 desirable, 0.0 undesirable). Arguments as `prefs_batches`."""
  indices = shard_indices(len(records), seq_len=seq_len, batch_size=batch_size,
                          num_epochs=num_epochs, shard_index=shard_index,
                          shard_count=shard_count)

  def encode(r, at):
    ex = example(*encode_turn(r["prompt"], r["completion"], tokenizer, r.get("messages"),
                              data_cfg))
    check_length(ex, seq_len, at, "completion")
    ex["label"] = np.float32(r["label"])
    return ex

  examples, skipped = prepare(records, indices, kind="kto", encode=encode,
                              on_bad_row=on_bad_row)
  pad = pad_to(seq_len)

  def pad_one(ex):
    return {**pad(ex), "label": ex["label"]}

  return _iterator(examples, skipped, pad_one, kind="kto", batch_size=batch_size, seed=seed,
                   shuffle=shuffle, num_epochs=num_epochs, shard_index=shard_index,
                   shard_count=shard_count, read=len(indices))
