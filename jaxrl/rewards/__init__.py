"""Reward functions: a registry of host-side Python functions, combined by weight.

A reward function takes the batch's completions (decoded text) and the batch's record fields,
and returns one float per completion:

    @register("my_reward")
    def my_reward(completions: list[str], *, batch: dict[str, list], **kwargs) -> list[float]

`batch` holds every field of the prompt records (e.g. "answer", plus any extras a user's JSONL
carries) and "completion_length" (tokens). Rewards run on the host between generation and the
update; each one's wall time is measured. A function that raises, returns the wrong count, or
returns NaN is named in the error. A function may instead score a failed check 0 and count it:
it returns a `verifiers.Scores` (a list with `.errors`), and `score` adds those counts up into
`reward/errors` (the math verifiers do this for parse errors and timeouts).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.errors import ConfigError, check_choice
from jaxrl.rewards import verifiers

log = logging.getLogger(__name__)
RewardFn = Callable[..., Sequence[float]]
REWARDS: dict[str, RewardFn] = {}


class RewardError(RuntimeError):
  """A reward function failed; the message names it."""


def register(name: str):
  def deco(fn):
    REWARDS[name] = fn
    return fn
  return deco


def get_reward(name: str) -> RewardFn:
  return REWARDS[check_choice("reward", name, sorted(REWARDS))]


# ----------------------------------------------------------------------------- built-ins

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_answer(text: str) -> str:
  """Lower-cased, whitespace collapsed, thousands commas and a trailing period removed."""
  text = " ".join(str(text).strip().split()).lower()
  text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
  return text[:-1].rstrip() if text.endswith(".") else text


def extract_answer(completion: str) -> str:
  """The answer in a completion: the text after the last '####' or 'answer:' marker, else the
  first line; normalised as in normalize_answer."""
  text = completion
  for marker in ("####", "answer:", "Answer:"):
    if marker in text:
      text = text.rsplit(marker, 1)[1]
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return normalize_answer(lines[0] if lines else "")


@register("exact_match")
def exact_match(completions, *, batch, **_):
  """1.0 when the extracted answer equals the record's normalised "answer"."""
  answers = batch["answer"]
  return [float(extract_answer(c) == normalize_answer(a)) for c, a in zip(completions, answers)]


@register("format")
def regex_format(completions, *, batch, pattern: str = r"^\S.*$", **_):
  """1.0 when the completion matches `pattern` (re.search, DOTALL)."""
  rx = re.compile(pattern, re.DOTALL)
  return [float(bool(rx.search(c))) for c in completions]


@register("length_penalty")
def length_penalty(completions, *, batch, max_tokens: int = 128, **_):
  """-length / max_tokens: a gentle push toward short completions."""
  return [-float(n) / max_tokens for n in batch["completion_length"]]


@register("soft_overlong")
def soft_overlong(completions, *, batch, max_tokens: int = 128, buffer: int = 32, **_):
  """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max_tokens - buffer,
  then a linear ramp down to -1 at max_tokens, and -1 beyond."""
  out = []
  for n in batch["completion_length"]:
    if n <= max_tokens - buffer:
      out.append(0.0)
    elif n <= max_tokens:
      out.append((max_tokens - buffer - n) / buffer)
    else:
      out.append(-1.0)
  return out


# math, math_strict, math_format, gsm8k, gsm8k_strict, gsm8k_format (jaxrl/rewards/verifiers.py)
REWARDS.update(verifiers.REWARDS)


# ----------------------------------------------------------------------------- combining


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  name: str
  weight: float = 1.0
  kwargs: dict = dataclasses.field(default_factory=dict)


def parse_specs(text: str) -> list[RewardSpec]:
  """"exact_match" or "exact_match:1.0,format:0.1" -> specs (weights default to 1)."""
  specs = []
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, w = part.partition(":")
    try:
      weight = float(w) if w else 1.0
    except ValueError:
      raise ConfigError(f"reward weight {w!r} in {part!r} is not a number: write name:weight, "
                        "e.g. exact_match:1.0,format:0.1.") from None
    get_reward(name)
    specs.append(RewardSpec(name, weight))
  if not specs:
    raise ConfigError("no reward configured: set rewards to e.g. 'exact_match'.")
  return specs


def score(specs: Sequence[RewardSpec], completions: list[str], batch: dict,
          *, normalize: bool = False) -> tuple[np.ndarray, dict[str, float]]:
  """Weighted sum of the named rewards, [N] float32, and per-reward means and seconds, and
  `reward/errors`: how many scores are a failed check's 0 (a verifier that raised or timed out).

  normalize=True z-scores each reward over the batch before weighting, so rewards of different
  scales combine by their weights alone.
  """
  total = np.zeros(len(completions), np.float64)
  stats: dict[str, float] = {}
  errors = 0
  for spec in specs:
    fn = get_reward(spec.name)
    t0 = time.perf_counter()
    try:
      values = fn(completions, batch=batch, **spec.kwargs)
    except ConfigError:
      raise  # the data or the reward's settings are at fault, and the sentence says which
    except Exception as e:
      raise RewardError(f"reward function {spec.name!r} raised {type(e).__name__}: {e}") from e
    n_errors = int(getattr(values, "errors", 0))
    if n_errors:
      errors += n_errors
      _warn_once(spec.name, f"reward {spec.name!r}: {n_errors} of {len(completions)} "
                 f"completions scored 0 because the check failed (first: "
                 f"{getattr(values, 'first_error', None)}); later failures are counted in "
                 "reward/errors only.")
    values = np.asarray(list(values), np.float64)
    if values.shape != (len(completions),):
      raise RewardError(f"reward function {spec.name!r} returned {values.shape[0]} values for "
                        f"{len(completions)} completions")
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
      raise RewardError(f"reward function {spec.name!r} returned {values[bad[0]]} for "
                        f"completion {bad[0]} ({completions[bad[0]]!r:.80})")
    stats[f"reward/{spec.name}"] = float(values.mean())
    stats[f"timing_s/reward/{spec.name}"] = time.perf_counter() - t0
    if normalize and values.std() > 0:
      values = (values - values.mean()) / values.std()
    total += spec.weight * values
  stats["reward/errors"] = float(errors)
  return total.astype(np.float32), stats


_WARNED: set[str] = set()


def _warn_once(name: str, message: str) -> None:
  if name not in _WARNED:
    _WARNED.add(name)
    log.warning(message)
