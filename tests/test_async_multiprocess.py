"""The async rollout queue across processes (issue 39): 2 processes x 4 CPU devices (gloo),
disaggregated, each process running its own producer thread beside its learner."""

import os
import subprocess

import pytest

from conftest import JAXRL, subprocess_env

from jaxrl import config as config_lib
from jaxrl.algorithms import grpo
from jaxrl.train.rundir import read_metrics

K2 = ["optim.lr=1e-30", "eval.every=0", "train.steps=3", "placement.mode=disaggregated",
      "rollout.async_generation=True", "rollout.max_staleness=2"]


def _two_processes(repo_root, init, workdir, port, extra):
  """`jaxrl grpo` with K2 + extra on 2 processes x 4 CPU devices: (outputs, processes)."""
  args = ["grpo", "--config", "configs/grpo_tiny.py:runlocal",
          f"--config.init.checkpoint={init}", "--workdir", workdir,
          *[f"--config.{o}" for o in K2 + extra],
          f"--config.distributed.coordinator_address=127.0.0.1:{port}",
          "--config.distributed.num_processes=2"]
  procs = [subprocess.Popen([JAXRL, *args, f"--config.distributed.process_id={i}"],
                            env=subprocess_env(4), cwd=repo_root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    return [p.communicate(timeout=600)[0] for p in procs], procs
  finally:
    for p in procs:
      p.kill()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, sft_addition, devices):
  """The one-process run on this process's 8 devices that the two-process runs must equal."""
  one = str(tmp_path_factory.mktemp("one"))
  spec = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "configs/grpo_tiny.py:runlocal")
  grpo.run(config_lib.load_config(spec, K2 + [f"init.checkpoint={sft_addition}"]), one,
           out=lambda *a: None)
  return [r for r in read_metrics(one) if "reward/mean" in r]


@pytest.mark.slow
def test_async_k2_on_two_processes_is_the_one_process_run(repo_root, tmp_path, sft_addition,
                                                          free_port, one_process):
  """With frozen weights, k = 2 on 2 processes x 4 devices samples the same groups as on this
  process's 8 devices: rewards, losses and staleness step for step, and neither process
  hangs. Every process makes the same producer decisions (versions by queue position, filters
  on gathered rewards), and on CPU the producer and the learner take turns at points every
  process reaches alike (gloo hangs when two threads run collective programs at once:
  producer.py, "Taking turns"). Measured: equal to the bit (2026-12-03)."""
  two = str(tmp_path / "two")
  outs, procs = _two_processes(repo_root, sft_addition, two, free_port, [])
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  m1 = one_process
  m2 = [r for r in read_metrics(two) if "reward/mean" in r]
  assert [r["step"] for r in m2] == [1, 2, 3]
  assert [r["staleness/max"] for r in m2] == [0.0, 1.0, 2.0]
  assert any(r["reward/std"] > 0 for r in m1)  # groups differ, so equal rewards say something
  for a, b in zip(m1, m2):
    for key in ("reward/mean", "reward/std", "response_length/mean", "staleness/mean",
                "rollout/dropped_stale"):
      assert b[key] == a[key], (a["step"], key)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-9), a["step"]


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True])
def test_partial_rollouts_on_two_processes_switch_together(repo_root, tmp_path, sft_addition,
                                                           free_port, one_process, streaming):
  """Partial rollouts across 2 processes x 4 devices: before every prefill and decode call the
  producers agree on process 0's newest version (one collective over the sampler's devices),
  so no decode program gets shards of two versions and neither process hangs. With frozen
  weights any switch points give the same samples, so the rewards and lengths are the
  one-process synchronous-order run's group for group, and groups stay within k. Streaming
  (rollout.streaming): the units' admissions too are process 0's (whether a unit opens while
  others decode, on its newest version), so both processes run the same decode calls."""
  two = str(tmp_path / "two")
  outs, procs = _two_processes(repo_root, sft_addition, two, free_port,
                               ["rollout.partial_rollouts=True"]
                               + ["rollout.streaming=True"] * streaming)
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  m1 = one_process
  m2 = [r for r in read_metrics(two) if "reward/mean" in r]
  assert [r["step"] for r in m2] == [1, 2, 3]
  for a, b in zip(m1, m2):
    for key in ("reward/mean", "reward/std", "response_length/mean"):
      assert b[key] == a[key], (a["step"], key)
    assert b["staleness/max"] <= 2 and 0.0 <= b["rollout/partial_frac"] <= 1.0
