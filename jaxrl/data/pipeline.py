"""SFT batches on grain: tokenise, mask the prompt, pad or pack, shuffle, repeat, shard.

One example is bos + prompt + completion + eos. The model reads seq[:-1] and predicts seq[1:],
so an example of P prompt and C completion tokens fills P + C + 1 positions of a row, and the
loss counts the C completion targets and the eos. Every batch is a dict of numpy arrays, each
[batch_size, seq_len] where batch_size is this process's local batch:

    inputs       int32    tokens fed to the model (0 = pad)
    targets      int32    next tokens (0 = pad)
    loss_mask    float32  1.0 where the target is a completion token or the eos
    positions    int32    position within its own example (restarts per packed segment)
    segment_ids  int32    0 on padding, 1..k for the k examples packed in a row

The returned iterator is a grain DatasetIterator: `get_state()` / `set_state()` (or orbax via
grain.checkpoint) resume it exactly where it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import grain
import numpy as np

from jaxrl.data.chat import ChatRenderer
from jaxrl.data.prompts import chat_on, chat_turns, plain_text, template_kwargs
from jaxrl.data.records import BadRow, ON_BAD_ROW, check_record, where
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.errors import ConfigError, check_choice

log = logging.getLogger(__name__)

FEATURES = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


TRAIN_ON = ("last", "all_assistant")  # data.train_on: which assistant turns SFT trains


def encode_turn(prompt: str, completion: str, tokenizer: Tokenizer,
                context: list[dict] | None = None, data_cfg=None
                ) -> tuple[list[int], list[int]]:
  """(prompt ids, completion ids ending in the eos) of one example.

  With chat on (jaxrl.data.prompts.chat_on: by default when the tokenizer has a chat
  template), the prompt's turns (`context`, or `prompt` as one user turn, after
  data.system_prompt) and the completion as the assistant's turn are rendered by that
  template, the way transformers' apply_chat_template would: the prompt is the rendering with
  the generation prompt, exactly what GRPO and sampling feed the model, and the completion the
  final assistant turn with its end-of-turn tokens. Else it is bos + prompt text (see
  prompts.plain_text), and completion text + eos.
  """
  record = {"prompt": prompt, "messages": context}
  if chat_on(tokenizer, data_cfg):
    p, c = tokenizer.encode_chat_sft(
        [*chat_turns(record, data_cfg), {"role": "assistant", "content": completion}],
        **template_kwargs(data_cfg))
    return p, c if tokenizer.eos_id in c else c + [tokenizer.eos_id]
  return (tokenizer.encode(plain_text(record, data_cfg), bos=True),
          tokenizer.encode(completion, eos=True))


def tokenize_sft(record: dict, tokenizer: Tokenizer, data_cfg=None) -> dict[str, np.ndarray]:
  """One example's unpadded inputs, targets and loss_mask, each [P + C + 1].

  Rendered as `encode_turn` says. A chat record ({"messages"}) trains its final assistant turn,
  or with data.train_on="all_assistant" every assistant turn (the tokenizer's
  encode_chat_with_mask: each turn's tokens from the end of its generation prompt through its
  end-of-turn tokens; user and system turns carry no loss).
  """
  messages = record.get("messages")
  train_on = (data_cfg.get("train_on", None) if data_cfg is not None else None) or "last"
  check_choice("data.train_on", train_on, TRAIN_ON)
  if train_on == "all_assistant" and messages:
    if not chat_on(tokenizer, data_cfg):
      # Without a chat template: the multi-turn rollouts' plain-text convention (jaxrl.data.
      # chat), so a demonstration is token for token the conversation GRPO samples.
      ids, mask = ChatRenderer(tokenizer, data_cfg).conversation_ids(messages, None)
      return {"inputs": np.asarray(ids[:-1], np.int32),
              "targets": np.asarray(ids[1:], np.int32),
              "loss_mask": np.asarray(mask[1:], np.float32)}
    turns = chat_turns({"messages": messages}, data_cfg)
    ids, mask = tokenizer.encode_chat_with_mask(turns, **template_kwargs(data_cfg))
    # Target t is ids[t + 1]: it carries loss where that token is an assistant token.
    return {"inputs": np.asarray(ids[:-1], np.int32), "targets": np.asarray(ids[1:], np.int32),
            "loss_mask": np.asarray(mask[1:], np.float32)}
  prompt, completion = encode_turn(record["prompt"], record["completion"], tokenizer,
                                   messages[:-1] if messages else None, data_cfg)
  return example(prompt, completion)


def example(prompt: list[int], completion: list[int]) -> dict[str, np.ndarray]:
  """inputs, targets and loss_mask of prompt + completion ids (the loss on the completion)."""
  seq = np.asarray(prompt + completion, np.int32)
  # Target t is seq[t + 1]; it is a completion token (or the eos) from t = len(prompt) - 1 on.
  loss_mask = np.zeros(len(seq) - 1, np.float32)
  loss_mask[len(prompt) - 1:] = 1.0
  return {"inputs": seq[:-1], "targets": seq[1:], "loss_mask": loss_mask}


def check_length(ex: dict[str, np.ndarray], seq_len: int, at: str, field: str) -> None:
  """BadRow naming `field` (or the prompt, when the prompt alone is too long) for an example
  longer than seq_len."""
  n = len(ex["inputs"])
  if n > seq_len:
    n_prompt = n - int(ex["loss_mask"].sum()) + 1
    field = "prompt" if n_prompt >= seq_len else field
    raise BadRow(f"{at}: field {field!r} makes the row {n} tokens long, over "
                 f"seq_len={seq_len}: raise seq_len or shorten the row.")


def prepare(records: Sequence[dict], indices: Iterable[int], *, kind: str, encode,
            on_bad_row: str) -> tuple[list, int]:
  """(encoded examples, skipped): each record validated again as `kind` (records built in
  code never went through a reader), then `encode(record, at)`d. A BadRow from either is an
  error naming the file, line and field, or a counted skip with on_bad_row="skip"."""
  check_choice("on_bad_row", on_bad_row, ON_BAD_ROW)
  examples, skipped, first = [], 0, None
  for i in indices:
    at = where(records[i], i)
    try:
      ex = encode(check_record(records[i], kind, at), at)
    except BadRow as e:
      if on_bad_row == "error":
        raise ConfigError(f"{str(e).rstrip('.')} (or set on_bad_row=skip).") from None
      skipped, first = skipped + 1, first or str(e)
      continue
    examples.append(ex)
  if skipped:
    log.warning("%s batches: skipped %d bad row(s) of %d; the first: %s", kind, skipped,
                skipped + len(examples), first)
  return examples, skipped


def prepare_sft(records: Sequence[dict], tokenizer: Tokenizer, *, seq_len: int,
                on_bad_row: str = "error", indices: Sequence[int] | None = None,
                data_cfg=None) -> tuple[list[dict[str, np.ndarray]], int]:
  """(tokenised examples, skipped) of `records` (only `indices` of them, when given).

  Chat records are normalised, and a row longer than seq_len is an error naming its file,
  line and field, or a counted skip with on_bad_row="skip".
  """
  def encode(rec, at):
    ex = tokenize_sft(rec, tokenizer, data_cfg)
    check_length(ex, seq_len, at, "completion")
    return ex

  return prepare(records, range(len(records)) if indices is None else indices, kind="sft",
                 encode=encode, on_bad_row=on_bad_row)


def pad_to(seq_len: int):
  def pad(ex: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    n = len(ex["inputs"])
    out = {}
    for k in ("inputs", "targets", "loss_mask"):
      out[k] = np.zeros(seq_len, ex[k].dtype)
      out[k][:n] = ex[k]
    out["positions"] = np.zeros(seq_len, np.int32)
    out["positions"][:n] = np.arange(n, dtype=np.int32)
    out["segment_ids"] = np.zeros(seq_len, np.int32)
    out["segment_ids"][:n] = 1
    return out
  return pad


def _from_packed(ex: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {"inputs": ex["inputs"].astype(np.int32), "targets": ex["targets"].astype(np.int32),
          "loss_mask": ex["loss_mask"].astype(np.float32),
          "positions": ex["inputs_positions"].astype(np.int32),
          "segment_ids": ex["inputs_segment_ids"].astype(np.int32)}


def _positive(name: str, value) -> None:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ConfigError(f"{name}={value!r} is not valid: give a positive integer.")


def shard_indices(n: int, *, seq_len: int, batch_size: int, num_epochs: int | None,
                  shard_index: int, shard_count: int) -> range:
  """The record indices process shard `shard_index` reads (index i belongs to shard
  i % shard_count), after checking the pipeline's arguments."""
  _positive("seq_len", seq_len)
  _positive("batch_size", batch_size)
  _positive("shard_count", shard_count)
  if num_epochs is not None:
    _positive("num_epochs", num_epochs)
  if not (isinstance(shard_index, (int, np.integer)) and 0 <= shard_index < shard_count):
    raise ConfigError(f"shard_index={shard_index!r} is not valid: give 0 <= shard_index < "
                      f"shard_count={shard_count}.")
  return range(shard_index, n, shard_count)


def epochs(examples: Sequence, *, seed: int, shuffle: bool, num_epochs: int | None
           ) -> grain.IterDataset:
  """In-memory examples as a grain IterDataset: seeded shuffle, reshuffled each epoch."""
  ds = grain.MapDataset.source(examples)
  if shuffle:
    ds = ds.shuffle(seed=seed % 2**32)
  # repeat() after shuffle() reshuffles each epoch with a seed folded from the epoch number.
  if num_epochs != 1:
    ds = ds.repeat(num_epochs)
  # Threads buy nothing for in-memory numpy rows and would make the order harder to reason
  # about; the iterator stays checkpointable either way.
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


def sft_dataset(records: Sequence[dict], tokenizer: Tokenizer, *, seq_len: int,
                batch_size: int, seed: int, shuffle: bool = True, num_epochs: int | None = None,
                packing: bool = False, shard_index: int = 0, shard_count: int = 1,
                on_bad_row: str = "error", data_cfg=None) -> tuple[grain.IterDataset, int]:
  """(the batched grain IterDataset, skipped rows) behind `sft_batches`."""
  indices = shard_indices(len(records), seq_len=seq_len, batch_size=batch_size,
                          num_epochs=num_epochs, shard_index=shard_index,
                          shard_count=shard_count)
  examples, skipped = prepare_sft(records, tokenizer, seq_len=seq_len, on_bad_row=on_bad_row,
                                  indices=indices, data_cfg=data_cfg)
  if not examples:
    raise ConfigError(f"shard {shard_index} of {shard_count} has no usable SFT rows "
                      f"({len(indices)} read, {skipped} skipped): give more data or fewer "
                      "shards.")
  it = epochs(examples, seed=seed, shuffle=shuffle, num_epochs=num_epochs)
  if packing:
    it = grain.experimental.FirstFitPackIterDataset(
        it, length_struct={k: seq_len for k in ("inputs", "targets", "loss_mask")},
        num_packing_bins=batch_size, seed=seed % 2**32, shuffle_bins=shuffle)
    it = it.map(_from_packed)
  else:
    it = it.map(pad_to(seq_len))
  # Whole batches only: a jitted step compiles once for [batch_size, seq_len].
  it = it.batch(batch_size, drop_remainder=True)
  if num_epochs is not None and not packing:
    dropped = (len(examples) * num_epochs) % batch_size
    if dropped:
      log.info("sft_batches: the last %d example(s) do not fill a batch and are not used",
               dropped)
  return it, skipped


def sft_batches(records: Sequence[dict], tokenizer: Tokenizer, *, seq_len: int,
                batch_size: int, seed: int, shuffle: bool = True,
                num_epochs: int | None = None, packing: bool = False, shard_index: int = 0,
                shard_count: int = 1, on_bad_row: str = "error",
                data_cfg=None) -> grain.DatasetIterator:
  """A checkpointable iterator of SFT batches (see the module docstring for the format).

  records: {"prompt", "completion"} or {"messages"} dicts (a list, or anything indexable).
  batch_size: this process's local batch. num_epochs=None repeats forever. Shuffling is
  seeded and differs per epoch. Process `shard_index` of `shard_count` reads only the records
  with index % shard_count == shard_index. Bad or over-long rows raise ConfigError, or with
  on_bad_row="skip" are skipped; the count is logged and kept on the iterator as `.skipped`.
  data_cfg: the config's data section (chat, chat_template_kwargs, system_prompt, train_on;
  see encode_turn and tokenize_sft); None takes the defaults.
  """
  ds, skipped = sft_dataset(records, tokenizer, seq_len=seq_len, batch_size=batch_size,
                            seed=seed, shuffle=shuffle, num_epochs=num_epochs, packing=packing,
                            shard_index=shard_index, shard_count=shard_count,
                            on_bad_row=on_bad_row, data_cfg=data_cfg)
  it = iter(ds)
  it.skipped = skipped
  return it
