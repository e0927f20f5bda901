"""Every config file parses and validates; overrides fail with the key and the valid choices."""

import os

import pytest

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.models import PRESETS
from jaxrl.sampler import command as sample_command

# The args each config file documents, beside the default (None).
ARGS = {"tiny.py": [None, "tp", "sampler"], "model.py": [None, *PRESETS],
        "sync_tiny.py": [None, "disaggregated", "qwen3-8b"],
        "sft_tiny.py": [None, "runlocal"], "rm_tiny.py": [None, "biased", "logprob", "runlocal"],
        "grpo_tiny.py": [None, "runlocal", "gain", "dapo", "dr_grpo", "gspo", "rloo", "async"],
        "dpo_tiny.py": [None, "ipo", "kto", "orpo", "simpo", "runlocal"],
        "ppo_tiny.py": [None, "runlocal", "group"],
        "agentic_tiny.py": [None, "sft", "runlocal", "guess"],
        "gsm8k_qwen3.py": [None, "grpo", "sft", "fixture", "sft_fixture"],
        **{f: [None, "grpo", "sft", "fixture"] for f in ("qwen3_0p6b.py", "qwen2p5_1p5b.py",
                                                         "llama3p2_1b.py")},
        "qwen3.py": [None, "fixture", "8b,sft,v5p", "4b,grpo,v6e"],
        "qwen2p5.py": [None, "fixture", "7b,sft,v6e"], "llama3.py": [None, "fixture", "3.1-8b,v5p"]}
# The command each config file is for (its own sections' choices are validated too).
COMMAND = {"sft_tiny.py": "sft", "rm_tiny.py": "rm", "grpo_tiny.py": "grpo", "dpo_tiny.py": "dpo",
           "ppo_tiny.py": "ppo", "sample_tiny.py": "sample", "gsm8k_qwen3.py": "grpo",
           "agentic_tiny.py": "grpo",
           **{f: "grpo" for f in ("qwen3_0p6b.py", "qwen2p5_1p5b.py", "llama3p2_1b.py",
                                  "qwen3.py", "qwen2p5.py", "llama3.py")}}


def _choices(path, arg):
  # gsm8k_qwen3.py's SFT stage (on the fixture too), agentic_tiny.py's warm start
  sft_args = ("sft", "sft_fixture")
  command = "sft" if set(sft_args) & set((arg or "").split(",")) else \
      COMMAND.get(os.path.basename(path))
  if command == "sample":
    return sample_command.CHOICES
  return cli.trainer(command).CHOICES if command else None


def _config_files(root):
  return list(config_lib.iter_config_files(os.path.join(root, "configs")))


def test_every_config_file_parses_and_validates(repo_root):
  files = _config_files(repo_root)
  assert files, "configs/ holds no config files"
  for path in files:
    for arg in ARGS.get(os.path.basename(path), [None]):
      spec = path if arg is None else f"{path}:{arg}"
      choices = _choices(path, arg)
      config = config_lib.load_config(spec, choices=choices)
      config_lib.model_config(config)  # the model section resolves to a ModelConfig
      for run in config_lib.load_sweep(path):  # and each sweep run applies and validates
        config_lib.load_config(spec, [f"{k}={v}" for k, v in run.items()], choices)


def test_every_config_file_is_documented_in_ARGS_or_takes_no_arg(repo_root):
  for path in _config_files(repo_root):
    assert os.path.basename(path) in ARGS or ":" not in open(path).read().split('"""')[1]


@pytest.fixture
def tiny(repo_root):
  return os.path.join(repo_root, "configs", "tiny.py")


def test_overrides_apply_with_types(tiny):
  c = config_lib.load_config(tiny, ["--config.model.num_layers=3", "--config.mesh.tensor=2",
                                    "--config.mesh.fsdp=auto", "--config.model.qk_norm=true",
                                    "--config.model.rope_theta=5e5", "--config.seed=7"])
  assert c.seed == 7 and c.mesh.tensor == 2 and c.mesh.fsdp == -1
  cfg = config_lib.model_config(c)
  assert cfg.num_layers == 3 and cfg.qk_norm is True and cfg.rope_theta == 5e5


@pytest.mark.parametrize("override, pattern", [
    ("model.num_layerz=3", r"no key 'num_layerz' in model\. Did you mean 'model.num_layers'\?"),
    ("modle.preset=tiny", r"no key 'modle' in the top level\. Did you mean 'model'\?"),
    ("mesh.fsdp=abc", r"--config.mesh.fsdp='abc' is not an integer"),
    ("seed=1.5", r"--config.seed='1.5' is not an integer"),
    ("model.preset=qwen3-9b", r"model.preset='qwen3-9b' is not valid\. Did you mean "
     r"'qwen3-8b'\? Choose one of: tiny,"),
    ("layout=sampel", r"layout='sampel' is not valid\. Did you mean 'sampler'\?"),
    ("model.dtype=fp16", r"model.dtype='fp16' is not valid\. .*Choose one of: float32, bfloat16"),
    ("model.num_layers=abc", r"--config.model.num_layers='abc' is not an integer"),
    ("mesh=3", r"--config.mesh is a section, not a value: set one of its keys: mesh.data"),
    ("mesh.tensor=3", r"model.num_heads=4 is not divisible by the tensor-parallel size 3"),
    ("model.num_kv_heads=3", r"num_heads=4 is not a multiple of model.num_kv_heads=3"),
])
def test_bad_overrides_name_the_key(tiny, override, pattern):
  with pytest.raises(ConfigError, match=pattern):
    config_lib.load_config(tiny, [override])


def test_missing_file_and_missing_get_config(tmp_path):
  with pytest.raises(ConfigError, match=r"does not exist"):
    config_lib.load_config(str(tmp_path / "nope.py"))
  bad = tmp_path / "bad.py"
  bad.write_text("x = 1\n")
  with pytest.raises(ConfigError, match=r"defines no get_config"):
    config_lib.load_config(str(bad))


@pytest.mark.parametrize("line, moved", [
    ("from jaxrl.rl import grpo", r"\(jaxrl.rl is now jaxrl.algorithms: import it from there\)"),
    ("from jaxrl.train import sft", r"\(jaxrl.train.sft is now jaxrl.algorithms.sft: import"),
    ("y = 1 / 0", r"ZeroDivisionError: division by zero\.$")])
def test_a_config_that_fails_to_run_names_its_line_and_a_moved_module(tmp_path, line, moved):
  """A config written before the trainers moved to jaxrl.algorithms is told where they went."""
  bad = tmp_path / "old.py"
  bad.write_text(f"x = 1\n{line}\n")
  with pytest.raises(ConfigError, match=rf"^config file {bad}:2 failed to load: .*{moved}"):
    config_lib.load_config(str(bad))


def test_sweep_yields_override_dicts(tiny):
  runs = config_lib.load_sweep(tiny)
  assert len(runs) == 8 and all(isinstance(r, dict) for r in runs)
  assert {r["model.preset"] for r in runs} == {"tiny", "tiny-qwen2", "tiny-qwen3", "tiny-llama3"}


@pytest.mark.parametrize("command, override, pattern", [
    ("grpo", "algo.advantage=grpx", r"algo.advantage='grpx' is not valid\. Did you mean 'grpo'\?"),
    ("grpo", "optim.schedule=cosin", r"optim.schedule='cosin' is not valid\. Did you mean"),
    ("dpo", "algo.loss=dpx", r"algo.loss='dpx' is not valid\. Did you mean 'dpo'\?"),
    ("sft", "data.error_mode=systemic", r"data.error_mode='systemic' is not valid"),
    ("rm", "data.bias=shorter", r"data.bias='shorter' is not valid"),
])
def test_a_trainer_validates_its_own_choices(repo_root, command, override, pattern):
  """A trainer's sections are checked against the trainer's CHOICES, passed in; importing a
  trainer registers nothing, so the shared choices stay what config.py defines."""
  spec = os.path.join(repo_root, "configs", f"{command}_tiny.py")
  before = dict(config_lib.BASE_CHOICES)
  trainer = cli.trainer(command)
  assert dict(config_lib.BASE_CHOICES) == before
  with pytest.raises(TypeError):
    config_lib.BASE_CHOICES["algo.loss"] = ("dpo",)  # read-only: nothing registers here
  with pytest.raises(ConfigError, match=pattern):
    config_lib.load_config(spec, [override], trainer.CHOICES)

