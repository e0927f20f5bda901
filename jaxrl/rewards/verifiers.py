"""Math verifiers: the `math` and `gsm8k` rewards, their strict variants and format rewards.

    math          \\boxed{} first, else math-verify's last answer; symbolic and numeric equality
    math_strict   only the last \\boxed{} counts
    math_format   1.0 when the completion has a non-empty \\boxed{}
    gsm8k         the final number ("#### N", else \\boxed{}, else the last number) against the
                  number after "####" in the record's answer (its rationale is ignored)
    gsm8k_strict  only a "#### N" answer counts
    gsm8k_format  1.0 when the completion has a "#### N" line

The record's reference is batch["answer"]. LaTeX parsing and equivalence are math-verify's (HF's
kept library, as TRL and open-r1 use): hand-written LaTeX handling misses \\dfrac, \\left(,
units in \\text{} and equal expressions written differently, and gets nothing back for it.

A check that raises or times out (`timeout_s`, default 5 s, per parse and per comparison)
scores 0 and is counted: the returned `Scores` carry `.errors`, which `jaxrl.rewards.score`
adds up into the `reward/errors` metric.

Threads: math-verify's timeout is signal.alarm, which exists only on the main thread, and it is
needed, since some answers (10^{10^{10}}) make sympy's arithmetic run for minutes. On the main
thread the checks run in this process. Elsewhere (GRPO's async generation scores in the
"jaxrl-sampler" thread) they run in a worker process, `python mathcheck.py`, on its main thread;
an item past its deadline even there gets the worker killed and restarted.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time

from jaxrl.errors import ConfigError
from jaxrl.rewards import mathcheck

DEFAULT_TIMEOUT_S = 5
# The worker's own start (Python, math-verify, sympy): generous, a loaded 2-core CI machine.
_START_DEADLINE_S = 120.0


class Scores(list):
  """A reward's per-completion values, with how many of them are a failed check's 0.0 and the
  first failure's message."""

  def __init__(self, values=(), errors: int = 0, first_error: str | None = None):
    super().__init__(values)
    self.errors, self.first_error = errors, first_error


def _timeout(timeout_s) -> int:
  # signal.alarm takes whole seconds.
  if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
    raise ConfigError(f"timeout_s={timeout_s!r} is not valid: give the seconds a math check may "
                      "take, e.g. 5.")
  return max(1, math.ceil(timeout_s))


def run_checks(kind: str, golds, completions, *, strict: bool, timeout_s=DEFAULT_TIMEOUT_S,
               deadline_s: float | None = None) -> Scores:
  """mathcheck.check on each (gold, completion): in this process on the main thread, else in
  the worker process. `deadline_s` bounds one item's wall time in the worker (default
  4 x timeout_s + 5: up to three parses and a comparison, each alarmed, and slack)."""
  t = _timeout(timeout_s)
  items = [(g, c) for g, c in zip(golds, completions)]
  if threading.current_thread() is threading.main_thread():
    results = [mathcheck.check(kind, g, c, strict=strict, timeout_s=t) for g, c in items]
  else:
    results = _WORKER.check(kind, items, strict=strict, timeout_s=t,
                            deadline_s=deadline_s if deadline_s is not None else 4 * t + 5)
  errors = [e for _, e in results if e is not None]
  return Scores([s for s, _ in results], len(errors), errors[0] if errors else None)


class _Worker:
  """One `python mathcheck.py` process per jaxrl process, started on first use off the main
  thread; requests go one at a time (a lock), so an item that hangs is the one named."""

  def __init__(self):
    self.proc: subprocess.Popen | None = None
    self.lock = threading.Lock()
    self._buf = b""

  def _start(self) -> None:
    # -P: the script's folder (jaxrl/rewards) must not shadow modules; -u: unbuffered pipes.
    self.proc = subprocess.Popen([sys.executable, "-P", "-u", mathcheck.__file__],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    self._buf = b""
    if self._read_line(_START_DEADLINE_S) is None:
      self.stop()
      raise RuntimeError(f"the math verifier worker did not start within {_START_DEADLINE_S:.0f}"
                         " s")

  def stop(self) -> None:
    if self.proc is not None:
      self.proc.kill()
      self.proc.wait()
      for f in (self.proc.stdin, self.proc.stdout):
        f.close()
      self.proc = None

  def _read_line(self, deadline_s: float) -> bytes | None:
    """One line of the worker's output, or None at the deadline or when it exited."""
    end = time.monotonic() + deadline_s
    fd = self.proc.stdout.fileno()
    while b"\n" not in self._buf:
      left = end - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        return None
      chunk = os.read(fd, 65536)
      if not chunk:
        return None  # the worker exited
      self._buf += chunk
    line, self._buf = self._buf.split(b"\n", 1)
    return line

  def check(self, kind, items, *, strict, timeout_s, deadline_s):
    out = []
    with self.lock:
      for gold, completion in items:
        try:
          if self.proc is None:
            self._start()
          req = {"kind": kind, "gold": str(gold), "completion": completion, "strict": strict,
                 "timeout_s": timeout_s}
          self.proc.stdin.write((json.dumps(req) + "\n").encode())
          self.proc.stdin.flush()
          line = self._read_line(deadline_s)
        except (OSError, RuntimeError) as e:  # a broken pipe: the worker died; start anew
          self.stop()
          out.append((0.0, f"the verifier worker failed: {e}"))
          continue
        if line is None:
          self.stop()  # hung past its alarm (or died): the next item starts a fresh worker
          out.append((0.0, f"no answer within {deadline_s:g} s; the worker was restarted"))
          continue
        try:
          res = json.loads(line)
          out.append((float(res["score"]), res["error"]))
        except (ValueError, KeyError, TypeError):
          self.stop()
          out.append((0.0, f"the verifier worker answered {line[:80]!r}, not a score; it was "
                      "restarted"))
    return out


_WORKER = _Worker()
atexit.register(_WORKER.stop)


# ----------------------------------------------------------------------------- the rewards


def _answers(batch) -> list:
  if "answer" not in batch:
    raise ConfigError("the math and gsm8k rewards compare against each record's 'answer' field, "
                      "and these records have none: add one, or map a column to it with "
                      "data.fields.")
  return batch["answer"]


def math_reward(completions, *, batch, timeout_s=DEFAULT_TIMEOUT_S, **_):
  """1.0 when the completion's answer (\\boxed{} first, else the last one) equals the record's
  "answer" symbolically or numerically (math-verify)."""
  return run_checks("math", _answers(batch), completions, strict=False, timeout_s=timeout_s)


def math_strict(completions, *, batch, timeout_s=DEFAULT_TIMEOUT_S, **_):
  """As `math`, but only an answer in the last \\boxed{} counts."""
  return run_checks("math", _answers(batch), completions, strict=True, timeout_s=timeout_s)


def math_format(completions, *, batch, **_):
  """1.0 when the completion puts a non-empty answer in \\boxed{}."""
  return [float(bool((mathcheck.last_boxed(c) or "").strip())) for c in completions]


def gsm8k(completions, *, batch, timeout_s=DEFAULT_TIMEOUT_S, **_):
  """1.0 when the completion's final number ("#### N", else \\boxed{}, else its last number)
  equals the number after "####" in the record's answer."""
  return run_checks("gsm8k", _answers(batch), completions, strict=False, timeout_s=timeout_s)


def gsm8k_strict(completions, *, batch, timeout_s=DEFAULT_TIMEOUT_S, **_):
  """As `gsm8k`, but only a "#### N" answer counts."""
  return run_checks("gsm8k", _answers(batch), completions, strict=True, timeout_s=timeout_s)


_GSM_LINE = re.compile(r"^[ \t]*####[ \t]*\S", re.MULTILINE)


def gsm8k_format(completions, *, batch, **_):
  """1.0 when the completion has a "#### N" line whose N is a number."""
  return [float(any(mathcheck.parse_number(line.split("####", 1)[1]) is not None
                    for line in c.splitlines() if _GSM_LINE.match(line)))
          for c in completions]


REWARDS = {"math": math_reward, "math_strict": math_strict, "math_format": math_format,
           "gsm8k": gsm8k, "gsm8k_strict": gsm8k_strict, "gsm8k_format": gsm8k_format}
