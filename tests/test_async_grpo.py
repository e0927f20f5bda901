"""Async GRPO end to end on the tiny config (disaggregated, 4 + 4 CPU devices): the rollout
queue with max_staleness k = 2 against the synchronous run, dynamic sampling in async mode, and
a resume mid-queue. The queue's rules themselves: tests/test_async_queue.py."""

import json
import os

import pytest

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.algorithms import grpo
from jaxrl.train.rundir import read_metrics

FROZEN = ["optim.lr=1e-30", "eval.every=0", "placement.mode=disaggregated"]
QUEUE_METRICS = ("staleness/mean", "staleness/max", "rollout/queue_len",
                 "rollout/dropped_stale", "timing_s/gen_wait", "perf/sampler_busy")


def _run(repo_root, workdir, overrides, **edits):
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  config = config_lib.load_config(spec, overrides)
  for key, value in edits.items():
    setattr(config, key, value)
  return grpo.run(config, str(workdir), out=lambda *a: None)


def _rows(workdir):
  return [r for r in read_metrics(str(workdir)) if "reward/mean" in r]


@pytest.mark.slow
def test_async_k2_with_frozen_weights_is_the_synchronous_run(repo_root, tmp_path, devices):
  """With the weights frozen, a k = 2 run samples step n with version n - 2's weights, which
  are the same weights: its rewards are the synchronous run's group for group (the logged
  means, and the loss, which reads every group's advantages), staleness is min(n, 2) and never
  above k. With partial rollouts too (newer weights between decode calls: the same values), and
  with streaming on top (the next unit's groups in the slots a unit frees: the same groups)."""
  common = FROZEN + ["train.steps=3"]
  _run(repo_root, tmp_path / "sync", common)
  _run(repo_root, tmp_path / "k2", common + ["rollout.async_generation=True",
                                            "rollout.max_staleness=2"])
  _run(repo_root, tmp_path / "k2p", common + ["rollout.async_generation=True",
                                             "rollout.max_staleness=2",
                                             "rollout.partial_rollouts=True"])
  _run(repo_root, tmp_path / "k2ps", common + ["rollout.async_generation=True",
                                              "rollout.max_staleness=2",
                                              "rollout.partial_rollouts=True",
                                              "rollout.streaming=True"])
  sync, k2 = _rows(tmp_path / "sync"), _rows(tmp_path / "k2")
  partial, streamed = _rows(tmp_path / "k2p"), _rows(tmp_path / "k2ps")
  assert len(streamed) == len(sync) == 3
  for s, a in [*zip(sync, partial), *zip(sync, streamed)]:
    for key in ("reward/mean", "reward/std", "response_length/mean", "loss"):
      assert a[key] == pytest.approx(s[key], rel=1e-5), (a["step"], key)
    assert a["staleness/max"] <= 2 and 0.0 <= a["rollout/partial_frac"] <= 1.0
  assert [r["step"] for r in k2] == [1, 2, 3]
  assert [r["staleness/mean"] for r in k2] == [0.0, 1.0, 2.0]
  assert all(r["staleness/max"] <= 2 for r in k2)
  for s, a in zip(sync, k2):
    for key in ("reward/mean", "reward/std", "accuracy", "response_length/mean", "loss"):
      assert a[key] == pytest.approx(s[key], rel=1e-5), (a["step"], key)
    for key in QUEUE_METRICS:
      assert key in a, key
    assert a["rollout/dropped_stale"] == 0 and 0.0 <= a["perf/sampler_busy"] <= 1.0
    assert a["rollout/queue_len"] <= 2 * 4  # k x B groups at most wait behind a step's
  # The producer ran ahead: by the last step the sampler had idled less than it worked.
  assert sum(r["timing_s/gen_wait"] for r in k2[1:]) < sum(r["timing_s/gen"] for r in k2[1:])


@pytest.mark.slow
def test_async_dynamic_sampling_refills_and_resumes_mid_queue(repo_root, tmp_path, devices):
  """Dynamic sampling in async mode (k = 2): every step trains on B groups of varied rewards
  (the producer samples more prompts: no step falls back on equal groups), and a run stopped
  after step 2 and resumed reaches step 3 with the same rewards as the uninterrupted run
  (frozen weights: the regenerated in-flight groups are the same groups). The reward is a
  format check the untrained model passes about half the time, so groups vary."""
  common = FROZEN + ["rollout.async_generation=True", "rollout.max_staleness=2",
                     "algo.filter_zero_std=True", "algo.max_refill_rounds=6",
                     "train.save_every=2", "rewards=format"]
  edits = {"reward_kwargs": {"format": {"pattern": r"^[\x00-\x7f]"}}}
  _run(repo_root, tmp_path / "whole", common + ["train.steps=3"], **edits)
  whole = _rows(tmp_path / "whole")
  assert any(r["frac_zero_std_groups"] > 0 for r in whole)  # there was something to refill
  for r in whole:
    assert r["rollout/zero_std_taken"] == 0.0 and r["staleness/max"] <= 2
  part = tmp_path / "part"
  _run(repo_root, part, common + ["train.steps=2"], **edits)
  saved = json.load(open(part / "checkpoints" / "2" / "data" / "process_0-of-1.json"))
  assert {"unit", "skip"} <= set(saved)
  summary = _run(repo_root, part, common + ["train.steps=3"], **edits)
  assert summary["step"] == 3
  resumed = _rows(part)
  assert [r["step"] for r in resumed] == [1, 2, 3]
  for a, b in zip(whole, resumed):
    for key in ("reward/mean", "reward/std", "loss"):
      assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)


def test_streaming_without_partial_rollouts_is_one_sentence(repo_root, tmp_path):
  with pytest.raises(ConfigError, match=r"rollout.streaming=True admits the next unit's groups "
                     r".* set rollout.async_generation=True and rollout.partial_rollouts=True"):
    _run(repo_root, tmp_path / "x", ["rollout.streaming=True", "rollout.async_generation=True",
                                     "placement.mode=disaggregated"])


def test_max_staleness_without_async_is_one_sentence(repo_root, tmp_path):
  with pytest.raises(ConfigError, match=r"rollout.max_staleness=2 bounds async generation, "
                     r"which is off: set rollout.async_generation=True"):
    _run(repo_root, tmp_path / "x", ["rollout.max_staleness=2"])
