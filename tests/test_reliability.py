"""Reliability: bad input, foreign run dirs and mismatched checkpoints each get one sentence
(and leave the run dir as it was), never a traceback or a silently wrong model (issue 32)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl.errors import ConfigError

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


def test_sample_refuses_hf_path_instead_of_random_weights(capsys, tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "1+1="}\n')
  err = _fails(capsys, ["sample", "--config", "configs/sample_tiny.py",
                        "--config.model.hf_path=tests/fixtures/hf/qwen3", "--prompts",
                        str(prompts), "--n", "1", "--workdir", str(tmp_path / "s")])
  assert err == ("model.hf_path='tests/fixtures/hf/qwen3' is not supported by `jaxrl "
                 "sample` yet (it would sample random weights): drop it, and pass --checkpoint "
                 "with a jaxrl sft or grpo run directory instead.")
  assert not os.path.exists(tmp_path / "s" / "completions.jsonl")


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
