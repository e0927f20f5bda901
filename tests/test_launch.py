"""jaxrl launch (sweep -> runs, each with its workdir and resolved config; local, TPU, XManager),
jaxrl compare and jaxrl plot."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl import cli, launch
from jaxrl.errors import ConfigError
from jaxrl.plot import STANDARD, compare_table, plot_standard, run_dirs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT = os.path.join(ROOT, "configs", "sft_tiny.py")


def test_sweep_expands_into_runs_with_their_own_workdir_and_config(tmp_path):
  runs = launch.expand(f"{SFT}:runlocal", command="sft", root=str(tmp_path),
                       overrides=["--config.train.steps=7"])
  assert [r.name for r in runs] == ["000-lr=0.003", "001-lr=0.001"]
  assert [r.workdir for r in runs] == [str(tmp_path / "000-lr=0.003"),
                                       str(tmp_path / "001-lr=0.001")]
  assert runs[1].argv == ["sft", "--config", f"{SFT}:runlocal", "--config.train.steps=7",
                          "--config.optim.lr=0.001", "--workdir", str(tmp_path / "001-lr=0.001")]
  assert [r.config["optim"]["lr"] for r in runs] == [3e-3, 1e-3]
  assert all(r.config["train"]["steps"] == 7 for r in runs)  # runlocal + the override
  launch.write_experiment(runs, str(tmp_path), f"{SFT}:runlocal")
  assert json.loads((tmp_path / "001-lr=0.001" / "config.json").read_text()) == runs[1].config
  exp = json.loads((tmp_path / "experiment.json").read_text())
  assert [r["overrides"] for r in exp["runs"]] == [{"optim.lr": 3e-3}, {"optim.lr": 1e-3}]
  # Without --sweep: one run of the config as it is.
  (one,) = launch.expand(SFT, command="sft", root="r", sweep=False)
  assert one.name == "000" and one.workdir == os.path.join("r", "000")


def test_a_bad_sweep_run_fails_before_anything_starts(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("from jaxrl.algorithms.sft import default_config\n"
                 "def get_config():\n  return default_config()\n"
                 "def sweep():\n  yield {'optim.lr': 1e-3}\n  yield {'optim.lrr': 1e-4}\n")
  with pytest.raises(ConfigError, match=r"sweep run 1 .*no key 'lrr' in optim\. Did you mean "
                     r"'optim.lr'\?"):
    launch.expand(str(bad), command="sft", root=str(tmp_path / "x"))
  with pytest.raises(ConfigError, match=r"--command 'model'"):
    launch.expand(SFT, command="model", root="x")


def test_launch_dry_run_writes_nothing(tmp_path, capsys):
  cli.main(["launch", "--config", f"{SFT}:runlocal", "--sweep", "--workdir", str(tmp_path / "e"),
            "--dry-run"])
  out = capsys.readouterr().out
  assert "experiment 'e': 2 run(s) of `jaxrl sft`" in out
  assert f"jaxrl sft --config {SFT}:runlocal --config.optim.lr=0.003 --workdir " in out
  assert "2 run(s) (dry run: nothing launched, nothing written)" in out
  assert not (tmp_path / "e").exists()


def test_launch_on_a_tpu_prints_the_gcloud_commands(capfd):
  with pytest.raises(SystemExit) as e:
    cli.main(["launch", "--config", f"{SFT}:runlocal", "--sweep", "--workdir", "gs://bkt/exp",
              "--tpu", "pod", "--zone", "us-central2-b", "--accelerator-type", "v4-32",
              "--dry-run"])
  assert e.value.code == 0
  lines = capfd.readouterr().out.splitlines()
  gcloud = [l for l in lines if l.startswith("gcloud ")]
  # setup.sh once (the bucket of the gs:// workdir mounted), then run.sh per run.
  assert gcloud[1].endswith("bash ~/jaxrl/tpu/worker.sh setup --python 3.12 --bucket bkt'")
  runs = [l for l in gcloud if "worker.sh run" in l]
  assert runs == [
      "gcloud compute tpus tpu-vm ssh pod --zone=us-central2-b --worker=all '--command=cd "
      f"~/jaxrl && bash tpu/worker.sh run --log ~/jaxrl-logs/exp-{name}.log --multihost -- sft "
      f"--config configs/sft_tiny.py:runlocal --config.optim.lr={lr} --workdir "
      f"gs://bkt/exp/{name}'" for name, lr in (("000-lr=0.003", "0.003"),
                                                ("001-lr=0.001", "0.001"))]
  assert sum("tpu-vm scp pod:jaxrl-logs/exp-001-lr=0.001.log" in l for l in gcloud) == 4


def test_xmanager_job_specs_without_xmanager():
  runs = launch.expand(SFT, command="sft", root="gs://bkt/exp")
  specs = launch.xm_job_specs(runs, SFT, accelerator_type="v5litepod-16", experiment="exp")
  assert specs == [{
      "name": f"exp/{name}",
      "args": ["jaxrl", "sft", "--config", "configs/sft_tiny.py", f"--config.optim.lr={lr}",
               "--workdir", f"gs://bkt/exp/{name}"],
      "overrides": {"optim.lr": float(lr)},
      "workdir": f"gs://bkt/exp/{name}",
      "requirements": {"TPU_V5E": 16},
      "accelerator_type": "v5litepod-16",
      "env": {"JAXRL_DISTRIBUTED": "auto"},  # 16 chips are 4 hosts
  } for name, lr in (("000-lr=0.003", "0.003"), ("001-lr=0.001", "0.001"))]
  single = launch.xm_job_specs(runs[:1], SFT, accelerator_type="v4-8", experiment="exp")
  assert single[0]["requirements"] == {"TPU_V4": 4} and single[0]["env"] == {}
  with pytest.raises(ConfigError, match=r"--accelerator-type 'h100-8'"):
    launch.xm_job_specs(runs, SFT, accelerator_type="h100-8", experiment="exp")


def test_xm_launch_script_prints_the_same_specs_without_xmanager():
  res = subprocess.run([sys.executable, os.path.join(ROOT, "tpu", "xm_launch.py"), "--config",
                        "configs/sft_tiny.py", "--sweep", "--accelerator-type", "v6e-8",
                        "--workdir", "gs://bkt/exp", "--print-specs"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
  assert res.returncode == 0, res.stderr
  runs = launch.expand(SFT, command="sft", root="gs://bkt/exp")
  assert json.loads(res.stdout) == launch.xm_job_specs(runs, SFT, accelerator_type="v6e-8",
                                                       experiment="exp")


def _fake_run(d, rows):
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


GRPO_ROWS = [{"step": s, "loss": 1.0 / s, "reward/mean": 0.1 * s, "reward/std": 0.2, "kl": 0.01 * s,
              "entropy": 1.0, "accuracy": 0.5, "response_length/mean": 4.0,
              "response_length/clip_ratio": 0.0, "grad_norm": 1.0, "timing_s/gen": 0.1,
              "timing_s/score": 0.02, "timing_s/ref": 0.02, "timing_s/update": 0.1,
              "timing_s/sync": 0.01, "timing_s/step_wall": 0.3} for s in (1, 2, 3)]


def test_compare_prints_final_metrics_and_plots(tmp_path, capsys):
  _fake_run(tmp_path / "exp" / "a", GRPO_ROWS + [{"step": 3, "eval/accuracy": 0.75}])
  _fake_run(tmp_path / "exp" / "b", [{**r, "reward/mean": 0.0} for r in GRPO_ROWS])
  (tmp_path / "exp" / "notes").mkdir()  # not a run: ignored
  dirs = run_dirs([str(tmp_path / "exp")])
  assert [os.path.basename(d) for d in dirs] == ["a", "b"]
  table, names = compare_table(dirs)
  assert names == ["loss", "reward/mean", "kl", "accuracy", "eval/accuracy"]
  lines = table.splitlines()
  assert lines[2].split() == ["a", "3", "0.3333", "0.3", "0.03", "0.5", "0.75"]
  assert lines[3].split() == ["b", "3", "0.3333", "0", "0.03", "0.5", "-"]
  out_png = tmp_path / "cmp.png"
  cli.main(["compare", str(tmp_path / "exp" / "a"), str(tmp_path / "exp" / "b"), "--metrics",
            "reward/mean,kl", "--out", str(out_png)])
  out = capsys.readouterr().out
  assert "reward/mean" in out and "entropy" not in out and f"plot: {out_png}" in out
  assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ConfigError, match=r"--metrics 'rewrd' is in none of the runs"):
    compare_table(dirs, ["rewrd"])
  with pytest.raises(ConfigError, match=r"holds no metrics.jsonl"):
    run_dirs([str(tmp_path / "exp" / "notes")])


def test_plot_writes_the_standard_panels(tmp_path, capsys):
  _fake_run(tmp_path / "grpo", GRPO_ROWS)
  cli.main(["plot", str(tmp_path / "grpo")])
  out = capsys.readouterr().out
  assert f"tensorboard --logdir {tmp_path / 'grpo' / 'tb'}" in out
  written = sorted(os.listdir(tmp_path / "grpo" / "plots"))
  assert written == sorted(f"{p}.png" for p in [*STANDARD, "timing"])
  # An SFT run logs loss and accuracy only: no empty reward/KL/timing panels.
  _fake_run(tmp_path / "sft", [{"step": 10, "loss": 2.0, "grad_norm": 1.0},
                               {"step": 20, "loss": 1.0, "eval/accuracy": 0.5}])
  assert sorted(plot_standard(str(tmp_path / "sft"))) == ["accuracy", "loss"]


@pytest.mark.slow
def test_a_tiny_sweep_runs_locally_two_at_a_time(tmp_path, capsys):
  root = tmp_path / "exp"
  cli.main(["launch", "--config", f"{SFT}:runlocal", "--sweep", "--parallel", "2",
            "--workdir", str(root), "--config.train.steps=6", "--config.train.log_every=3",
            "--config.train.save_every=6", "--config.eval.every=6"])
  out = capsys.readouterr().out
  assert "2 of 2 run(s) finished ok" in out
  for name, lr in (("000-lr=0.003", 3e-3), ("001-lr=0.001", 1e-3)):
    run = root / name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 6
    assert json.loads((run / "config.json").read_text())["optim"]["lr"] == lr
    assert "step 6/6" in (run / "launch.log").read_text()
  # The larger learning rate has gone further in 6 steps: the runs really differ.
  table, _ = compare_table(run_dirs([str(root)]))
  loss = {l.split()[0]: float(l.split()[2]) for l in table.splitlines()[2:]}
  assert loss["000-lr=0.003"] < loss["001-lr=0.001"]
