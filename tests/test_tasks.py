"""Built-in tasks: deterministic, disjoint splits, checkers, and noisy demonstrations."""

import pytest

from jaxrl.errors import ConfigError
from jaxrl.tasks import TASKS, extract_answer, get_task, split_of

NAMES = sorted(TASKS)


def test_registry_has_addition_and_a_structurally_different_task():
  assert "addition" in TASKS and {"sort", "reverse"} <= set(TASKS)
  assert get_task("sort").records("train", 1, 0)[0]["prompt"].startswith("sort ")


def test_unknown_task_names_the_valid_ones():
  with pytest.raises(ConfigError, match=r"'additon'.*Did you mean 'addition'.*addition, sort, "
                     r"reverse"):
    get_task("additon")
  with pytest.raises(ConfigError, match="no option 'digits'"):
    get_task("addition", digits=4)


@pytest.mark.parametrize("name", NAMES)
def test_records_are_deterministic_and_seeded(name):
  task = get_task(name)
  a = task.records("train", 50, seed=3)
  assert a == task.records("train", 50, seed=3)
  assert a != task.records("train", 50, seed=4)
  assert all(set(r) == {"prompt", "answer"} for r in a)
  s = task.sft_records("train", 50, seed=3, error_rate=0.2)
  assert s == task.sft_records("train", 50, seed=3, error_rate=0.2)


@pytest.mark.parametrize("name", NAMES)
def test_train_and_test_are_disjoint(name):
  task = get_task(name)
  # Different seeds for the two splits: disjointness must not depend on sharing a seed.
  train = {r["prompt"] for r in task.records("train", 2000, seed=0)}
  test = {r["prompt"] for r in task.records("test", 500, seed=1)}
  assert len(test) > 100 and len(train) > 500
  assert not train & test
  assert {split_of(p) for p in train} == {"train"} and {split_of(p) for p in test} == {"test"}


@pytest.mark.parametrize("name", NAMES)
def test_reference_answers_pass_the_checker_and_corruptions_fail(name):
  task = get_task(name)
  for r in task.records("test", 200, seed=0):
    assert task.check(r["answer"], r["answer"]) == 1.0
  wrong = task.sft_records("test", 200, seed=0, error_rate=1.0)
  right = task.sft_records("test", 200, seed=0, error_rate=0.0)
  assert [w["prompt"] for w in wrong] == [r["prompt"] for r in right]
  assert all(task.check(w["completion"], r["completion"]) == 0.0 for w, r in zip(wrong, right))


def test_answers_are_correct():
  assert get_task("addition").records("train", 1, 0)[0] == {"prompt": "5+48=", "answer": "53"}
  for r in get_task("addition:max_digits=3").records("train", 100, 0):
    a, b = r["prompt"][:-1].split("+")
    assert int(r["answer"]) == int(a) + int(b)
  for r in get_task("sort").records("train", 100, 0):
    digits = r["prompt"].removeprefix("sort ").removesuffix(":")
    assert r["answer"] == "".join(sorted(digits)) and 3 <= len(digits) <= 6
  for r in get_task("reverse").records("train", 100, 0):
    word = r["prompt"].removeprefix("reverse ").removesuffix(":")
    assert r["answer"] == word[::-1]


def test_checker_is_robust_to_trailing_text_but_not_to_wrong_answers():
  check = get_task("addition").check
  assert check("46", "46") == 1.0
  assert check("46  \n", "46") == 1.0
  assert check(" 46<eos><pad><pad>", "46") == 1.0
  assert check("46\n12+3=15", "46") == 1.0  # the model kept going on the next line
  assert check("45", "46") == 0.0
  assert check("461", "46") == 0.0
  assert check("4 6", "46") == 0.0
  assert check("", "46") == 0.0
  assert check("<eos>46", "46") == 0.0
  assert extract_answer("cba <eos>xyz") == "cba"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rate", [0.0, 0.1, 0.3])
def test_error_rate_gives_that_fraction_of_wrong_demos(name, rate):
  task = get_task(name)
  n = 400
  sft = task.sft_records("train", n, seed=5, error_rate=rate)
  ref = task.records("train", n, seed=5)
  wrong = sum(task.check(s["completion"], r["answer"]) == 0.0 for s, r in zip(sft, ref))
  assert wrong == round(rate * n)


@pytest.mark.parametrize("name", NAMES)
def test_systematic_errors_are_the_tasks_one_slip_where_it_applies(name):
  """error_mode="systematic": each prompt where the task's slip applies gets it with
  probability error_rate (a binomial count within 4 standard deviations); every other
  demonstration is right, and every slip is wrong and deterministic."""
  task = get_task(name)
  n, rate = 2000, 0.6
  sft = task.sft_records("train", n, seed=5, error_rate=rate, error_mode="systematic")
  assert sft == task.sft_records("train", n, seed=5, error_rate=rate, error_mode="systematic")
  ref = task.records("train", n, seed=5)
  applies = slipped = 0
  for s, r in zip(sft, ref):
    slip = task.slip(r["prompt"], r["answer"])
    if slip is None:
      assert s["completion"] == r["answer"]
      continue
    applies += 1
    assert task.check(slip, r["answer"]) == 0.0
    if s["completion"] != r["answer"]:
      assert s["completion"] == slip
      slipped += 1
  assert applies > 200
  assert abs(slipped - rate * applies) < 4 * (applies * rate * (1 - rate)) ** 0.5
  none = task.sft_records("train", n, seed=5, error_rate=0.0, error_mode="systematic")
  assert [s["completion"] for s in none] == [r["answer"] for r in ref]


def test_the_slips_are_the_named_mistakes():
  add, srt, rev = get_task("addition"), get_task("sort"), get_task("reverse")
  assert add.slip("17+25=", "42") == "32"  # the carry out of the units dropped
  assert add.slip("12+34=", "46") is None  # no carry: no slip
  assert add.slip("95+7=", "102") == "92"
  assert srt.slip("sort 3133:", "1333") == "13" and srt.slip("sort 312:", "123") is None
  assert rev.slip("reverse abcde:", "edcba") == "ebcda"
  assert rev.slip("reverse abc:", "cba") is None  # the outer swap is the whole reversal


def test_digit_count_is_configurable():
  four = get_task("addition", min_digits=4, max_digits=4).records("train", 50, 0)
  for r in four:
    a, b = r["prompt"][:-1].split("+")
    assert len(a) == len(b) == 4
  short = get_task("addition", max_digits=1).records("test", 30, 0)
  assert all(len(r["prompt"]) == 4 for r in short)  # "d+d="
  default = {len(x) for r in get_task("addition").records("train", 200, 0)
             for x in r["prompt"][:-1].split("+")}
  assert default == {1, 2}
  three = get_task("addition:max_digits=3").records("train", 200, 0)
  assert three == get_task("addition", max_digits=3).records("train", 200, 0)
  assert {len(x) for r in three for x in r["prompt"][:-1].split("+")} == {1, 2, 3}
  pairs = get_task("sort:min_len=2,max_len=2").records("train", 20, 0)
  assert {len(r["answer"]) for r in pairs} == {2}


def test_carry_keeps_only_sums_whose_units_carry():
  carry = get_task("addition:min_digits=2,carry=1").records("test", 300, 0)
  pairs = [tuple(map(int, r["prompt"][:-1].split("+"))) for r in carry]
  assert all(a % 10 + b % 10 >= 10 and a >= 10 and b >= 10 for a, b in pairs)
  assert all(r["answer"] == str(a + b) and split_of(r["prompt"]) == "test"
             for r, (a, b) in zip(carry, pairs))
  # carry=0 is the default: the same draws, so every existing seed keeps its records.
  assert get_task("addition:carry=0").records("train", 50, 3) == get_task(
      "addition").records("train", 50, 3)


@pytest.mark.parametrize("spec,message", [
    ("addition:digits=3", r"task option 'digits=3' in 'addition:digits=3' is not valid.*"
                          r"max_digits, min_digits"),
    ("addition:max_digits=x", r"max_digits takes an integer"),
    ("addition:min_digits=3", r"min_digits=3 and max_digits=2 must satisfy"),
    ("reverse:max_len=0", r"min_len=3 and max_len=0 must satisfy"),
    ("addition:carry=2", r"carry=2 must be 0 \(every sum\) or 1"),
])
def test_bad_task_options_are_config_errors(spec, message):
  with pytest.raises(ConfigError, match=message):
    get_task(spec)


def test_bad_arguments_are_config_errors():
  task = get_task("addition")
  with pytest.raises(ConfigError, match="split='dev'"):
    task.records("dev", 3, 0)
  with pytest.raises(ConfigError, match="error_rate=1.5"):
    task.sft_records("train", 3, 0, error_rate=1.5)
  with pytest.raises(ConfigError, match="error_mode='systemic' is not valid. Did you mean "
                                        "'systematic'"):
    task.sft_records("train", 3, 0, error_rate=0.5, error_mode="systemic")
