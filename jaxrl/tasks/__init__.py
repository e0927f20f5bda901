"""Built-in verifiable tasks: seeded generators, reference answers, 0/1 checkers, SFT demos.

Each task is small enough that a ~1M-parameter byte-level model learns it on CPU in minutes:

    addition   "12+34="      -> "46"       operands of 1..2 digits ("addition:max_digits=3";
                                            "addition:carry=1": only sums whose units carry)
    sort       "sort 3142:"  -> "1234"     3..6 digits, sorted ascending
    reverse    "reverse abc:" -> "cba"     3..6 lowercase letters, reversed
    multiply   "123*45="     -> "5535"     2..3-digit operands: the calculator environment's
                                            task (a tiny model cannot multiply in its head)
    guess      "guess 1-16 #4821:" -> "11" the guess_number environment's secret

Train and test are disjoint by construction: a prompt belongs to exactly one split, decided by
a stable hash of the prompt text, so no seed or sample size can leak test prompts into training.
Within a split, records are drawn (with replacement) from a numpy generator seeded by
(seed, split), so the same arguments always give the same records.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from jaxrl.errors import ConfigError, check_choice

SPLITS = ("train", "test")
# One prompt in five belongs to the test split. The hash is crc32, not Python's hash(), which is
# salted per process and would make the split differ between runs.
_TEST_BUCKETS = 5
_EOS_TEXT = "<eos>"
ERROR_MODES = ("random", "systematic")  # how an imperfect SFT labeller errs: see sft_records


def split_of(prompt: str) -> str:
  """The split a prompt belongs to ("train" or "test"), the same in every process and run."""
  return "test" if zlib.crc32(prompt.encode("utf-8")) % _TEST_BUCKETS == 0 else "train"


def extract_answer(completion: str) -> str:
  """The answer a completion gives: its first line, cut at an eos marker, stripped.

  Decoding with `skip_special=False` leaves "<eos><pad>..." after the answer, and a model may
  keep talking on the next line; neither should turn a right answer into a wrong one.
  """
  return completion.split(_EOS_TEXT, 1)[0].split("\n", 1)[0].strip()


@dataclasses.dataclass(frozen=True)
class Task:
  """A verifiable task. Subclasses define `sample` (one prompt and its answer) and `corrupt`."""

  name: str = ""

  # -- what a subclass provides
  def sample(self, rng: np.random.Generator) -> tuple[str, str]:
    raise NotImplementedError

  def corrupt(self, rng: np.random.Generator, prompt: str, answer: str) -> str:
    """A plausible but wrong answer to `prompt` (never equal to `answer`)."""
    raise NotImplementedError

  def validate(self) -> None:
    """Raises ConfigError for settings that cannot produce records (e.g. min > max)."""
    for lo, hi in (("min_digits", "max_digits"), ("min_len", "max_len")):
      if hasattr(self, lo) and not 1 <= getattr(self, lo) <= getattr(self, hi):
        raise ConfigError(f"task {self.name!r}: {lo}={getattr(self, lo)} and "
                          f"{hi}={getattr(self, hi)} must satisfy 1 <= {lo} <= {hi}.")

  # -- shared by every task
  def _draw(self, split: str, n: int, seed: int) -> list[tuple[str, str]]:
    if split not in SPLITS:
      raise ConfigError(f"split={split!r} is not valid: choose one of {', '.join(SPLITS)}.")
    if not isinstance(n, int) or n < 0:
      raise ConfigError(f"n={n!r} is not valid: give a number of records >= 0.")
    rng = np.random.default_rng([int(seed), SPLITS.index(split), zlib.crc32(self.name.encode())])
    out, tries = [], 0
    while len(out) < n:
      prompt, answer = self.sample(rng)
      tries += 1
      if split_of(prompt) == split:
        out.append((prompt, answer))
      elif tries > 1000 * (n + 10):  # a split with (almost) no prompts: say so, do not spin
        raise ConfigError(f"task {self.name!r} has too few distinct {split} prompts to draw "
                          f"{n} records: widen its settings (e.g. more digits).")
    return out

  def records(self, split: str, n: int, seed: int) -> list[dict]:
    """RL records {"prompt", "answer"}: `n` draws from `split`, the same for the same seed."""
    return [{"prompt": p, "answer": a} for p, a in self._draw(split, n, seed)]

  def slip(self, prompt: str, answer: str) -> str | None:
    """The task's systematic mistake on `prompt` (never equal to `answer`), or None where the
    mistake cannot be made (e.g. a carry dropped from a sum that has no carry)."""
    raise NotImplementedError

  def sft_records(self, split: str, n: int, seed: int, error_rate: float = 0.0,
                  error_mode: str = "random") -> list[dict]:
    """SFT demonstrations {"prompt", "completion"} from an imperfect labeller.

    error_mode "random": round(error_rate * n) demonstrations, chosen at random (seeded), hold a
    plausible wrong answer (`corrupt`). A model imitating them is imperfect, but the right answer
    stays each prompt's most likely one, so greedy decoding mostly hides the noise.

    error_mode "systematic": the labeller makes the task's one systematic mistake (`slip`, e.g.
    a dropped carry) on each prompt where it can, with probability error_rate. Above 0.5 the
    mistake is the majority answer on those prompts, so SFT learns it and greedy decoding
    repeats it, while the right answer keeps real probability: the case where RL against a
    verifier improves on imitation.
    """
    if not 0.0 <= error_rate <= 1.0:
      raise ConfigError(f"error_rate={error_rate!r} is not valid: give a fraction in [0, 1].")
    check_choice("error_mode", error_mode, ERROR_MODES)
    pairs = self._draw(split, n, seed)
    rng = np.random.default_rng([int(seed), 7919, zlib.crc32(self.name.encode())])
    if error_mode == "systematic":
      slips = [self.slip(p, a) for p, a in pairs]
      draws = rng.random(len(pairs))
      return [{"prompt": p, "completion": w if w is not None and u < error_rate else a}
              for (p, a), w, u in zip(pairs, slips, draws)]
    wrong = set(rng.choice(n, size=round(error_rate * n), replace=False).tolist()) if n else set()
    return [{"prompt": p, "completion": self.corrupt(rng, p, a) if i in wrong else a}
            for i, (p, a) in enumerate(pairs)]

  def check(self, completion: str, answer: str) -> float:
    """1.0 when the completion's answer (see `extract_answer`) equals `answer`, else 0.0."""
    return float(extract_answer(completion) == answer.strip())


def _digits(rng: np.random.Generator, lo: int, hi: int) -> int:
  """A number whose digit count is uniform in [lo, hi], so short operands are not rare."""
  d = int(rng.integers(lo, hi + 1))
  return int(rng.integers(0 if d == 1 else 10 ** (d - 1), 10 ** d))


@dataclasses.dataclass(frozen=True)
class Addition(Task):
  name: str = "addition"
  min_digits: int = 1
  # Two digits by default: measured on 2 CPU cores, the 0.46M-param "tiny" preset reaches 93%
  # held-out exact match after 1000 SFT steps of 64 on 1-2 digits, but only 25% after 1500
  # steps on 1-3 digits (answers are written most-significant digit first, which is harder).
  max_digits: int = 2
  # 1: only sums whose units digits carry (17+25), where a tiny SFT policy errs most. RL on
  # these alone learns to always carry (docs/guides/recipes.md): score the full task as well.
  carry: int = 0

  def validate(self):
    super().validate()
    if self.carry not in (0, 1):
      raise ConfigError(f"task {self.name!r}: carry={self.carry} must be 0 (every sum) or 1 "
                        "(only sums whose units digits carry).")

  def sample(self, rng):
    while True:  # with carry=1 about 45% of draws qualify (none of 0..9 + 0); 0 takes the first
      a, b = _digits(rng, self.min_digits, self.max_digits), _digits(
          rng, self.min_digits, self.max_digits)
      if not self.carry or a % 10 + b % 10 >= 10:
        return f"{a}+{b}=", str(a + b)

  def slip(self, prompt, answer):
    # The carry out of the units dropped: 17+25 -> 32. Sums without that carry have no slip.
    a, b = (int(x) for x in prompt.removesuffix("=").split("+"))
    return str(a + b - 10) if a % 10 + b % 10 >= 10 else None

  def corrupt(self, rng, prompt, answer):
    # Off by a small amount, the kind of slip a half-trained model makes (a carry dropped).
    delta = int(rng.choice([-10, -2, -1, 1, 2, 10]))
    value = int(answer) + delta
    return str(value if value >= 0 else int(answer) + abs(delta))


@dataclasses.dataclass(frozen=True)
class SortDigits(Task):
  name: str = "sort"
  min_len: int = 3
  max_len: int = 6

  def sample(self, rng):
    n = int(rng.integers(self.min_len, self.max_len + 1))
    s = "".join(str(int(d)) for d in rng.integers(0, 10, n))
    return f"sort {s}:", "".join(sorted(s))

  def slip(self, prompt, answer):
    # Each digit written once (sorted as a set, not a multiset): 3133 -> 13. Needs a repeat.
    out = "".join(sorted(set(answer)))
    return out if out != answer else None

  def corrupt(self, rng, prompt, answer):
    s = list(answer)
    diff = [i for i in range(len(s) - 1) if s[i] != s[i + 1]]
    if diff:  # swap one adjacent unequal pair: almost sorted, still wrong
      i = int(rng.choice(diff))
      s[i], s[i + 1] = s[i + 1], s[i]
    else:  # all digits equal: change one
      i = int(rng.integers(len(s)))
      s[i] = str((int(s[i]) + 1 + int(rng.integers(9))) % 10)
    return "".join(s)


@dataclasses.dataclass(frozen=True)
class Reverse(Task):
  name: str = "reverse"
  min_len: int = 3
  max_len: int = 6

  def sample(self, rng):
    n = int(rng.integers(self.min_len, self.max_len + 1))
    s = "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 26, n))
    return f"reverse {s}:", s[::-1]

  def slip(self, prompt, answer):
    # Only the outer letters swapped, the inside left as it was: abcde -> ebcda.
    word = answer[::-1]
    out = word[-1] + word[1:-1] + word[0]
    return out if out != answer else None

  def corrupt(self, rng, prompt, answer):
    s = list(answer)
    i = int(rng.integers(len(s)))
    s[i] = chr(ord("a") + (ord(s[i]) - ord("a") + 1 + int(rng.integers(25))) % 26)
    return "".join(s)


@dataclasses.dataclass(frozen=True)
class Multiply(Task):
  name: str = "multiply"
  min_digits: int = 2
  max_digits: int = 3

  def sample(self, rng):
    a, b = _digits(rng, self.min_digits, self.max_digits), _digits(
        rng, self.min_digits, self.max_digits)
    return f"{a}*{b}=", str(a * b)

  def slip(self, prompt, answer):
    # The second operand's tens partial product left unshifted: 123*45 -> 123*5 + 123*4.
    a, b = (int(x) for x in prompt.removesuffix("=").split("*"))
    tens = b // 10 % 10
    return str(a * (b % 10) + a * tens + a * (b // 100) * 100) if tens and a else None

  def corrupt(self, rng, prompt, answer):
    delta = int(rng.choice([-100, -10, -1, 1, 10, 100]))
    value = int(answer) + delta
    return str(value if value >= 0 else int(answer) + abs(delta))


@dataclasses.dataclass(frozen=True)
class Guess(Task):
  """Secrets for the guess_number environment (jaxrl.envs.games); the game id keeps prompts
  apart, so the train and test splits hold different games."""
  name: str = "guess"
  max_number: int = 16

  def validate(self) -> None:
    if self.max_number < 2:
      raise ConfigError(f"task 'guess': max_number={self.max_number} must be at least 2.")

  def sample(self, rng):
    secret, game = int(rng.integers(1, self.max_number + 1)), int(rng.integers(0, 10 ** 6))
    return f"guess 1-{self.max_number} #{game}:", str(secret)

  def slip(self, prompt, answer):
    # One too high, where that is still in range.
    return str(int(answer) + 1) if int(answer) < self.max_number else None

  def corrupt(self, rng, prompt, answer):
    return str(int(answer) % self.max_number + 1)


TASKS: dict[str, Task] = {t.name: t for t in (Addition(), SortDigits(), Reverse(), Multiply(),
                                               Guess())}


def get_task(name: str, **options) -> Task:
  """The task called `name`, with settings from `name:key=value,...` or keyword options.

  get_task("addition:max_digits=3") == get_task("addition", max_digits=3); the string form
  lets a config value or a CLI flag pick a harder variant.
  """
  base, _, spec = str(name).partition(":")
  task = TASKS[check_choice("task", base, TASKS)]
  fields = {f.name: type(getattr(task, f.name)) for f in dataclasses.fields(task)}
  fields.pop("name")
  for item in filter(None, spec.split(",")):
    key, eq, value = item.partition("=")
    if not eq or key.strip() not in fields:
      raise ConfigError(f"task option {item!r} in {name!r} is not valid: write "
                        f"{base}:key=value with key one of {', '.join(sorted(fields))}.")
    try:
      options.setdefault(key.strip(), fields[key.strip()](value.strip()))
    except ValueError:
      raise ConfigError(f"task option {item!r} in {name!r} is not valid: "
                        f"{key.strip()} takes an integer.") from None
  bad = sorted(set(options) - set(fields))
  if bad:
    raise ConfigError(f"task {base!r} has no option {bad[0]!r}: valid options are "
                      f"{', '.join(sorted(fields))}.")
  if options:
    task = dataclasses.replace(task, **options)
  task.validate()
  return task


__all__ = ["ERROR_MODES", "Addition", "Guess", "Multiply", "Reverse", "SortDigits", "TASKS",
           "Task", "extract_answer", "get_task", "split_of"]
