"""One answer against one reference, for the math and GSM8K rewards (jaxrl/rewards/verifiers.py).

This module imports nothing from jaxrl, so it also runs as a script: the verifier worker process
that scores off the main thread (see `serve`). LaTeX parsing and symbolic equivalence are
math-verify's (HF); only the GSM8K "#### N" convention and plain numbers are read here.

    score_math(gold, completion, strict=, timeout_s=)   1.0 or 0.0; raises when it cannot decide
    score_gsm8k(gold, completion, strict=, timeout_s=)  likewise
    last_boxed(text)                                    the content of the last \\boxed{...}

math-verify bounds its own parse and compare with signal.alarm, which works only on the main
thread (it raises ValueError elsewhere) and interrupts even CPython's big-integer arithmetic,
which checks for signals: "10^{10^{10}}" against "5" runs for minutes without it. So these
functions must run on the main thread of some process: the caller's (verifiers.py checks) or the
worker's.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from fractions import Fraction

# math-verify logs each timeout and, when its own timeout is off, that it is; the rewards count
# timeouts and errors themselves (reward/errors), so these lines would be noise.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number as people write it: an optional sign and $, digits with optional thousands commas, an
# optional decimal part, or a fraction a/b. Unicode minus signs are mapped to "-" first.
_NUMBER = re.compile(
    r"(?<![\w.])-?\$?\s?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:\s?/\s?\d+)?")
_GSM_MARK = "####"


class NoReference(ValueError):
  """The record's reference answer holds nothing to compare against."""


def last_boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces matched; None when
  there is none or it is never closed."""
  starts = [m.end() for m in _BOXED.finditer(text)]
  for start in reversed(starts):
    depth = 1
    for i in range(start, len(text)):
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      if depth == 0:
        return text[start:i]
  return None


def parse_number(text: str) -> Fraction | None:
  """The exact value of the first number in `text`, such as "1,234", "$18", "-3.50", "3/4" or
  "42."; None when it holds none, or only one that is no value (x/0, thousands of digits)."""
  m = _NUMBER.search(text.replace("\u2212", "-"))
  if not m:
    return None
  try:
    return Fraction(m.group(0).replace("$", "").replace(",", "").replace(" ", ""))
  except (ValueError, ZeroDivisionError):  # "1.5/2", "1/0", past int()'s 4300-digit limit
    return None


def numbers(text: str) -> list[str]:
  """Every number token in `text`, in order (see parse_number)."""
  return _NUMBER.findall(text.replace("\u2212", "-"))


def gsm8k_reference(answer: str) -> Fraction:
  """The value of a GSM8K answer field: the number after its last "####" (the rationale before it
  is ignored), or the field's only number when it has no "####"."""
  text = str(answer)
  if _GSM_MARK in text:
    value = parse_number(text.rsplit(_GSM_MARK, 1)[1])
  else:
    found = numbers(text)
    value = parse_number(found[0]) if len(found) == 1 else None
  if value is None:
    raise NoReference(f"the reference answer {text[-60:]!r} holds no '#### N' and no single "
                      "number")
  return value


def _parse(text: str, configs, timeout_s: int):
  from math_verify import parse
  return parse(text, configs, parsing_timeout=timeout_s, raise_on_error=True)


def _verify(gold, pred, timeout_s: int) -> bool:
  from math_verify import verify
  return bool(verify(gold, pred, timeout_seconds=timeout_s, raise_on_error=True))


def _boxed_pred(content: str, timeout_s: int):
  from math_verify import LatexExtractionConfig
  return _parse("\\boxed{" + content + "}", [LatexExtractionConfig(boxed_match_priority=0)],
                timeout_s)


def math_reference(gold: str, timeout_s: int):
  """math-verify's parse of a reference answer: as written (e.g. a MATH solution ending in
  \\boxed{}, or "0.5"), else as LaTeX math ("\\frac{1}{2}" without $ delimiters)."""
  from math_verify import ExprExtractionConfig, LatexExtractionConfig
  configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
  parsed = _parse(str(gold), configs, timeout_s) or _parse(f"${gold}$", configs, timeout_s)
  if not parsed:
    raise NoReference(f"math-verify finds no answer in the reference {str(gold)[-60:]!r}")
  return parsed


def score_math(gold: str, completion: str, *, strict: bool, timeout_s: int) -> float:
  """1.0 when the completion's answer equals the reference symbolically or numerically.

  Lenient: math-verify's extraction with \\boxed{} first, then "the answer is ..." anchors,
  then the last LaTeX or plain expression (the last number). Strict: only the last \\boxed{}
  counts; without one the score is 0.
  """
  from math_verify import ExprExtractionConfig, LatexExtractionConfig
  ref = math_reference(gold, timeout_s)
  if strict:
    content = last_boxed(completion)
    if content is None or not content.strip():
      return 0.0
    pred = _boxed_pred(content, timeout_s)
  else:
    pred = _parse(completion, [LatexExtractionConfig(boxed_match_priority=0),
                               ExprExtractionConfig()], timeout_s)
  return float(bool(pred) and _verify(ref, pred, timeout_s))


def score_gsm8k(gold: str, completion: str, *, strict: bool, timeout_s: int) -> float:
  """1.0 when the completion's final number equals the reference's "#### N" value.

  The completion's answer: the number after its last "####"; lenient, without one, the last
  \\boxed{} (read by math-verify, so \\frac, \\$ and \\text{} units work), else its last
  number. Numbers compare exactly after dropping thousands commas, "$", units and a final
  period ("1,234.00 dollars." equals 1234). Strict: only a "#### N" answer counts.
  """
  ref = gsm8k_reference(gold)
  text = completion.replace("\u2212", "-")
  if _GSM_MARK in text:
    after = text.rsplit(_GSM_MARK, 1)[1]
    value = parse_number(after)
    if value is not None:
      return float(value == ref)
  if strict:
    return 0.0
  content = last_boxed(text)
  if content is not None and content.strip():
    from math_verify import ExprExtractionConfig
    pred = _boxed_pred(content, timeout_s)
    gold_parsed = _parse(str(ref.numerator) if ref.denominator == 1 else
                         f"{ref.numerator}/{ref.denominator}", [ExprExtractionConfig()], timeout_s)
    return float(bool(pred) and _verify(gold_parsed, pred, timeout_s))
  found = numbers(text)
  return float(bool(found) and parse_number(found[-1]) == ref)


SCORERS = {"math": score_math, "gsm8k": score_gsm8k}


def check(kind: str, gold, completion: str, *, strict: bool, timeout_s: int
          ) -> tuple[float, str | None]:
  """(score, None), or (0.0, why) when the check raised or timed out: the one place that turns
  a verifier's failure into a counted zero."""
  from math_verify.errors import TimeoutException
  try:
    return SCORERS[kind](gold, completion, strict=strict, timeout_s=timeout_s), None
  except TimeoutException:
    return 0.0, f"timed out after {timeout_s} s"
  except Exception as e:  # noqa: BLE001 - any failure of a verifier scores 0 and is counted
    return 0.0, f"{type(e).__name__}: {e}"[:300]


def serve(stdin=None, stdout=None) -> None:
  """The worker: reads one JSON request per line, {"kind", "gold", "completion", "strict",
  "timeout_s"}, and answers each with one line, {"score", "error"}. It checks on its own main
  thread, so math-verify's signal timeouts work; a check that ignores even those is ended by the
  parent, which kills this process."""
  stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
  sys.stdout = sys.stderr  # a library's print must not land in the answers
  import math_verify  # noqa: F401 - load it before saying ready: the parent's deadline is per item
  stdout.write('{"ready": true}\n')
  stdout.flush()
  for line in stdin:
    req = json.loads(line)
    score, error = check(req["kind"], req["gold"], req["completion"], strict=req["strict"],
                         timeout_s=req["timeout_s"])
    stdout.write(json.dumps({"score": score, "error": error}) + "\n")
    stdout.flush()


if __name__ == "__main__":
  serve()
