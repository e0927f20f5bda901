"""Reliability (issue 32): bad input, foreign run dirs, mismatched checkpoints, signals, failed
writes and torn files, each a crafted situation and the exact sentence or behaviour: one
sentence (and the run dir left as it was), never a traceback or a silently wrong model."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import JAXRL, subprocess_env

from jaxrl import cli, launch
from jaxrl import config as config_lib
from jaxrl.data import read_jsonl
from jaxrl.data.hf_tokenizer import HFTokenizer
from jaxrl.errors import ConfigError
from jaxrl.train import Checkpointer, RunDir, read_metrics
from jaxrl.train import checkpoint as checkpoint_lib
from jaxrl.train.loop import resume

# --- run ownership and restore checks

SFT = ["sft", "--config", "configs/sft_tiny.py:runlocal", "--config.train.steps=2",
       "--config.train.save_every=2", "--config.train.log_every=1", "--config.eval.every=0"]


def _fails(capsys, argv) -> str:
  """The one line `jaxrl ARGV` prints on stderr when it exits 2."""
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "Traceback" not in err, err
  assert err.startswith(f"jaxrl {argv[0]}: error: "), err
  return err.split(": error: ", 1)[1]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, devices):
  """A finished 2-step SFT run of the runlocal (2-layer tiny) model: the dir others misuse."""
  d = str(tmp_path_factory.mktemp("sft") / "run")
  cli.main(SFT + ["--workdir", d])
  return d


@pytest.fixture
def sft_copy(sft_run, tmp_path):
  d = str(tmp_path / "run")
  shutil.copytree(sft_run, d)
  return d


def _read(path):
  with open(path, "rb") as f:
    return f.read()


def test_run_json_records_the_command_and_model(sft_run):
  run = json.load(open(os.path.join(sft_run, "run.json")))
  assert run["command"] == "sft"
  assert run["model"]["num_layers"] == 2
  assert run["params"]["embed"][0] == [run["model"]["vocab_size"], run["model"]["embed_dim"]]
  # Which data it trained on: the content hash of the train records (jaxrl.data.prefs).
  assert run["data"].startswith("sha256:") and len(run["data"]) == len("sha256:") + 64


def test_another_command_on_a_run_dir_is_refused_before_writing(capsys, sft_copy):
  before = _read(os.path.join(sft_copy, "config.json"))
  err = _fails(capsys, ["dpo", "--config", "configs/dpo_tiny.py:runlocal", "--workdir", sft_copy])
  assert err == (f"{sft_copy} was written by `jaxrl sft`, not `jaxrl dpo`: use a new "
                 "--workdir.")
  assert _read(os.path.join(sft_copy, "config.json")) == before
  assert not os.path.exists(os.path.join(sft_copy, "summary.json.tmp"))


def test_a_dir_from_before_run_json_is_owned_by_its_config_sections(capsys, sft_copy):
  os.remove(os.path.join(sft_copy, "run.json"))
  before = _read(os.path.join(sft_copy, "config.json"))
  err = _fails(capsys, ["grpo", "--config", "configs/grpo_tiny.py:runlocal",
                        "--workdir", sft_copy])
  assert "was written by `jaxrl sft`, not `jaxrl grpo`: use a new --workdir." in err
  assert _read(os.path.join(sft_copy, "config.json")) == before


def test_a_changed_architecture_on_resume_names_the_field(capsys, sft_copy):
  before = _read(os.path.join(sft_copy, "config.json"))
  embed = json.load(open(os.path.join(sft_copy, "run.json")))["model"]["embed_dim"]
  err = _fails(capsys, SFT + ["--config.model.embed_dim=32", "--workdir", sft_copy])
  assert err == (f"model.embed_dim is {embed} in {sft_copy}'s run, 32 now: drop the "
                 "override or use a new --workdir.")
  assert _read(os.path.join(sft_copy, "config.json")) == before


def test_steps_below_the_checkpoint_are_an_error(capsys, sft_copy):
  before = _read(os.path.join(sft_copy, "config.json"))
  err = _fails(capsys, SFT + ["--config.train.steps=1", "--workdir", sft_copy])
  assert err == (f"train.steps=1 is below step 2 of the latest checkpoint in {sft_copy}: "
                 "pass --config.train.steps=2 or more, or use a new --workdir.")
  assert _read(os.path.join(sft_copy, "config.json")) == before


def test_a_resume_with_overrides_keeps_the_previous_config(capsys, sft_copy):
  before = json.load(open(os.path.join(sft_copy, "config.json")))
  cli.main(SFT + ["--config.train.log_every=2", "--workdir", sft_copy])  # done: nothing to run
  prev = json.load(open(os.path.join(sft_copy, "config.prev.json")))
  assert prev == before and prev["train"]["log_every"] == 1
  assert json.load(open(os.path.join(sft_copy, "config.json")))["train"]["log_every"] == 2


def test_a_resume_with_the_same_config_writes_no_prev(sft_copy):
  cli.main(SFT + ["--workdir", sft_copy])
  assert not os.path.exists(os.path.join(sft_copy, "config.prev.json"))


def _abstract(overrides, layout="learner"):
  from jaxrl.parallel import init_params, mesh_from_config
  config = config_lib.load_config("configs/sft_tiny.py:runlocal", overrides)
  cfg = config_lib.model_config(config)
  _, params = init_params(cfg, mesh_from_config(config.mesh), layout, seed=0)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      params)


def test_init_checkpoint_into_fewer_layers_names_the_tensor(sft_run):
  from jaxrl.io.params import restore_params
  with pytest.raises(ConfigError) as e:
    restore_params(sft_run, _abstract(["--config.model.num_layers=1"]))
  msg = str(e.value)
  assert msg.startswith(f"init.checkpoint={sft_run!r} (step 2): tensor layers.1.")
  assert "has no place in this model: give the model that run trained" in msg


def test_init_checkpoint_with_another_width_names_both_shapes(sft_run):
  from jaxrl.io.params import restore_params
  with pytest.raises(ConfigError) as e:
    restore_params(sft_run, _abstract(["--config.model.mlp_dim=48"]), key="--checkpoint")
  assert "--checkpoint=" in str(e.value) and "has shape [" in str(e.value)
  assert "] there but [" in str(e.value) and "48" in str(e.value)


def test_init_checkpoint_with_another_dtype_is_refused(sft_run):
  from jaxrl.io.params import restore_params
  with pytest.raises(ConfigError, match=r"is float32 there but bfloat16 in this model: set "
                     r"model.param_dtype='float32'"):
    restore_params(sft_run, _abstract(["--config.model.param_dtype=bfloat16"]))


def test_grpo_from_a_run_with_more_layers_is_refused(capsys, sft_run, tmp_path):
  err = _fails(capsys, ["grpo", "--config", "configs/grpo_tiny.py:runlocal",
                        "--config.model.num_layers=1", f"--config.init.checkpoint={sft_run}",
                        "--workdir", str(tmp_path / "grpo")])
  assert err.startswith(f"init.checkpoint={sft_run!r} (step 2): tensor layers.1.")


def test_sample_checkpoint_into_fewer_layers_is_refused(capsys, sft_run, tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "1+1="}\n')
  err = _fails(capsys, ["sample", "--config", "configs/sample_tiny.py",
                        "--config.model.num_layers=1", "--prompts", str(prompts), "--n", "1",
                        "--checkpoint", sft_run, "--workdir", str(tmp_path / "s")])
  assert err.startswith(f"--checkpoint={sft_run!r} (step 2): tensor layers.1.")


def test_hf_path_with_fewer_layers_is_refused(devices):
  from jaxrl.io.hf import params_from_config
  from jaxrl.parallel import mesh_from_config
  config = config_lib.load_config("configs/sft_tiny.py:runlocal", [
      "--config.model.hf_path=tests/fixtures/hf/qwen3", "--config.model.num_layers=1"])
  with pytest.raises(ConfigError) as e:
    params_from_config(config, mesh_from_config(config.mesh))
  assert str(e.value) == (
      "model.num_layers=1 but model.hf_path='tests/fixtures/hf/qwen3' has 2 (its config.json): "
      "drop the model.num_layers override, or the checkpoint's tensors would not fit the model.")


def test_check_structure_names_a_missing_tensor():
  from jaxrl.io.params import check_structure
  saved = {"a": np.zeros((2, 3), np.float32)}
  target = {"a": jax.ShapeDtypeStruct((2, 3), np.float32),
            "b": jax.ShapeDtypeStruct((4,), np.float32)}
  with pytest.raises(ConfigError) as e:
    check_structure(saved, target, where="X", fix="do Y")
  assert str(e.value) == "X: tensor b [4] of this model is not in the checkpoint: do Y."
  check_structure(saved, {"a": target["a"]}, where="X", fix="do Y")  # the same tree passes


def test_sample_into_a_training_run_dir_is_refused(capsys, sft_copy, tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "1+1="}\n')
  before = _read(os.path.join(sft_copy, "config.json"))
  err = _fails(capsys, ["sample", "--config", "configs/sample_tiny.py", "--prompts",
                        str(prompts), "--n", "1", "--workdir", sft_copy])
  assert err == f"{sft_copy} was written by `jaxrl sft`, not `jaxrl sample`: use a new --workdir."
  assert _read(os.path.join(sft_copy, "config.json")) == before


# --- signals, failed writes, metrics written once, old-checkpoint cleanup

SFT_CONFIG = "configs/sft_tiny.py:runlocal"


def _steps(workdir):
  return [r["step"] for r in read_metrics(workdir)]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_launch_forwards_one_sigterm_and_waits(monkeypatch, tmp_path, stop):
  sent = []

  class Proc:
    pid = 4242

    def __init__(self, *a, **k):
      self.polls_after_signal = 0
      os.kill(os.getpid(), stop)  # the user stops the launch (or presses Ctrl-C) as it starts

    def poll(self):
      if sent:
        self.polls_after_signal += 1
      return 0 if self.polls_after_signal > 5 else None  # saving takes a while

    @property
    def returncode(self):
      return self.poll()

    def send_signal(self, sig):
      sent.append(sig)

  monkeypatch.setattr(launch.subprocess, "Popen", Proc)
  run = launch.Run("r0", {}, str(tmp_path / "r0"), ["sft"], {})
  results = launch.run_local([run], poll_s=0.01, out=lambda *_: None)
  assert sent == [signal.SIGTERM]  # one, however long the run takes to save
  assert [r.returncode for r in results] == [0]


def test_torn_metrics_line_is_dropped_and_rows_past_the_checkpoint_truncated(tmp_path):
  run = RunDir(str(tmp_path))
  for s in range(7):
    run.log(s, {"loss": float(s)})
  with open(run.path("metrics.jsonl"), "a") as f:
    f.write('{"step": 7, "lo')  # a kill mid-write
  assert _steps(str(tmp_path)) == list(range(7))  # read_metrics skips the torn line
  run.truncate_metrics(4)
  assert open(run.path("metrics.jsonl")).read().splitlines()[-1] == '{"step": 4, "loss": 4.0}'
  assert _steps(str(tmp_path)) == [0, 1, 2, 3, 4]
  run.close()


def test_restart_without_a_committed_checkpoint_starts_metrics_afresh(tmp_path):
  run = RunDir(str(tmp_path))
  for s in range(5):  # logged by an attempt killed during its first save
    run.log(s, {"loss": 1.0})

  class NoCheckpoint:
    def latest_step(self):
      return None

  state = types.SimpleNamespace(step=np.int32(0))
  assert resume(NoCheckpoint(), state, None, None, run)[1] == 0
  assert read_metrics(str(tmp_path)) == []
  run.close()


def test_old_checkpoints_are_renamed_before_removal_and_leftovers_removed_quietly(
    tmp_path, monkeypatch, caplog):
  directory = tmp_path / "checkpoints"
  state = {"w": jnp.arange(4.0)}
  ckpt = Checkpointer(str(directory), keep=2)
  removed = []
  # A kill during cleanup, frozen: the rename into deleting/ has happened, the removal not.
  monkeypatch.setattr(checkpoint_lib.shutil, "rmtree",
                      lambda p, **k: removed.append(os.path.basename(str(p))))
  for step in (1, 2, 3):
    ckpt.save(step, state, {"pos": step})
  ckpt.close()
  monkeypatch.undo()
  assert sorted(os.listdir(directory)) == ["2", "3", "deleting"]  # step 1 whole, off to one side
  assert removed and set(removed) == {"deleting"}
  (directory / "7.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)  # a kill mid-write
  with caplog.at_level(logging.WARNING):
    ckpt = Checkpointer(str(directory), keep=2)
    assert ckpt.latest_step() == 3
    assert ckpt.restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32)})[1] == {"pos": 3}
    ckpt.close()
  assert sorted(os.listdir(directory)) == ["2", "3"]
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# The sft subprocess of test_sft.py's SIGTERM test, whose final checkpoint wait also takes 2 s,
# so that signals sent after "checkpoint saved" land while the write is still in flight.
SLOW_WAIT = r"""
import time
from jaxrl.train.checkpoint import Checkpointer
real_wait = Checkpointer.wait
def slow_wait(self):
  if self._pending is not None:
    time.sleep(2)
  real_wait(self)
Checkpointer.wait = slow_wait
"""


@pytest.mark.slow
def test_two_sigterms_leave_a_committed_checkpoint_and_summary_then_resume(repo_root, tmp_path,
                                                                           devices):
  from test_sft import SLOW_AFTER
  os.chdir(repo_root)
  steps, workdir = 12, str(tmp_path / "run")
  over = [f"--config.train.steps={steps}", "--config.train.log_every=1",
          "--config.train.save_every=4"]
  marker = tmp_path / "half"
  proc = subprocess.Popen(
      [sys.executable, "-c", SLOW_WAIT + SLOW_AFTER, str(marker), "5", "sft", "--config",
       SFT_CONFIG, "--workdir", workdir, *over],
      env={**subprocess_env(), "PYTHONUNBUFFERED": "1"}, cwd=repo_root,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline, out = time.time() + 300, []
  while not marker.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  for line in proc.stdout:  # until the save is requested and in flight
    out.append(line)
    if "checkpoint saved" in line:
      break
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out.append(proc.communicate(timeout=300)[0])
  out = "".join(out)
  assert proc.returncode == 0, out[-3000:]
  assert out.count("SIGTERM again: ignored while the checkpoint is saved and summary.json "
                   "written (kill -9 abandons them).") == 1
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  stopped = summary["step"]
  assert summary["status"] == "interrupted" and 5 < stopped < steps
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-1] == str(stopped)
  assert not [p for p in os.listdir(os.path.join(workdir, "checkpoints")) if "tmp" in p]

  cli.main(["sft", "--config", SFT_CONFIG, "--workdir", workdir, *over])  # resumes
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["status"] == "completed" and summary["start_step"] == stopped
  assert _steps(workdir) == list(range(steps + 1))


@pytest.mark.slow
def test_torn_metrics_and_an_uncommitted_step_resume_with_every_step_once(repo_root, tmp_path,
                                                                         devices):
  os.chdir(repo_root)
  workdir = str(tmp_path / "run")
  over = ["--config.train.steps=8", "--config.train.log_every=1", "--config.train.save_every=4"]
  cli.main(["sft", "--config", SFT_CONFIG, "--workdir", workdir, *over])
  # As if killed while writing step 8's checkpoint and a metrics row after it.
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write('{"step": 9, "loss": 1.2')
  cli.main(["sft", "--config", SFT_CONFIG, "--workdir", workdir, *over])  # was a JSONDecodeError
  assert json.load(open(os.path.join(workdir, "summary.json")))["start_step"] == 4
  assert _steps(workdir) == list(range(9))


@pytest.fixture
def small_disk(tmp_path):
  """A 8 MiB tmpfs: one checkpoint of the runlocal SFT model (5 MiB) fits, a second does not."""
  mnt = tmp_path / "disk"
  mnt.mkdir()
  res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True)
  if res.returncode != 0:
    pytest.skip("mounting a tmpfs needs root (CI runs as root)")
  yield mnt
  subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_full_disk_stops_in_one_sentence_and_resumes_elsewhere_bitwise(repo_root, tmp_path,
                                                                      devices, small_disk):
  from test_sft import _final_params
  os.chdir(repo_root)
  over = ["--config.train.steps=12", "--config.train.log_every=1", "--config.train.save_every=4"]
  full = str(small_disk / "run")
  res = subprocess.run([JAXRL, "sft", "--config", SFT_CONFIG, "--workdir", full, *over],
                       env=subprocess_env(), cwd=repo_root, capture_output=True, text=True,
                       timeout=600)
  ckdir = os.path.join(full, "checkpoints")
  assert res.returncode == 1, res.stderr[-3000:]
  assert res.stderr.strip() == (
      f"jaxrl sft: writing the checkpoint of step 8 to {ckdir} failed (No space left on "
      f"device): training stopped; the last good checkpoint is step 4 in {ckdir}. Free space "
      "or make the directory writable, then re-run the same command to resume.")
  summary = json.load(open(os.path.join(full, "summary.json")))
  assert summary["status"] == "failed" and "No space left on device" in summary["error"]
  assert Checkpointer(ckdir).latest_step() == 4

  moved = str(tmp_path / "moved")
  shutil.copytree(full, moved)
  cli.main(["sft", "--config", SFT_CONFIG, "--workdir", moved, *over])
  assert json.load(open(os.path.join(moved, "summary.json")))["start_step"] == 4
  assert _steps(moved) == list(range(13))
  assert not [p for p in os.listdir(os.path.join(moved, "checkpoints")) if "tmp" in p]
  clean = str(tmp_path / "clean")
  cli.main(["sft", "--config", SFT_CONFIG, "--workdir", clean, *over])
  a, b = _final_params(clean, over)[0], _final_params(moved, over)[0]
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params,
                                                                             b.opt_state))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bitwise


@pytest.fixture
def read_only(tmp_path):
  """make(path) turns a directory read-only: a read-only bind mount as root (permission bits
  do not stop root), chmod otherwise. Undone at teardown."""
  undo = []

  def make(path):
    if os.geteuid() == 0:
      res = subprocess.run(f"mount --bind {path} {path} && mount -o remount,ro,bind {path}",
                           shell=True, capture_output=True, text=True)
      if res.returncode != 0:
        pytest.skip(f"root without bind mounts ({res.stderr.strip()}): no read-only directory")
      undo.append(lambda: subprocess.run(["umount", "-l", str(path)], check=False))
    else:
      os.chmod(path, 0o555)
      undo.append(lambda: os.chmod(path, 0o755))

  yield make
  for f in reversed(undo):
    f()


@pytest.mark.slow
def test_a_read_only_checkpoint_dir_stops_in_one_sentence_and_keeps_the_last_checkpoint(
    repo_root, tmp_path, devices, read_only):
  """The checkpoint directory turns read-only between two runs of one workdir: the resumed run
  trains from step 4, fails to write step 8, stops with one sentence (what, where, the last good
  checkpoint), exit 1, summary `failed`; step 4 stays whole and a resume elsewhere completes."""
  os.chdir(repo_root)
  over = ["--config.train.log_every=1", "--config.train.save_every=4"]
  workdir = str(tmp_path / "run")
  cli.main(["sft", "--config", SFT_CONFIG, "--workdir", workdir, "--config.train.steps=4",
            *over])
  ckdir = os.path.join(workdir, "checkpoints")
  read_only(ckdir)
  res = subprocess.run([JAXRL, "sft", "--config", SFT_CONFIG, "--workdir", workdir,
                        "--config.train.steps=12", *over],
                       env=subprocess_env(), cwd=repo_root, capture_output=True, text=True,
                       timeout=600)
  assert res.returncode == 1, res.stderr[-3000:]
  assert res.stderr.strip() == (
      f"jaxrl sft: writing the checkpoint of step 8 to {ckdir} failed (Read-only file system): "
      f"training stopped; the last good checkpoint is step 4 in {ckdir}. Free space or make "
      "the directory writable, then re-run the same command to resume.")
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["status"] == "failed" and "Read-only file system" in summary["error"]
  assert Checkpointer(ckdir).latest_step() == 4
  moved = str(tmp_path / "moved")
  shutil.copytree(workdir, moved)
  cli.main(["sft", "--config", SFT_CONFIG, "--workdir", moved, "--config.train.steps=12", *over])
  assert json.load(open(os.path.join(moved, "summary.json")))["start_step"] == 4
  assert _steps(moved) == list(range(13))


# Freezes `jaxrl sft` mid-way through writing step 8's checkpoint (or, with "cleanup", mid-way
# through removing an old step), after touching a marker: the test then sends kill -9.
FREEZE = r"""
import pathlib, sys, time
from jaxrl.train import checkpoint
marker, where = sys.argv[1], sys.argv[2]
def freeze():
  pathlib.Path(marker).touch()
  time.sleep(600)
if where == "write":
  real_save = checkpoint.DataStateHandler.save
  def save(self, directory, args):
    if args.state and "8.orbax-checkpoint-tmp" in str(directory):
      freeze()
    real_save(self, directory, args)
  checkpoint.DataStateHandler.save = save
else:
  real_rmtree = checkpoint.shutil.rmtree
  def rmtree(path, **k):
    if str(path).endswith("deleting") and pathlib.Path(path).exists():
      freeze()
    real_rmtree(path, **k)
  checkpoint.shutil.rmtree = rmtree
from jaxrl import cli
cli.main(sys.argv[3:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["write", "cleanup"])
def test_kill_9_mid_checkpoint_then_resume_is_bitwise_with_unique_metrics(repo_root, tmp_path,
                                                                          devices, where):
  from test_sft import _final_params
  os.chdir(repo_root)
  over = ["--config.train.steps=12", "--config.train.log_every=1", "--config.train.save_every=4",
          "--config.train.keep_checkpoints=1"]
  killed, marker = str(tmp_path / "killed"), tmp_path / "frozen"
  proc = subprocess.Popen([sys.executable, "-c", FREEZE, str(marker), where, "sft", "--config",
                           SFT_CONFIG, "--workdir", killed, *over],
                          env=subprocess_env(), cwd=repo_root, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 300
  while not marker.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert marker.exists(), proc.communicate()[0][-3000:]
  proc.kill()
  proc.wait()
  left = os.listdir(os.path.join(killed, "checkpoints"))
  assert ("deleting" in left) if where == "cleanup" else any("tmp" in p for p in left), left

  cli.main(["sft", "--config", SFT_CONFIG, "--workdir", killed, *over])
  assert sorted(os.listdir(os.path.join(killed, "checkpoints"))) == ["12"]
  assert _steps(killed) == list(range(13))
  clean = str(tmp_path / "clean")
  cli.main(["sft", "--config", SFT_CONFIG, "--workdir", clean, *over])
  a, b = _final_params(clean, over)[0], _final_params(killed, over)[0]
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params,
                                                                             b.opt_state))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bitwise


# --- config values and file errors (probe cases 6 and 7)


def _load(repo_root, spec, overrides, command):
  return config_lib.load_config(os.path.join(repo_root, "configs", spec), overrides,
                                cli.trainer(command).CHOICES)


@pytest.mark.parametrize("command, spec, override, sentence", [
    ("sft", "sft_tiny.py", "train.steps=0",
     "train.steps=0 must be at least 1: set --config.train.steps to 1 or more."),
    ("sft", "sft_tiny.py", "train.steps=-5",
     "train.steps=-5 must be at least 1: set --config.train.steps to 1 or more."),
    ("sft", "sft_tiny.py", "train.save_every=0",
     "train.save_every=0 must be at least 1: set --config.train.save_every to 1 or more."),
    ("dpo", "dpo_tiny.py", "train.log_every=0",
     "train.log_every=0 must be at least 1: set --config.train.log_every to 1 or more."),
    ("rm", "rm_tiny.py", "eval.every=-1",
     "eval.every=-1 must be at least 0: set --config.eval.every to 0 or more."),
    ("sft", "sft_tiny.py", "data.batch_size=0",
     "data.batch_size=0 must be at least 1: set --config.data.batch_size to 1 or more."),
    ("rm", "rm_tiny.py", "data.seq_len=0",
     "data.seq_len=0 must be at least 1: set --config.data.seq_len to 1 or more."),
    ("dpo", "dpo_tiny.py", "ref.batch_size=0",
     "ref.batch_size=0 must be at least 1: set --config.ref.batch_size to 1 or more."),
    ("sft", "sft_tiny.py", "eval.batch_size=0",
     "eval.batch_size=0 must be at least 1: set --config.eval.batch_size to 1 or more."),
    ("sft", "sft_tiny.py", "eval.max_new_tokens=0",
     "eval.max_new_tokens=0 must be at least 1: set --config.eval.max_new_tokens to 1 or "
     "more."),
    ("sft", "sft_tiny.py", "optim.lr=0",
     "optim.lr=0.0 must be positive: set e.g. --config.optim.lr=1e-3."),
    ("dpo", "dpo_tiny.py", "optim.lr=-1e-5",
     "optim.lr=-1e-05 must be positive: set e.g. --config.optim.lr=1e-3."),
    ("grpo", "grpo_tiny.py", "optim.accum_steps=0",
     "optim.accum_steps=0 must be at least 1: set --config.optim.accum_steps to 1 or more."),
    ("grpo", "grpo_tiny.py", "rollout.group_size=1",
     "rollout.group_size=1 is too small for algo.advantage='grpo', which compares each "
     "completion with the others of its group: set --config.rollout.group_size to 2 or more "
     "(or use algo.advantage=reinforce_pp, which needs no group)."),
    ("grpo", "grpo_tiny.py", "rollout.group_size=0",
     "rollout.group_size=0 must be at least 1: set --config.rollout.group_size to 1 or more."),
    ("grpo", "grpo_tiny.py", "rollout.prompts_per_step=0",
     "rollout.prompts_per_step=0 must be at least 1: set --config.rollout.prompts_per_step "
     "to 1 or more."),
    ("grpo", "grpo_tiny.py", "rollout.max_new_tokens=0",
     "rollout.max_new_tokens=0 must be at least 1: set --config.rollout.max_new_tokens to 1 "
     "or more."),
    ("grpo", "grpo_tiny.py", "rollout.temperature=0",
     "rollout.temperature=0.0 must be positive: set e.g. --config.rollout.temperature=1.0."),
    ("grpo", "grpo_tiny.py", "rollout.top_p=0",
     "rollout.top_p=0.0 must be in (0, 1]: 1.0 turns it off."),
    ("grpo", "grpo_tiny.py", "rollout.top_p=1.5",
     "rollout.top_p=1.5 must be in (0, 1]: 1.0 turns it off."),
    ("grpo", "grpo_tiny.py", "rollout.page_size=0",
     "rollout.page_size=0 must be at least 1: set --config.rollout.page_size to 1 or more."),
    ("grpo", "grpo_tiny.py", "rollout.kv_admission=eager",
     "rollout.kv_admission='eager' is not valid. Choose one of: optimistic, reserve."),
    ("grpo", "grpo_tiny.py", "algo.minibatches=0",
     "algo.minibatches=0 must be at least 1: set --config.algo.minibatches to 1 or more."),
    ("grpo", "grpo_tiny.py", "algo.num_iterations=0",
     "algo.num_iterations=0 must be at least 1: set --config.algo.num_iterations to 1 or more."),
    ("grpo", "grpo_tiny.py", "algo.beta=-0.1",
     "algo.beta=-0.1 must be at least 0: set --config.algo.beta to 0 or more."),
])
def test_numeric_fields_are_checked_at_load(repo_root, command, spec, override, sentence):
  with pytest.raises(ConfigError) as e:
    _load(repo_root, spec, [override], command)
  assert str(e.value) == sentence


@pytest.mark.parametrize("advantage", ["dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_relative_advantages_need_two_completions(repo_root, advantage):
  with pytest.raises(ConfigError, match=f"algo.advantage={advantage!r}"):
    _load(repo_root, "grpo_tiny.py", ["rollout.group_size=1", f"algo.advantage={advantage}"],
          "grpo")


def test_limits_are_inclusive(repo_root):
  """The boundary values stay valid: one step, eval off, a group of one without a group
  baseline, top_p 1."""
  _load(repo_root, "sft_tiny.py", ["train.steps=1", "train.log_every=1", "train.save_every=1",
                                   "eval.every=0", "data.batch_size=1"], "sft")
  _load(repo_root, "grpo_tiny.py", ["rollout.group_size=1", "algo.advantage=reinforce_pp",
                                    "rollout.top_p=1.0", "rollout.max_new_tokens=1"], "grpo")


def test_a_config_for_another_command_names_it(repo_root, capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(repo_root)
  with pytest.raises(SystemExit) as e:
    cli.main(["sft", "--config", "configs/grpo_tiny.py:runlocal",
              "--workdir", str(tmp_path / "run")])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip() == (
      "jaxrl sft: error: this config (configs/grpo_tiny.py) has sections alarm, algo, env_module, "
      "init, normalize_rewards, reward_kwargs, reward_model, rewards, rollout that `jaxrl sft` "
      "does not read: it looks like a `jaxrl grpo` config; run `jaxrl grpo`.")
  assert not (tmp_path / "run").exists()  # refused before the run dir is made


def test_an_unknown_section_is_named(repo_root, capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(repo_root)
  with pytest.raises(SystemExit):
    cli.main(["sft", "--config", "configs/sample_tiny.py", "--workdir", str(tmp_path / "run")])
  assert capsys.readouterr().err.strip() == (
      "jaxrl sft: error: this config (configs/sample_tiny.py) has section sampling that "
      "`jaxrl sft` does not read: remove it, or start from the config of `jaxrl sft` "
      "(configs/sft_tiny.py).")



def test_a_config_missing_the_commands_sections_names_the_command_it_is_for(
    repo_root, capsys, tmp_path, monkeypatch):
  """An SFT config given to `jaxrl grpo` lacks GRPO's sections: one sentence, not the
  AttributeError ('placement') it raised before."""
  monkeypatch.chdir(repo_root)
  with pytest.raises(SystemExit) as e:
    cli.main(["grpo", "--config", "configs/sft_tiny.py", "--workdir", str(tmp_path / "run")])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip() == (
      "jaxrl grpo: error: this config (configs/sft_tiny.py) lacks sections alarm, algo, "
      "env_module, init, normalize_rewards, placement, reward_kwargs, reward_model, rewards, "
      "rollout, which `jaxrl grpo` reads: it looks like a `jaxrl sft` config; run `jaxrl sft`.")
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["launch", "sweep"])
def test_launch_and_sweep_check_the_sections_before_any_run(repo_root, capsys, tmp_path,
                                                            monkeypatch, command):
  """`jaxrl launch` and `jaxrl sweep` refuse a config for another command before starting
  anything, as the trainer itself would (one sentence, with the sweep run it concerns)."""
  monkeypatch.chdir(repo_root)
  root = tmp_path / "exp"
  with pytest.raises(SystemExit) as e:
    cli.main([command, "--config", "configs/grpo_tiny.py", "--command", "sft",
              "--workdir", str(root)])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip() == (
      f"jaxrl {command}: error: sweep run 0 ({{}}): this config (configs/grpo_tiny.py) has "
      "sections alarm, algo, env_module, init, normalize_rewards, reward_kwargs, reward_model, "
      "rewards, rollout that `jaxrl sft` does not read: it looks like a `jaxrl grpo` config; run "
      "`jaxrl grpo`.")
  assert not root.exists()  # nothing launched, nothing written


def test_a_notebook_run_checks_the_sections_too(repo_root, tmp_path):
  """The trainers' Python entry points (what a notebook calls) check the sections before the
  run dir is made, as the CLI does."""
  from jaxrl.algorithms import grpo
  from jaxrl.algorithms import sft
  config = config_lib.load_config(os.path.join(repo_root, "configs", "sft_tiny.py"))
  with pytest.raises(ConfigError) as e:
    grpo.run(config, str(tmp_path / "grpo"))
  assert str(e.value) == (
      "this config lacks sections alarm, algo, env_module, init, normalize_rewards, placement, "
      "reward_kwargs, reward_model, rewards, rollout, which `jaxrl grpo` reads: start from the "
      "config of `jaxrl grpo` (configs/grpo_tiny.py).")
  config = config_lib.load_config(os.path.join(repo_root, "configs", "grpo_tiny.py"))
  with pytest.raises(ConfigError, match="has sections alarm, algo, .* that `jaxrl sft` does "
                     r"not read: remove them, or start from the config of `jaxrl sft`"):
    sft.run(config, str(tmp_path / "sft"))
  assert not (tmp_path / "grpo").exists() and not (tmp_path / "sft").exists()

def test_a_data_file_that_is_not_utf8_names_the_line(tmp_path):
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(b'{"prompt": "1+1=", "completion": "2"}\n'
                   b'{"prompt": "caf\xe9", "completion": "1"}\n')
  with pytest.raises(ConfigError) as e:
    read_jsonl(str(path), "sft")
  assert str(e.value) == (f"{path} line 2 is not UTF-8 text (byte 0xe9 at byte 16 of the "
                          "line): save it as UTF-8.")


def test_a_utf8_bom_is_accepted(tmp_path):
  path = tmp_path / "bom.jsonl"
  path.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "completion": "2"}\n')
  records, skipped = read_jsonl(str(path), "sft")
  assert [dict(r) for r in records] == [{"prompt": "1+1=", "completion": "2"}] and not skipped


def test_an_empty_data_file_is_named(tmp_path):
  path = tmp_path / "empty.jsonl"
  path.write_text("\n\n")
  with pytest.raises(ConfigError) as e:
    read_jsonl(str(path), "rl")
  assert str(e.value) == f"data file {path} is empty: write one JSON object per line into it."


def test_a_directory_is_not_called_missing(tmp_path):
  with pytest.raises(ConfigError) as e:
    read_jsonl(str(tmp_path), "prefs")
  assert str(e.value) == (f"data file {str(tmp_path)!r} is a directory, not a file: give the "
                          "path of a JSONL file (e.g. one inside it).")


def test_the_sample_prompts_file_gets_the_same_sentences(tmp_path):
  """`jaxrl sample --prompts`: a BOM is read, bytes that are not UTF-8 and a directory are named
  (before: UnicodeDecodeError, a refused BOM, a directory called "does not exist")."""
  from jaxrl.sampler.command import read_prompts
  bom = tmp_path / "bom.jsonl"
  bom.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1="}\n')
  assert read_prompts(str(bom)) == [{"prompt": "1+1="}]
  latin1 = tmp_path / "latin1.jsonl"
  latin1.write_bytes(b'{"prompt": "caf\xe9"}\n')
  with pytest.raises(ConfigError) as e:
    read_prompts(str(latin1))
  assert str(e.value) == (f"{latin1} line 1 is not UTF-8 text (byte 0xe9 at byte 16 of the "
                          "line): save it as UTF-8.")
  with pytest.raises(ConfigError) as e:
    read_prompts(str(tmp_path))
  assert str(e.value) == (f"prompts file {str(tmp_path)!r} is a directory, not a file: give the "
                          "path of a JSONL file with one object like {\"prompt\": \"2+2=\"} or "
                          "{\"messages\": [{\"role\": \"user\", \"content\": \"2+2=\"}]} a "
                          "line (e.g. one inside it).")


@pytest.mark.parametrize("key", ["max_new_tokens", "n", "slots", "steps_per_call"])
def test_the_sampling_sections_counts_are_checked_at_load(repo_root, key):
  """`jaxrl sample`'s own numbers get the trainers' range sentence at load (before, nothing
  checked them there)."""
  from jaxrl.sampler import command
  with pytest.raises(ConfigError) as e:
    config_lib.load_config(os.path.join(repo_root, "configs", "sample_tiny.py"),
                           [f"sampling.{key}=0"], command.CHOICES)
  assert str(e.value) == (f"sampling.{key}=0 must be at least 1: set --config.sampling.{key} "
                          "to 1 or more.")


def test_a_trainer_names_a_bad_data_file(repo_root, capsys, tmp_path, monkeypatch):
  """Through the console-script path: one line on stderr, exit 2, no traceback."""
  monkeypatch.chdir(repo_root)
  path = tmp_path / "train.jsonl"
  path.write_bytes(b'{"prompt": "\xff", "completion": "2"}\n')
  with pytest.raises(SystemExit) as e:
    cli.main(["sft", "--config", "configs/sft_tiny.py:runlocal",
              f"--config.data.train_file={path}", "--workdir", str(tmp_path / "run")])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip().endswith(
      f"{path} line 1 is not UTF-8 text (byte 0xff at byte 13 of the line): save it as UTF-8.")


@pytest.fixture
def hf_copy(repo_root, tmp_path):
  """A copy of the Qwen3 fixture to damage."""
  dst = tmp_path / "qwen3"
  shutil.copytree(os.path.join(repo_root, "tests/fixtures/hf/qwen3"), dst)
  return dst


def test_a_corrupt_config_json_is_named(hf_copy, repo_root):
  (hf_copy / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM", ')
  with pytest.raises(ConfigError) as e:
    config_lib.load_config(os.path.join(repo_root, "configs/sft_tiny.py"),
                           [f"model.hf_path={hf_copy}"])
  assert str(e.value) == (f"{hf_copy}/config.json is not valid JSON (Expecting value at line 1 "
                          "column 40): the checkpoint is damaged or partly downloaded: download "
                          "it again.")


def test_a_corrupt_tokenizer_json_is_named(hf_copy):
  text = (hf_copy / "tokenizer.json").read_text()
  (hf_copy / "tokenizer.json").write_text(text[:len(text) // 2])
  with pytest.raises(ConfigError) as e:
    HFTokenizer(str(hf_copy))
  message = str(e.value)
  assert message.startswith(f"{hf_copy}/tokenizer.json could not be read as a Hugging Face "
                            "tokenizer (")
  assert message.endswith("): the checkpoint is damaged or partly downloaded: download it "
                          "again.") and "\n" not in message


def test_a_truncated_safetensors_is_named(hf_copy, devices):
  from jaxrl.io import hf
  from jaxrl.parallel import mesh_from_config
  weights = hf_copy / "model.safetensors"
  with open(weights, "r+b") as f:
    f.truncate(weights.stat().st_size // 2)
  with pytest.raises(ConfigError) as e:
    hf.load_hf(str(hf_copy), mesh_from_config(config_lib.base_config().mesh))
  assert str(e.value) == (
      f"{weights} could not be read as safetensors (Error while deserializing header: "
      "incomplete metadata, file not fully covered): the checkpoint is damaged or partly "
      "downloaded: download it again.")


def test_a_chat_template_refused_by_the_sandbox_is_one_sentence(hf_copy):
  cfg = json.loads((hf_copy / "tokenizer_config.json").read_text())
  cfg["chat_template"] = "{{ messages.__class__.__mro__ }}"
  (hf_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
  with pytest.raises(ConfigError) as e:
    HFTokenizer(str(hf_copy)).apply_chat_template([{"role": "user", "content": "hi"}])
  assert str(e.value) == (
      f"the chat template of {hf_copy} was refused by the sandbox (access to attribute "
      "'__class__' of 'list' object is unsafe): templates may not reach Python internals; use "
      "the checkpoint's own chat template.")


def test_a_workdir_that_is_a_file(tmp_path):
  path = tmp_path / "notadir"
  path.write_text("")
  with pytest.raises(ConfigError) as e:
    RunDir(str(path))
  assert str(e.value) == (f"--workdir {path} is a file, not a directory: give a directory (a "
                          "new one starts a run; a run's directory resumes it).")


def test_a_read_only_workdir(tmp_path):
  """On a read-only tmpfs where mounting is allowed (root; as root, permission bits do not
  stop writes), else on a directory without write permission."""
  ro = tmp_path / "ro"
  ro.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                           capture_output=True).returncode == 0
  if not mounted:
    if os.geteuid() == 0:
      pytest.skip("root without mount: no read-only directory to try")
    ro.chmod(0o555)
  try:
    for workdir in (ro, ro / "run"):
      with pytest.raises(ConfigError) as e:
        RunDir(str(workdir))
      assert str(e.value).startswith(f"--workdir {workdir} cannot be written (")
      assert str(e.value).endswith("): give a directory you can write to.")
  finally:
    if mounted:
      subprocess.run(["umount", str(ro)], check=True)
    ro.chmod(0o755)
