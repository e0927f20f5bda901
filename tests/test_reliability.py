"""Bad input, as a careless user gives it, fails with one sentence naming the key or file and
the fix (issue 32's probe cases)."""

import json
import os
import shutil
import subprocess

import pytest

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl.data import read_jsonl
from jaxrl.data.hf_tokenizer import HFTokenizer
from jaxrl.errors import ConfigError
from jaxrl.train.rundir import RunDir


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
