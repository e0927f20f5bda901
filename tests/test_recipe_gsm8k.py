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


# At least one more of the 128 held-out prompts right after GRPO than before it: below seed 2's
# +0.008 (one prompt), above seed 3's +0.000, the one seed of 0-4 in which this recipe did not
# learn (see the docstring; retuning it is open work in docs/guides/recipes.md). The test runs
# seed 0 (+0.047).
MARGIN = 0.005
SEED = int(os.environ.get("JAXRL_LEARN_SEED", "0"))  # to re-measure the spread: 0, 1, 2


@pytest.mark.slow
def test_sft_then_grpo_on_the_users_own_files_raises_held_out_accuracy(tmp_path, repo_root,
                                                                        devices, monkeypatch):
  """A custom task given only as the user's JSONL files (data.task= everywhere: no built-in task
  is read by the runs): SFT (configs/sft_tiny.py) on demonstrations with 20% random slips,
  then GRPO (configs/grpo_tiny.py, rewards=exact_match, init.checkpoint = the SFT run) raises
  the held-out greedy accuracy it logs as eval/accuracy on data.eval_file.

  The files are written here from the addition task's records (a stand-in for a user's data).
  Measured with these exact settings (2026-12-02, 2-core AMD EPYC CPU, 1 device; SFT 600 steps,
  GRPO 20 steps, eval every 10 on 128 held-out prompts), eval/accuracy at steps 0, 10, 20:
  seed 0: 0.398 -> 0.453 -> 0.445 (+0.047); seed 1: 0.352 -> 0.414 -> 0.406 (+0.055);
  seed 2: 0.484 -> 0.461 -> 0.492 (+0.008); and 2026-12-03, the same machine shared, seed 3:
  0.453 -> 0.438 -> 0.453 (+0.000), seed 4: 0.406 -> 0.391 -> 0.438 (+0.031). Median +0.031
  (+0.000 to +0.055): the bar holds in 4 of 5 seeds. The gain is small and seeds 2-3's are
  within noise;
  at 40 steps (lr 5e-5) seeds 0-1 peaked at step 20 and fell back (+0.016, +0.023 at the end,
  the reward-hacking alarm firing), hence 20 steps. ~80 s alone, ~210 s with three at once.
  """
  from jaxrl.data.records import write_jsonl
  from jaxrl.tasks import get_task
  monkeypatch.chdir(repo_root)
  task = get_task("addition")
  train_sft = str(tmp_path / "sft_train.jsonl")
  write_jsonl(train_sft, task.sft_records("train", 20_000, 0, error_rate=0.2))
  train_rl, test = str(tmp_path / "rl_train.jsonl"), str(tmp_path / "test.jsonl")
  write_jsonl(train_rl, task.records("train", 5_000, 2))
  write_jsonl(test, task.records("test", 128, 1))
  sft, grpo = str(tmp_path / "sft"), str(tmp_path / "grpo")
  cli.main(["sft", "--config", "configs/sft_tiny.py", "--workdir", sft, f"--config.seed={SEED}",
            "--config.data.task=", f"--config.data.train_file={train_sft}",
            "--config.train.steps=600", "--config.train.save_every=600",
            "--config.optim.warmup_steps=30", "--config.eval.every=0"])
  cli.main(["grpo", "--config", "configs/grpo_tiny.py", "--workdir", grpo,
            f"--config.seed={SEED}", f"--config.init.checkpoint={sft}", "--config.data.task=",
            f"--config.data.train_file={train_rl}", f"--config.data.eval_file={test}",
            "--config.rewards=exact_match", "--config.train.steps=20",
            "--config.train.save_every=20", "--config.eval.every=10",
            "--config.eval.examples=128"])
  evals = [r["eval/accuracy"] for r in _metrics(grpo) if "eval/accuracy" in r]
  print("held-out eval/accuracy:", evals)
  assert len(evals) == 3
  assert evals[-1] - evals[0] >= MARGIN, evals
