"""Seed sweeps: `jaxrl launch --seeds`, `jaxrl compare`'s aggregation over seeds (crafted run
dirs, exact numbers), and metrics hygiene (a metric that does not apply is absent)."""

import json
import os

import numpy as np
import pytest

from jaxrl import cli, launch
from jaxrl.errors import ConfigError
from jaxrl.plot import aggregate, aggregate_table, group_runs
from jaxrl.train.rundir import read_metrics


def _run(path, *, seed, lr, devices, finals, steps=(0, 10, 20)):
  """A crafted run dir: config.json (as a trainer writes it) and metrics.jsonl whose last row
  holds `finals`."""
  os.makedirs(path)
  config = {"seed": seed, "optim": {"lr": lr}, "model": {"preset": "tiny"},
            "backend": {"platform": "cpu", "devices": devices, "dots": "whatever"}}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for i, step in enumerate(steps):
      row = {"step": step, **{k: (v if i == len(steps) - 1 else v / 2) for k, v in finals.items()}}
      f.write(json.dumps(row) + "\n")
  return str(path)


@pytest.fixture
def seeded(tmp_path):
  """Two settings (lr 0.1 on 8 devices, lr 0.1 on 1 device) of three seeds each, plus one run
  at another lr: the groups must split by lr and device count, not by seed."""
  accs = {"a": [0.5, 0.75, 1.0], "b": [0.25, 0.25, 0.5]}
  dirs = []
  for s in range(3):
    dirs.append(_run(tmp_path / f"a{s}", seed=s, lr=0.1, devices=8,
                     finals={"eval/accuracy": accs["a"][s], "loss": 1.0 + s}))
  for s in range(3):
    dirs.append(_run(tmp_path / f"b{s}", seed=s, lr=0.1, devices=1,
                     finals={"eval/accuracy": accs["b"][s], "loss": 2.0}))
  dirs.append(_run(tmp_path / "c0", seed=0, lr=0.2, devices=1, finals={"loss": 3.0}))
  return dirs, accs


def test_runs_group_by_setting_not_by_seed(seeded):
  dirs, _ = seeded
  groups = group_runs(dirs)
  assert list(groups) == ["devices=8 optim.lr=0.1", "devices=1 optim.lr=0.1",
                          "devices=1 optim.lr=0.2"]
  assert [len(m) for m in groups.values()] == [3, 3, 1]


def test_compare_aggregates_mean_std_median_min_max(seeded):
  dirs, accs = seeded
  agg = aggregate(dirs, ["eval/accuracy", "loss"])
  for label, key in (("devices=8 optim.lr=0.1", "a"), ("devices=1 optim.lr=0.1", "b")):
    xs = np.array(accs[key])
    got = agg[label]["eval/accuracy"]
    assert got["n"] == 3
    assert got["mean"] == pytest.approx(xs.mean())
    assert got["std"] == pytest.approx(xs.std(ddof=1))  # the sample standard deviation
    assert got["median"] == pytest.approx(np.median(xs))
    assert (got["min"], got["max"]) == (xs.min(), xs.max())
  # Worked by hand: seeds 0.5, 0.75, 1.0 -> mean 0.75, std 0.25.
  assert agg["devices=8 optim.lr=0.1"]["eval/accuracy"]["std"] == pytest.approx(0.25)
  assert agg["devices=8 optim.lr=0.1"]["loss"]["mean"] == pytest.approx(2.0)
  # One run: its value, std 0; a metric it never logged is absent, not a NaN row.
  lone = agg["devices=1 optim.lr=0.2"]
  assert lone["loss"] == {"n": 1, "mean": 3.0, "std": 0.0, "median": 3.0, "min": 3.0,
                          "max": 3.0}
  assert "eval/accuracy" not in lone
  table = aggregate_table(agg, ["eval/accuracy"])
  assert "devices=8 optim.lr=0.1    3       0.75       0.25       0.75        0.5          1" \
      in table


def _sft_run(path, *, seed, edit=lambda c: None):
  """A crafted `jaxrl sft` run dir whose config.json is today's sft defaults as a trainer
  writes them (JSON), changed by `edit`, and one metrics row."""
  from jaxrl.algorithms.sft import default_config
  config = json.loads(json.dumps(default_config().to_dict(), default=str))
  config.update(seed=seed, backend={"platform": "cpu", "devices": 1, "dots": "ynnpack"})
  edit(config)
  os.makedirs(path)
  for name, obj in (("config.json", config), ("run.json", {"command": "sft"})):
    with open(os.path.join(path, name), "w") as f:
      json.dump(obj, f)
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 10, "eval/accuracy": 0.5 + seed / 10}) + "\n")
  return str(path)


def test_a_run_from_before_a_new_config_section_groups_with_its_sweep(tmp_path):
  """Seeds of one sweep run across a code change that added a config section (model.lora):
  the older run's config.json lacks the section, and it ran as the section's defaults do, so
  it groups with the newer seeds; a run that sets the section differently still splits."""
  def no_lora(c):
    del c["model"]["lora"]

  def no_warmup_key(c):
    del c["optim"]["warmup_steps"]

  def lora_on(c):
    c["model"]["lora"]["rank"] = 8

  old = _sft_run(tmp_path / "old", seed=0, edit=no_lora)
  older = _sft_run(tmp_path / "older", seed=1, edit=no_warmup_key)
  new = _sft_run(tmp_path / "new", seed=2)
  lora = _sft_run(tmp_path / "lora", seed=3, edit=lora_on)
  groups = group_runs([old, older, new, lora])
  assert groups == {"model.lora.rank=0": [old, older, new], "model.lora.rank=8": [lora]}
  agg = aggregate([old, older, new, lora], ["eval/accuracy"])
  assert agg["model.lora.rank=0"]["eval/accuracy"]["n"] == 3
  assert agg["model.lora.rank=0"]["eval/accuracy"]["median"] == pytest.approx(0.6)
  # A key a run names with a value other than today's default is a real difference.
  moved = _sft_run(tmp_path / "moved", seed=4,
                   edit=lambda c: c["optim"].update(warmup_steps=c["optim"]["warmup_steps"] + 1))
  assert len(group_runs([older, new, moved])) == 2


def test_compare_command_prints_the_spread_and_a_band_plot(seeded, capsys, tmp_path):
  dirs, _ = seeded
  out = tmp_path / "bands.png"
  cli.main(["compare", *dirs, "--metrics", "eval/accuracy,loss", "--out", str(out)])
  text = capsys.readouterr().out
  assert "over seeds (final values):" in text
  assert f"plot: {out}" in text and out.stat().st_size > 1000


def test_parse_seeds():
  assert launch.parse_seeds("0-4") == [0, 1, 2, 3, 4]
  assert launch.parse_seeds("0,3,7") == [0, 3, 7]
  assert launch.parse_seeds("0-2,9") == [0, 1, 2, 9]
  for bad in ("", "a", "-1", "3-1", "0,0", "1-2,2"):
    with pytest.raises(ConfigError, match=f"--seeds '{bad}': give seeds as a range or a comma"):
      launch.parse_seeds(bad)


def test_launch_seeds_runs_each_sweep_item_once_per_seed(repo_root, capsys, tmp_path,
                                                         monkeypatch):
  monkeypatch.chdir(repo_root)
  cli.main(["launch", "--config", "configs/sft_tiny.py", "--sweep", "--seeds", "0-1",
            "--workdir", str(tmp_path / "exp"), "--dry-run"])
  text = capsys.readouterr().out
  runs = launch.expand("configs/sft_tiny.py", command="sft", root=str(tmp_path / "exp"),
                       seeds=[0, 1])
  # sft_tiny's sweep() tries two learning rates; each runs under seeds 0 and 1.
  assert [r.name for r in runs] == ["000-lr=0.003,seed=0", "001-lr=0.003,seed=1",
                                    "002-lr=0.001,seed=0", "003-lr=0.001,seed=1"]
  assert [r.config["seed"] for r in runs] == [0, 1, 0, 1]
  assert [r.argv[-3] for r in runs] == ["--config.seed=0", "--config.seed=1"] * 2
  assert "4 run(s) (dry run: nothing launched, nothing written)" in text
  for r in runs:
    assert f"[{r.name}]" in text
  assert not (tmp_path / "exp").exists()  # a dry run writes nothing


def test_launch_refuses_seeds_when_the_sweep_sets_seed(tmp_path):
  spec = tmp_path / "cfg.py"
  spec.write_text("from jaxrl.algorithms.sft import default_config\n"
                  "def get_config(arg=None):\n  return default_config()\n"
                  "def sweep():\n  return [{'seed': 1}]\n")
  with pytest.raises(ConfigError, match="its sweep\\(\\) sets `seed` already: drop --seeds"):
    launch.expand(str(spec), command="sft", root=str(tmp_path / "r"), seeds=[0, 1])


def test_launch_picks_the_trainer_from_the_config(repo_root):
  from jaxrl import config as config_lib
  got = {f: launch.command_of(config_lib.load_config(os.path.join(repo_root, "configs", f)))
         for f in ("sft_tiny.py", "rm_tiny.py", "dpo_tiny.py", "grpo_tiny.py")}
  assert got == {"sft_tiny.py": "sft", "rm_tiny.py": "rm", "dpo_tiny.py": "dpo",
                 "grpo_tiny.py": "grpo"}


@pytest.mark.slow
def test_grpo_without_a_task_logs_no_accuracy_at_all(repo_root, tmp_path, devices):
  """With the user's own data and a named reward there is no task checker: train accuracy does
  not apply, so it is absent from metrics.jsonl (it used to be the string "nan")."""
  train = tmp_path / "my.jsonl"
  train.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                           for a in range(8) for b in range(4)))
  workdir = tmp_path / "run"
  cli.main(["grpo", "--config", os.path.join(repo_root, "configs", "grpo_tiny.py:runlocal"),
            "--config.data.task=", f"--config.data.train_file={train}",
            "--config.rewards=exact_match", "--config.eval.every=0",
            "--workdir", str(workdir)])
  rows = read_metrics(str(workdir))
  assert rows and all("accuracy" not in r for r in rows)
  assert all("reward/mean" in r for r in rows)
  text = (workdir / "metrics.jsonl").read_text()
  assert '"nan"' not in text
