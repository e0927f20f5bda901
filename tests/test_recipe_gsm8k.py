"""The GSM8K recipe (configs/gsm8k_qwen3.py) end to end on the tiny Qwen3 fixture, and a custom
task given only as the user's JSONL files learning through SFT then GRPO (slow)."""

import json
import os

import pytest

from jaxrl import cli
from jaxrl.data import prompts as prompts_lib
from jaxrl.data.files import write_gsm8k_fixture
from jaxrl.train import evaluation

RECIPE = "configs/gsm8k_qwen3.py"
HF_QWEN3 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf", "qwen3")


def _metrics(run):
  return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def test_gsm8k_recipe_runs_end_to_end_on_the_fixture(tmp_path, repo_root, devices, monkeypatch):
  """SFT (:sft_fixture) then GRPO (:fixture) through the CLI on a GSM8K-format Parquet: the gsm8k
  reward is logged, the held-out eval logs accuracy and pass@k, samples are written, and every
  prompt the run fed (rollouts and eval) is chat-templated by the checkpoint's tokenizer."""
  from jaxrl.data.hf_tokenizer import HFTokenizer
  monkeypatch.chdir(repo_root)
  files = write_gsm8k_fixture(str(tmp_path / "gsm8k"), n_train=64, n_test=8)
  data = [f"--config.data.train_file={files['train']}",
          f"--config.data.eval_file={files['test']}"]
  fed = []  # the prompt ids of every rollout and eval prompt rendered
  ids, encode = prompts_lib.Prompts.ids, evaluation.render_prompt
  monkeypatch.setattr(prompts_lib.Prompts, "ids",
                      lambda self, record: fed.append(ids(self, record)) or fed[-1])
  monkeypatch.setattr(evaluation, "render_prompt",
                      lambda *a, **k: fed.append(encode(*a, **k)) or fed[-1])
  sft, grpo = str(tmp_path / "sft"), str(tmp_path / "grpo")
  cli.main(["sft", "--config", f"{RECIPE}:sft_fixture", "--workdir", sft, *data,
            "--config.train.steps=4", "--config.train.save_every=4", "--config.eval.every=0"])
  assert os.path.isdir(os.path.join(sft, "checkpoints"))
  fed.clear()  # SFT renders prompts too; what is checked below is GRPO's
  cli.main(["grpo", "--config", f"{RECIPE}:fixture", "--workdir", grpo, *data,
            f"--config.init.checkpoint={sft}"])
  rows = _metrics(grpo)
  assert all("reward/gsm8k" in r and "reward/gsm8k_format" in r for r in rows if "loss" in r)
  assert any("reward/gsm8k" in r for r in rows)
  evals = [r for r in rows if "eval/accuracy" in r]
  assert len(evals) == 2 and all("eval/pass@4" in r and "eval/pass@1" in r for r in evals)
  samples = [json.loads(line) for line in open(os.path.join(grpo, "samples", "step_2.jsonl"))]
  assert {s["mode"] for s in samples} == {"greedy", "sample"}
  assert samples[0]["prompt"].startswith("What is ") and "#### " in samples[0]["answer"]
  # The prompts fed: Qwen3's chat template (thinking off) around the question.
  tok = HFTokenizer(HF_QWEN3)
  texts = [tok.decode(p, skip_special=False) for p in fed]
  assert len(texts) >= 8  # the 8 eval prompts at least, and the rollouts' prompts
  for text in texts:
    assert text.startswith("<|im_start|>user\nWhat is "), text
    # the generation prompt, with enable_thinking=False's empty think block
    assert text.endswith("?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"), text
  assert any(samples[0]["prompt"] in t for t in texts)
  summary = json.load(open(os.path.join(grpo, "summary.json")))
  assert summary["reward_hacking_alarm"].startswith("eval/accuracy (gsm8k on 8 prompts")
