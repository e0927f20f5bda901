"""Bad input, as a careless user gives it, fails with one sentence naming the key or file and
the fix (issue 32's probe cases)."""

import os

import pytest

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl.errors import ConfigError


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
      "jaxrl sft: error: this config (configs/grpo_tiny.py) has sections alarm, algo, init, "
      "normalize_rewards, reward_kwargs, reward_model, rewards, rollout that `jaxrl sft` does "
      "not read: it looks like a `jaxrl grpo` config; run `jaxrl grpo`.")
  assert not (tmp_path / "run").exists()  # refused before the run dir is made


def test_an_unknown_section_is_named(repo_root, capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(repo_root)
  with pytest.raises(SystemExit):
    cli.main(["sft", "--config", "configs/sample_tiny.py", "--workdir", str(tmp_path / "run")])
  assert capsys.readouterr().err.strip() == (
      "jaxrl sft: error: this config (configs/sample_tiny.py) has section sampling that "
      "`jaxrl sft` does not read: remove it, or start from the config of `jaxrl sft` "
      "(configs/sft_tiny.py).")
