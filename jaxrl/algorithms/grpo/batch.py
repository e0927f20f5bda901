"""One GRPO step's experience and the learner batch it becomes: Experience (what the update
consumes), the two batch layouts (learner_batch: prompt and completion joined per row;
grouped_learner_batch: each group's prompt once, its completions after it) and, under
algo.pack_completions, the shared-prompt batch packed for the program that takes it (see
docs/design.md, "Packed completions"; the forward that reads it is
jaxrl.algorithms.grpo.update.packed_logprobs over Transformer.packed_hidden). Below the steps
that make and consume it: experience.py, update.py and the trainers import it, it imports none
of them."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jaxrl.sampler import Rollout, bucket

if TYPE_CHECKING:
  from jaxrl.algorithms.grpo.parts import Parts


@dataclasses.dataclass
class Experience:
  """One step's scored rollouts, as the update consumes them. Host arrays, the same on every
  process; N = prompts x G rows, rows p*G .. p*G+G-1 answering prompt p."""
  step: int
  version: int            # the oldest version that sampled it: step, or up to
                          # rollout.max_staleness less when async
  rollout: Rollout
  rewards_bg: np.ndarray  # [B, G] the rewards, before any KL shaping
  # The learner batch: the model inputs in either layout (learner_batch or
  # grouped_learner_batch), mask, sampler_logp, ref_logp, adv, beta, and old_logp when a
  # separate forward gave them.
  batch: dict[str, np.ndarray]
  old_sums: dict | None   # that forward's old_policy_sums; None: the update's forward gives them
  reward_stats: dict
  gen_stats: dict
  frac_zero: float        # of the first round's groups, whose G rewards were all equal
  times: dict             # seconds: gen, gen_wait (what the learner waited), old, ref


# ----------------------------------------------------------------------------- the two layouts

# The learner batch's fields, written once: the model inputs of each layout (grouped: the
# shared-prompt form), the rollout's per-token floats (learner_batch and grouped_learner_batch
# give both), and those the step adds (experience.py: ref_logp, adv, beta; old_logp when a
# forward of its own gave it). batch_shapes() abstracts them for the plan.
INPUTS = {False: ("inputs", "targets", "positions"), True: ("prompt", "prompt_len", "completion")}
ROLLOUT = ("mask", "sampler_logp")
ADDED = ("ref_logp", "adv", "beta")


def batch_shapes(n: int, *, group: int, prompt_len: int, width: int, grouped: bool,
                 update: bool = True, old_logp: bool = False) -> dict[str, tuple]:
  """{field: (shape, dtype)} of the learner batch of n completions (n / group prompts): what
  the update takes, or with update=False what the log-prob forward reads (the inputs).
  `width` is a row's: the completion's when grouped, prompt + completion otherwise."""
  if grouped:
    out = {"prompt": ((n // group, prompt_len), "int32"),
           "prompt_len": ((n // group, 1), "int32"), "completion": ((n, width), "int32")}
  else:
    out = {k: ((n, width), "int32") for k in INPUTS[False]}
  if update:
    floats = ROLLOUT + ADDED + (("old_logp",) if old_logp else ())
    out.update({k: ((n, width), "float32") for k in floats})
  return out


def learner_batch(rollout, *, length: int, pad_id: int) -> dict[str, np.ndarray]:
  """Rollout -> next-token arrays over prompt + completion, right-padded to `length` + 1.

  Row s is prompt s's tokens then its completion's. Target index t predicts token t+1, so the
  completion's first token is the target at index len(prompt) - 1. `mask` marks completion
  targets the model sampled (completion_mask: a multi-turn rollout's template and tool tokens
  are inputs, not targets); `sampler_logp` is the sampler's log-prob of each such target.
  """
  N = rollout.completion_ids.shape[0]
  seq = np.full((N, length + 1), pad_id, np.int32)
  mask = np.zeros((N, length), np.float32)
  sampler_logp = np.zeros((N, length), np.float32)
  for s in range(N):
    p = int(rollout.prompt_lengths[s])
    c = int(rollout.lengths[s])
    seq[s, :p] = rollout.prompt_ids[s, :p]
    seq[s, p:p + c] = rollout.completion_ids[s, :c]
    mask[s, p - 1:p - 1 + c] = rollout.completion_mask[s, :c]
    sampler_logp[s, p - 1:p - 1 + c] = rollout.logprobs[s, :c]
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (N, length))
  return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "positions": np.array(positions),
          "mask": mask, "sampler_logp": sampler_logp}


def grouped_learner_batch(rollout, *, prompt_len: int, group: int, pad_id: int,
                          width: int | None = None) -> dict[str, np.ndarray]:
  """Rollout -> the shared-prompt form: each group's prompt once, its G completions after it.

  prompt [P, prompt_len] right-padded, prompt_len [P, 1], completion [N, Tc] (the targets:
  index t holds completion token t), and mask / sampler_logp [N, Tc] on the completion's own
  index (see Transformer.grouped_hidden). Rows p*G .. p*G+G-1 must share prompt p. Tc is
  `width` (completions right-padded to it, masked out; see completion_width), or the
  rollout's longest completion.
  """
  N, Tc = rollout.completion_ids.shape
  if width is not None:
    if width < Tc:
      raise ValueError(f"grouped_learner_batch: width={width} is shorter than the rollout's "
                       f"longest completion ({Tc} tokens)")
    pad = ((0, 0), (0, width - Tc))
    rollout = dataclasses.replace(
        rollout, completion_ids=np.pad(rollout.completion_ids, pad, constant_values=pad_id),
        logprobs=np.pad(rollout.logprobs, pad),
        completion_mask=np.pad(rollout.completion_mask, pad))
    Tc = width
  P = N // group
  first = np.arange(P) * group
  if not all((rollout.prompt_index[first[p]:first[p] + group] ==
              rollout.prompt_index[first[p]]).all() for p in range(P)):
    raise ValueError("grouped_learner_batch: each group's rows must share one prompt")
  prompt = np.full((P, prompt_len), pad_id, np.int32)
  lengths = rollout.prompt_lengths[first].astype(np.int32)
  for p in range(P):
    prompt[p, :lengths[p]] = rollout.prompt_ids[first[p], :lengths[p]]
  inside = np.arange(Tc)[None, :] < rollout.lengths[:, None]
  completion = np.where(inside, rollout.completion_ids, pad_id).astype(np.int32)
  # The model's own tokens (a multi-turn rollout's template and tool tokens are not trained).
  mask = (inside & (rollout.completion_mask > 0)).astype(np.float32)
  return {"prompt": prompt, "prompt_len": lengths[:, None], "completion": completion,
          "mask": mask, "sampler_logp": (rollout.logprobs * mask).astype(np.float32)}


def completion_width(longest: int, max_new_tokens: int) -> int:
  """The completion width of a shared-prompt learner batch: the power of two >= the rollout's
  longest completion (at least 16), capped at rollout.max_new_tokens. The learner's jits
  compile once per width, so a run compiles them at most log2(max_new_tokens / 16) + 1 times
  instead of once per new longest length (each ~10 s for the demo's reference forward and
  update on 8 CPU devices), at the cost of computing up to twice the completion positions."""
  return max(min(bucket(longest, minimum=16), max_new_tokens), longest)


# ----------------------------------------------------------------------------- packed completions


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
