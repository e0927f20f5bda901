"""The reward registry: built-ins, weighted combination, and errors that name the function."""

import math

import numpy as np
import pytest

from jaxrl.errors import ConfigError
from jaxrl.rewards import (REWARDS, RewardError, RewardSpec, extract_answer, parse_specs,
                           register, score)


def test_exact_match_normalises():
  batch = {"answer": ["1,234", "Paris", "42", "7"]}
  completions = ["1234", "  paris. ", "the answer: 42\nextra", "8"]
  assert REWARDS["exact_match"](completions, batch=batch) == [1.0, 1.0, 1.0, 0.0]
  assert extract_answer("work...\n#### 1,000.") == "1000"


def test_format_length_and_soft_overlong():
  batch = {"completion_length": [10, 96, 112, 128, 200]}
  assert REWARDS["format"](["<a>1</a>", "x"], batch={}, pattern=r"^<a>\d+</a>$") == [1.0, 0.0]
  assert REWARDS["length_penalty"](["x"] * 5, batch=batch, max_tokens=100)[0] == -0.1
  # max 128, buffer 32: <= 96 -> 0; 112 -> (96 - 112) / 32 = -0.5; 128 -> -1; beyond -> -1.
  assert REWARDS["soft_overlong"](["x"] * 5, batch=batch, max_tokens=128, buffer=32) == [
      0.0, 0.0, -0.5, -1.0, -1.0]


def test_weighted_combination_and_stats():
  batch = {"answer": ["3", "4"], "completion_length": [1, 1]}
  specs = parse_specs("exact_match:1.0,format:0.5")
  total, stats = score(specs, ["3", "5"], batch)
  np.testing.assert_allclose(total, [1.5, 0.5])
  assert stats["reward/exact_match"] == 0.5 and stats["timing_s/reward/format"] >= 0


def test_normalize_zscores_each_reward():
  batch = {"answer": ["1", "2", "3", "4"], "completion_length": [1, 2, 3, 4]}
  total, _ = score([RewardSpec("length_penalty", 2.0, {"max_tokens": 4})], ["a"] * 4, batch,
                   normalize=True)
  z = -(np.arange(1, 5) - 2.5) / np.arange(1, 5).std()
  np.testing.assert_allclose(total, 2.0 * z, rtol=1e-6)


def test_errors_name_the_function():
  @register("_test_raises")
  def raises(completions, *, batch, **_):
    raise KeyError("difficulty")

  @register("_test_nan")
  def nan(completions, *, batch, **_):
    return [0.0, math.nan]

  with pytest.raises(RewardError, match=r"'_test_raises' raised KeyError"):
    score([RewardSpec("_test_raises")], ["a", "b"], {})
  with pytest.raises(RewardError, match=r"'_test_nan' returned nan for completion 1"):
    score([RewardSpec("_test_nan")], ["a", "b"], {})
  with pytest.raises(ConfigError, match=r"reward='exact_mach' is not valid\. Did you mean "
                     r"'exact_match'"):
    parse_specs("exact_mach")
  with pytest.raises(ConfigError, match=r"weight 'x' in 'format:x' is not a number"):
    parse_specs("format:x")
