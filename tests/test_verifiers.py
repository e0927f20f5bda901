"""The math verifiers (jaxrl/rewards/verifiers.py): a table of crafted answers for `math` and
`gsm8k`, lenient and strict, the format rewards, and failed checks that score 0 and are counted
(reward/errors), on the main thread and off it (GRPO's async generation scores in a thread)."""

import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from jaxrl.data import ByteTokenizer
from jaxrl.errors import ConfigError
from jaxrl.rewards import REWARDS, RewardSpec, parse_specs, score, verifiers
from jaxrl.rewards.mathcheck import gsm8k_reference, last_boxed, parse_number

# (reference answer, completion, lenient score, strict score). Strict means `math_strict` (only
# the last \boxed{} counts) and `gsm8k_strict` (only "#### N" counts).
MATH = [
    # equivalent fractions, \frac / \dfrac, decimals against fractions
    ("\\frac{1}{2}", "The answer is \\boxed{\\frac{2}{4}}", 1, 1),
    ("\\frac{1}{2}", "So the answer is $0.5$.", 1, 0),
    ("0.75", "\\boxed{\\dfrac{3}{4}}", 1, 1),
    ("3/4", "Therefore \\boxed{0.75}.", 1, 1),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0, 0),
    # symbolic equality
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1, 1),
    ("(x+1)^2", "Expanding, \\boxed{x^2+2x+1}", 1, 1),
    ("\\pi", "\\boxed{\\pi}", 1, 1),
    # a MATH-style reference: a whole solution ending in \boxed{}
    ("Add them: $1 + 2 = 3$, so \\boxed{3}.", "\\boxed{3}", 1, 1),
    # units, thousands commas, negative numbers
    ("12", "\\boxed{12\\text{ apples}}", 1, 1),
    ("1234", "\\boxed{1,234}", 1, 1),
    ("-3", "The root is \\boxed{-3}", 1, 1),
    ("-3", "\\boxed{3}", 0, 0),
    # wrong and missing answers, empty boxes
    ("7", "\\boxed{8}", 0, 0),
    ("7", "I do not know.", 0, 0),
    ("2", "\\boxed{}", 0, 0),
    # \boxed{} comes first; without one the last number counts
    ("7", "\\boxed{7}, and 8 is wrong", 1, 1),
    ("7", "First 3 apples, then 4 more, so 7", 1, 0),
    ("7", "It is 7, no wait, 8", 0, 0),
]

GSM8K = [
    # the reference's rationale is ignored: only its "#### N" counts
    ("12 + 7 = <<12+7=19>>19\n#### 19", "12 + 7 = 19\n#### 19", 1, 1),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "48 + 24 = 72\n#### 72", 1, 1),
    ("#### 72", "48 + 24 = 72\n#### 71", 0, 0),
    # thousands commas, $, units, a trailing period
    ("It costs 1,234 in all.\n#### 1,234", "#### 1234", 1, 1),
    ("#### 1234", "The total is 1,234.", 1, 0),
    ("#### 18", "She pays $18.", 1, 0),
    ("#### 18", "#### $18.00", 1, 1),
    ("#### 5", "#### 5 apples", 1, 1),
    ("#### 1000", "#### 1,000.", 1, 1),
    # negative numbers (a Unicode minus too)
    ("#### -3", "The change is -3 degrees.", 1, 0),
    ("#### -5", "#### \u22125", 1, 1),
    ("#### -3", "#### 3", 0, 0),
    # wrong and missing answers
    ("#### 42", "I am not sure.", 0, 0),
    ("#### 7", "3 + 4 = 7. Then 7 + 1 = 8", 0, 0),
    ("#### 7", "#### 7\nOr maybe 8", 1, 1),
    # \boxed{} when there is no "####", read by math-verify (so \frac and \$ work)
    ("#### 42", "6 * 7 = \\boxed{42}", 1, 0),
    ("#### 0.5", "\\boxed{\\frac{1}{2}}", 1, 0),
    ("#### 18", "\\boxed{\\$18}", 1, 0),
    # a reference without "####" is its one number
    ("42", "#### 42", 1, 1),
]


@pytest.mark.parametrize("gold,completion,lenient,strict", MATH)
def test_math(gold, completion, lenient, strict):
  batch = {"answer": [gold]}
  got = REWARDS["math"]([completion], batch=batch)
  assert (got, got.errors) == ([float(lenient)], 0)
  got = REWARDS["math_strict"]([completion], batch=batch)
  assert (got, got.errors) == ([float(strict)], 0)


@pytest.mark.parametrize("gold,completion,lenient,strict", GSM8K)
def test_gsm8k(gold, completion, lenient, strict):
  batch = {"answer": [gold]}
  got = REWARDS["gsm8k"]([completion], batch=batch)
  assert (got, got.errors) == ([float(lenient)], 0)
  got = REWARDS["gsm8k_strict"]([completion], batch=batch)
  assert (got, got.errors) == ([float(strict)], 0)


def test_the_table_is_large_and_mixed():
  rows = MATH + GSM8K
  assert len(rows) >= 30
  # right, wrong, and right only when lenient: all three occur in both tables
  for table in (MATH, GSM8K):
    assert {(r[2], r[3]) for r in table} == {(1, 1), (0, 0), (1, 0)}


def test_format_rewards():
  completions = ["so \\boxed{3}", "\\boxed{ }", "3", "x\n#### 3", "####3", "#### three",
                 "a #### 3 mid-line"]
  assert REWARDS["math_format"](completions, batch={}) == [1, 0, 0, 0, 0, 0, 0]
  assert REWARDS["gsm8k_format"](completions, batch={}) == [0, 0, 0, 1, 1, 0, 0]


def test_extraction_helpers():
  assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
  assert last_boxed("\\boxed{1") is None and last_boxed("none") is None
  assert parse_number("about $1,234.50 dollars.") == 1234.5
  assert parse_number("3/4") == 0.75 and parse_number("1/0") is None
  assert gsm8k_reference("a <<2*3=6>>6 b\n#### 1,000") == 1000


# ----------------------------------------------------------------------------- failed checks


def test_an_unreadable_reference_scores_zero_and_is_counted():
  batch = {"answer": ["no number here", "#### 3", "2 or 3"]}
  got = REWARDS["gsm8k"](["#### 3", "#### 3", "#### 3"], batch=batch)
  assert got == [0.0, 1.0, 0.0] and got.errors == 2
  assert "holds no '#### N'" in got.first_error
  got = REWARDS["math"](["\\boxed{1}"], batch={"answer": [""]})
  assert got == [0.0] and got.errors == 1 and "finds no answer" in got.first_error


def test_missing_answer_field_and_bad_timeout_are_config_errors():
  with pytest.raises(ConfigError, match="'answer' field, and these records have none"):
    score([RewardSpec("math")], ["\\boxed{1}"], {"prompt": ["1"]})
  with pytest.raises(ConfigError, match="timeout_s=0 is not valid"):
    REWARDS["gsm8k"](["#### 1"], batch={"answer": ["1"]}, timeout_s=0)


# A completion whose comparison with "5" makes sympy evaluate 10^(10^10): minutes without a
# timeout, in CPython's big-integer power, which only a signal interrupts.
HANG = "\\boxed{10^{10^{10}}}"


def test_math_verify_alone_refuses_threads():
  """Why the verifiers route off-main-thread checks to a worker: math-verify's own timeout is
  signal.alarm, and off the main thread it raises instead of parsing."""
  from math_verify import parse

  def in_thread():
    with pytest.raises(ValueError, match="threaded environment"):
      parse("$1$")
    return True
  with ThreadPoolExecutor(1) as ex:
    assert ex.submit(in_thread).result()


def test_a_timeout_on_the_main_thread_scores_zero_and_is_counted():
  assert threading.current_thread() is threading.main_thread()
  t0 = time.perf_counter()
  got = REWARDS["math"](["\\boxed{5}", HANG, "5"], batch={"answer": ["5"] * 3}, timeout_s=1)
  assert got == [1.0, 0.0, 1.0] and got.errors == 1 and "timed out" in got.first_error
  assert time.perf_counter() - t0 < 30


def test_a_timeout_in_a_thread_scores_zero_and_is_counted():
  """The async GRPO path: scoring in a background thread (like parallel.sync.Overlap's)."""
  with ThreadPoolExecutor(1, thread_name_prefix="jaxrl-sampler") as ex:
    t0 = time.perf_counter()
    got = ex.submit(REWARDS["math"], ["\\boxed{5}", HANG, "so 5"], batch={"answer": ["5"] * 3},
                    timeout_s=1).result()
    assert got == [1.0, 0.0, 1.0] and got.errors == 1 and "timed out" in got.first_error
    assert time.perf_counter() - t0 < 150  # the worker's start included
    gsm = ex.submit(REWARDS["gsm8k"], ["#### 7", "\\boxed{7}"], batch={"answer": ["#### 7"] * 2}
                    ).result()
    assert gsm == [1.0, 1.0] and gsm.errors == 0


def test_a_hung_worker_is_killed_and_restarted():
  """Past its deadline the worker process is killed (whatever it is stuck in) and the next
  item gets a fresh one."""
  def run():
    return verifiers.run_checks("math", ["5", "5"], [HANG, "\\boxed{5}"], strict=False,
                                timeout_s=60, deadline_s=2)
  with ThreadPoolExecutor(1) as ex:
    ex.submit(verifiers.run_checks, "math", ["1"], ["1"], strict=False).result()  # started
    first = verifiers._WORKER.proc.pid
    t0 = time.perf_counter()
    got = ex.submit(run).result()
  assert got == [0.0, 1.0] and got.errors == 1 and "worker was restarted" in got.first_error
  assert time.perf_counter() - t0 < 150
  assert verifiers._WORKER.proc.pid != first


def test_score_adds_up_reward_errors():
  batch = {"answer": ["#### 3", "nothing", "#### 4"], "completion_length": [1, 1, 1]}
  total, stats = score(parse_specs("gsm8k,gsm8k_strict,gsm8k_format:0.5"),
                       ["#### 3", "#### 3", "4"], batch)
  np.testing.assert_allclose(total, [2.5, 0.5, 1.0])  # row 2: its format only
  assert stats["reward/errors"] == 2.0  # the unreadable reference, once per verifier
  assert score(parse_specs("exact_match"), ["3"], {"answer": ["3"]})[1]["reward/errors"] == 0.0


def test_grpo_scoring_logs_reward_errors():
  """GRPO's score_rollout (step 3) carries reward/errors into the step's metrics."""
  from jaxrl.algorithms.grpo.rewards import score_rollout
  tok = ByteTokenizer()
  texts = ["#### 3", "#### 4", "#### 3", "#### 3"]
  ids = [tok.encode(t) for t in texts]
  width = max(map(len, ids))
  rollout = types.SimpleNamespace(
      completion_ids=np.array([i + [0] * (width - len(i)) for i in ids]),
      lengths=np.array([len(i) for i in ids]))
  p = types.SimpleNamespace(
      config=types.SimpleNamespace(rollout=types.SimpleNamespace(group_size=2),
                                   normalize_rewards=False),
      tokenizer=tok, task=None,
      scorer=types.SimpleNamespace(specs=parse_specs("gsm8k"), rms=None, rm_norm=None))
  prompts = [{"prompt": "1+2=", "answer": "1 + 2 = 3\n#### 3"}, {"prompt": "?", "answer": "?"}]
  rewards, stats = score_rollout(p, rollout, prompts)
  np.testing.assert_allclose(rewards, [1.0, 0.0, 0.0, 0.0])
  assert stats["reward/gsm8k"] == 0.25 and stats["reward/errors"] == 2.0
