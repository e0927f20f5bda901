"""`jaxrl sft` end to end: run directory, exact resume after a real SIGTERM, learning, and
two processes x 4 devices matching one process x 8 devices."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import JAXRL, assert_model_flops_per_token, subprocess_env

from jaxrl import backends, cli
from jaxrl import config as config_lib
from jaxrl.train import Checkpointer, init_train_state, make_optimizer, read_metrics
from jaxrl.train.checkpoint import abstract_state

CONFIG = "configs/sft_tiny.py:runlocal"
STEPS = 24
# Small and fast; every step logged so metrics can be compared step by step.
OVERRIDES = [f"--config.train.steps={STEPS}", "--config.train.log_every=1",
             "--config.train.save_every=8", "--config.eval.every=8"]

# Runs `jaxrl sft` in a subprocess whose data iterator, after `half` batches, touches a marker
# file and then takes 0.5 s per batch: the test sends SIGTERM once it sees the marker, so the
# signal lands mid-run however loaded the machine is.
SLOW_AFTER = r"""
import pathlib, sys, time
import jaxrl.algorithms.sft as sft
marker, half = sys.argv[1], int(sys.argv[2])
real = sft.sft_batches

class Slow:
  def __init__(self, it):
    self.it, self.n = it, 0
  def __iter__(self):
    return self
  def __next__(self):
    self.n += 1
    if self.n > half:
      pathlib.Path(marker).touch()
      time.sleep(0.5)
    return next(self.it)
  def get_state(self):
    return self.it.get_state()
  def set_state(self, state):
    self.it.set_state(state)

sft.sft_batches = lambda *a, **k: Slow(real(*a, **k)) if k.get("shuffle", True) else real(*a, **k)
from jaxrl import cli
cli.main(sys.argv[3:])
"""


def _final_params(workdir, overrides):
  config = config_lib.load_config(CONFIG, overrides)
  cfg = config_lib.model_config(config)
  from jaxrl.parallel import mesh_from_config
  mesh = mesh_from_config(config.mesh)
  tx, _ = make_optimizer(config.optim, config.train.steps)
  _, fresh, shardings = init_train_state(cfg, mesh, tx, seed=config.seed)
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
  state, data_state = ckpt.restore(abstract_state(jax.eval_shape(lambda: fresh), shardings))
  ckpt.close()
  return jax.device_get(state), data_state


def _without_timing(row):
  return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))}


def test_sigterm_then_resume_is_bitwise_equal_to_an_uninterrupted_run(repo_root, tmp_path,
                                                                      devices):
  os.chdir(repo_root)
  full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
  cli.main(["sft", "--config", CONFIG, "--workdir", full, *OVERRIDES])

  marker = tmp_path / "half"
  proc = subprocess.Popen(
      [sys.executable, "-c", SLOW_AFTER, str(marker), str(STEPS // 2), "sft", "--config",
       CONFIG, "--workdir", cut, *OVERRIDES],
      env=subprocess_env(), cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 300
  while not marker.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert marker.exists(), proc.communicate()[0][-3000:]
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert "SIGTERM at step" in out and "checkpoint saved" in out
  cut_summary = json.loads(open(os.path.join(cut, "summary.json")).read())
  stopped = cut_summary["step"]
  assert cut_summary["status"] == "interrupted" and STEPS // 2 < stopped < STEPS
  assert Checkpointer(os.path.join(cut, "checkpoints")).latest_step() == stopped

  cli.main(["sft", "--config", CONFIG, "--workdir", cut, *OVERRIDES])  # resumes
  summary = json.loads(open(os.path.join(cut, "summary.json")).read())
  assert summary["status"] == "completed" and summary["start_step"] == stopped

  a, a_data = _final_params(full, OVERRIDES)
  b, b_data = _final_params(cut, OVERRIDES)
  assert int(a.step) == int(b.step) == STEPS and a_data == b_data
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params,
                                                                             b.opt_state))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bitwise

  ma, mb = read_metrics(full), read_metrics(cut)
  assert [m["step"] for m in mb] == list(range(STEPS + 1))  # each step logged once
  after = [_without_timing(m) for m in ma if m["step"] > stopped]
  assert after and after == [_without_timing(m) for m in mb if m["step"] > stopped]
  assert any("eval/accuracy" in m for m in after)
  # The run directory docs/design.md promises.
  assert json.load(open(os.path.join(full, "config.json")))["train"]["steps"] == STEPS
  assert {"loss", "lr", "grad_norm", "timing_s/step", "perf/tokens_per_s",
          "perf/tflops"} <= set(ma[-1])
  config = config_lib.load_config(CONFIG, [o.removeprefix("--config.") for o in OVERRIDES])
  for m in ma[1:]:  # a forward and a backward per step
    assert_model_flops_per_token(m, config_lib.model_config(config), config.data.seq_len, 3)
  assert os.listdir(os.path.join(full, "tb"))[0].startswith("events.out.tfevents.")
  steps_kept = sorted(int(s) for s in os.listdir(os.path.join(full, "checkpoints"))
                      if s.isdigit())
  assert steps_kept == [8, 16, 24]


def test_rerunning_a_finished_run_trains_nothing(repo_root, tmp_path, devices, capsys):
  os.chdir(repo_root)
  wd = str(tmp_path / "r")
  over = ["--config.train.steps=4", "--config.train.save_every=2", "--config.eval.every=4"]
  cli.main(["sft", "--config", CONFIG, "--workdir", wd, *over])
  n = len(read_metrics(wd))
  first = json.load(open(os.path.join(wd, "summary.json")))
  capsys.readouterr()
  cli.main(["sft", "--config", CONFIG, "--workdir", wd, *over])
  assert "resuming from" in capsys.readouterr().out and len(read_metrics(wd)) == n
  again = json.load(open(os.path.join(wd, "summary.json")))
  assert again["status"] == "completed"
  # The re-run keeps the finished run's numbers (it used to write empty ones).
  assert "eval/accuracy" in first["eval"] and again["eval"] == first["eval"]
  assert again["metrics"]["loss"] == first["metrics"]["loss"]
  # Both files record what the run ran on (jaxrl.backends.describe), the CPU choices included.
  backend = json.load(open(os.path.join(wd, "config.json")))["backend"]
  assert backend == first["backend"] == again["backend"] == backends.describe()
  assert backend["platform"] == "cpu" and backend["attention"].startswith("cpu kernels")
  assert {"allocator", "dots"} <= set(backend)
  # More steps on the same workdir: continues from step 4, and says what changed.
  cli.main(["sft", "--config", CONFIG, "--workdir", wd, *over, "--config.train.steps=6"])
  assert "train.steps: 4 -> 6" in capsys.readouterr().out
  assert read_metrics(wd)[-1]["step"] == 6


def test_bad_sft_config_is_one_sentence(repo_root, tmp_path, capsys):
  os.chdir(repo_root)
  with pytest.raises(SystemExit) as e:
    cli.main(["sft", "--config", CONFIG, "--workdir", str(tmp_path),
              "--config.optim.schedule=linear"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "optim.schedule='linear' is not valid" in err
  with pytest.raises(SystemExit):
    cli.main(["sft", "--config", CONFIG, "--workdir", str(tmp_path),
              "--config.data.error_mode=systemic"])
  err = capsys.readouterr().err.strip()
  assert "data.error_mode='systemic' is not valid. Did you mean 'systematic'?" in err
  with pytest.raises(SystemExit):
    cli.main(["sft", "--config", CONFIG])
  assert "--workdir is required" in capsys.readouterr().err


@pytest.mark.slow
def test_two_processes_match_one_process(repo_root, tmp_path, free_port):
  """2 processes x 4 CPU devices (gloo) train the same run as 1 process x 8 devices."""
  over = ["--config.train.steps=8", "--config.train.log_every=1", "--config.train.save_every=4",
          "--config.eval.every=8", "--config.data.shards=2"]
  one = str(tmp_path / "one")
  res = subprocess.run([JAXRL, "sft", "--config", CONFIG, "--workdir", one, *over],
                       env=subprocess_env(8), cwd=repo_root, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]

  two, port = str(tmp_path / "two"), free_port
  procs = [subprocess.Popen(
      [JAXRL, "sft", "--config", CONFIG, "--workdir", two, *over,
       f"--config.distributed.coordinator_address=127.0.0.1:{port}",
       "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
      env=subprocess_env(4), cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  # Process 0 alone writes the run files; both wrote their data position into checkpoints.
  assert "step 8/8" in outs[0] and "step 8/8" not in outs[1]
  assert sorted(os.listdir(os.path.join(two, "checkpoints", "8", "data"))) == [
      "commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"]
  m1, m2 = read_metrics(one), read_metrics(two)
  assert [m["step"] for m in m1] == [m["step"] for m in m2] == list(range(9))
  for a, b in zip(m1[1:], m2[1:]):
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
  assert m2[-1]["eval/loss"] == pytest.approx(m1[-1]["eval/loss"], rel=1e-5)
  assert m2[-1]["eval/accuracy"] == m1[-1]["eval/accuracy"]
