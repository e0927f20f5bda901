"""algo.pack_completions: a shared-prompt learner batch packed for the program that takes it
(see docs/design.md, "Packed completions"). The forward that reads it is
jaxrl.rl.grpo.update.packed_logprobs over Transformer.packed_hidden."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from jaxrl.rl.grpo.trainer import Parts

PACKED = ("pack_tokens", "pack_offsets", "pack_segments", "pack_targets")  # [R, W] each


def device_batch(p: Parts, batch: dict, parts: int) -> dict:
  """A shared-prompt batch as the learner program that splits it into `parts` micro-batches
  takes it: packed (pack_completions) when it carries completion_len, which learner_forwards
  adds under algo.pack_completions; else as is."""
  if "completion_len" not in batch:
    return batch
  return pack_completions(batch, group=p.config.rollout.group_size,
                          pad_id=p.tokenizer.pad_id, parts=parts)


def pack_completions(batch: dict[str, np.ndarray], *, group: int, pad_id: int,
                     parts: int = 1) -> dict[str, np.ndarray]:
  """A shared-prompt learner batch (grouped_learner_batch's, with completion_len [N] added)
  with its completions also packed, as the learner's programs take it when
  algo.pack_completions is set: their forwards then run the completions one after another in
  rows of W = Tc - 1 positions (Transformer.packed_hidden) instead of one row each padded to
  the longest, and gather the log-probs back to the [N, Tc] layout that everything after them
  reads (update.packed_logprobs).

  A completion of L tokens runs its tokens 0 .. L-2 (its token 0 is predicted by its prompt's
  last position): L - 1 positions. A row holds completions of one prompt (first fit by
  decreasing length, each group's own rows), and a micro-batch pools its groups' rows: `parts`
  micro-batches split as split_micro splits (prompt b * parts + i in micro-batch i), each with
  u rows per prompt, u the fullest micro-batch's rows over its prompts rounded up by
  packed_rows. So R = P * u rows, laid out in split_micro's units, and each micro-batch's rows
  name prompts of that micro-batch only.

  Adds pack_tokens, pack_offsets (each token's index in its completion), pack_segments (a row's
  own id of each completion, 0 on padding), pack_targets (the token each position predicts),
  all [R, W] int32; pack_prompt [R, 1] (each row's prompt within its micro-batch) and pack_index
  [N, Tc] (for completion token t >= 1, the position predicting it among its micro-batch's
  rows, row-major; 0 at t = 0 and past the completion, where the value is replaced or masked).
  Drops completion_len."""
  completion = batch["completion"]
  lengths = np.asarray(batch["completion_len"]).reshape(-1)
  N, Tc = completion.shape
  W, P = Tc - 1, N // group
  per = P // parts  # prompts per micro-batch
  runs = np.maximum(lengths.astype(np.int64) - 1, 0)  # positions each completion takes
  micro_rows = []  # per micro-batch: rows as [prompt b, free, [(n, start)]]
  for i in range(parts):
    rows = []
    for b in range(per):
      p, mine = b * parts + i, []
      for n in sorted(range(p * group, (p + 1) * group), key=lambda n: -runs[n]):
        if runs[n] == 0:
          continue
        row = next((rows[j] for j in mine if rows[j][1] >= runs[n]), None)
        if row is None:
          mine.append(len(rows))
          row = [b, W, []]
          rows.append(row)
        row[2].append((n, W - row[1]))
        row[1] -= runs[n]
    micro_rows.append(rows)
  u = packed_rows(-(-max(len(rows) for rows in micro_rows) // per), group)
  R = P * u
  out = {name: np.zeros((R, W), np.int32) for name in PACKED}
  out["pack_tokens"][:] = pad_id
  out["pack_targets"][:] = pad_id
  out["pack_prompt"] = np.zeros((R, 1), np.int32)
  index = np.zeros((N, Tc), np.int32)
  for i, rows in enumerate(micro_rows):
    for k, (b, _, placed) in enumerate(rows):
      at = (k // u * parts + i) * u + k % u  # local row k -> its place in split_micro's units
      out["pack_prompt"][at, 0] = b
      for seg, (n, start) in enumerate(placed, start=1):
        m = runs[n]
        out["pack_tokens"][at, start:start + m] = completion[n, :m]
        out["pack_offsets"][at, start:start + m] = np.arange(m)
        out["pack_segments"][at, start:start + m] = seg
        out["pack_targets"][at, start:start + m] = completion[n, 1:m + 1]
        index[n, 1:m + 1] = k * W + start + np.arange(m)
  rest = {k: v for k, v in batch.items() if k != "completion_len"}
  return {**rest, **out, "pack_index": index}


def packed_rows(need: int, group: int) -> int:
  """The packed rows per prompt for a step whose fullest micro-batch needs `need` per prompt:
  the least of 1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5 times them) that holds it, at
  most G (every completion its own row). The learner's programs compile once per shape, so a
  run compiles them at most ~2 log2(G) times per completion width instead of once per count,
  at the cost of up to a third more rows."""
  sizes = sorted({1} | {m << k for k in range(group.bit_length()) for m in (2, 3)})
  return min(next(s for s in sizes if s >= need), group)
