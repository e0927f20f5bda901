"""The GSM8K recipe (configs/gsm8k_qwen3.py) end to end on the tiny Qwen3 fixture, and a custom
task given only as the user's JSONL files learning through SFT then GRPO (slow)."""

import json
import os

import pytest

from conftest import LEARN_SEED, jaxrl_cli
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


# 13 of the 256 held-out prompts more after GRPO than before it: below seed 3's +0.074, the worst
# of seeds 0-4 (see the docstring). A run that does not learn scores exactly its step-0 greedy
# accuracy and fails. The test runs seed 0 (+0.078).
MARGIN = 0.03


@pytest.mark.slow
def test_sft_then_grpo_on_the_users_own_files_raises_held_out_accuracy(tmp_path, repo_root,
                                                                        devices, monkeypatch,
                                                                        bars):
  """A custom task given only as the user's JSONL files (data.task= everywhere: no built-in task
  is read by the runs): SFT (configs/sft_tiny.py) on demonstrations from a labeller that drops
  the carry (the demo's systematic slip: 60% of the sums with a units carry are written without
  it, so the imitating policy's greedy answer repeats the slip while the right answer keeps real
  probability), then GRPO (configs/grpo_tiny.py, rewards=exact_match, init.checkpoint = the SFT
  run) raises the held-out greedy accuracy it logs as eval/accuracy on data.eval_file.

  The files are written here from the addition task's records (a stand-in for a user's data).
  Measured with these exact settings (2026-12-03, 2-core AMD EPYC CPU without AVX-512, so Eigen
  learner dots, shared; 8 fake devices; SFT 900 steps, GRPO 40 steps at lr 5e-5, eval every 10
  on 256 held-out prompts),
  eval/accuracy at steps 0, 10, 20, 30, 40 and the largest logged KL:
  seed 0: 0.551 0.594 0.609 0.633 0.629 (+0.078, KL 0.091);
  seed 1: 0.441 0.441 0.504 0.559 0.523 (+0.082, KL 0.086);
  seed 2: 0.563 0.555 0.633 0.621 0.688 (+0.125, KL 0.088);
  seed 3: 0.488 0.457 0.457 0.516 0.563 (+0.074, KL 0.056);
  seed 4: 0.605 0.734 0.762 0.766 0.785 (+0.180, KL 0.075).
  Median +0.082 (+0.074 to +0.180): GRPO gains in 5 of 5 seeds. With YNNPACK learner dots
  (JAXRL_CPU_DOTS=ynnpack, as AVX-512 machines choose; same machine and day), steps 0 and 40:
  seed 0 0.602 -> 0.695 (+0.094), seed 1 0.469 -> 0.695 (+0.227), seed 2 0.504 -> 0.664
  (+0.160), seed 3 0.508 -> 0.613 (+0.105), seed 4 0.570 -> 0.746 (+0.176): median +0.160.
  At 20 GRPO steps seed 3 lost 0.031 (0.488 -> 0.457); the recipe before this one (600 SFT
  steps on 20% random slips, 20 GRPO steps, 128 prompts) gained +0.000 to +0.055, and -0.016
  at seed 0 when re-run on this machine. 217 s against the old recipe's 176 s, one after the
  other on the loaded machine.

  This test also holds SFT's own learning bars (the suite trains no other SFT policy): the SFT
  stage evaluates its held-out right answers at steps 0 and 900. Over the 12 cells of
  tools/learning_sweep.py (docs/design.md, Testing; 2026-12-07; SFT and GRPO both run in every
  cell, so the cells differ): held-out loss falls to 0.052-0.080 of step 0's (bar 0.15), GRPO's
  step-0 accuracy is 0.465-0.629 (bar 0.35), and GRPO gains +0.051 to +0.176 (bar +0.03; the same
  gains as the sweep before, which did not evaluate SFT).

  cells (ISA dots seed: SFT held-out loss / step 0's; SFT held-out accuracy (GRPO's step 0);
      held-out gain):
  AVX2 eigen 0: +0.056, +0.629, +0.062
  AVX2 ynnpack 0: +0.052, +0.598, +0.117
  AVX eigen 0: +0.066, +0.562, +0.051
  AVX ynnpack 0: +0.057, +0.551, +0.113
  AVX2 eigen 1: +0.070, +0.469, +0.129
  AVX2 ynnpack 1: +0.072, +0.500, +0.144
  AVX eigen 1: +0.069, +0.465, +0.129
  AVX ynnpack 1: +0.066, +0.488, +0.176
  AVX2 eigen 2: +0.077, +0.477, +0.133
  AVX2 ynnpack 2: +0.077, +0.480, +0.129
  AVX eigen 2: +0.074, +0.551, +0.125
  AVX ynnpack 2: +0.080, +0.480, +0.109
  AVX-512 cells (an Intel Xeon with AMX, 2 cores, 2026-12-07; --isa native):
  AVX-512 eigen 0: +0.058, +0.617, +0.070
  AVX-512 ynnpack 0: +0.056, +0.613, +0.070
  AVX-512 eigen 1: +0.061, +0.473, +0.215
  AVX-512 ynnpack 1: +0.067, +0.473, +0.141
  AVX-512 eigen 2: +0.086, +0.402, +0.144
  AVX-512 ynnpack 2: +0.087, +0.488, +0.055"""
  from jaxrl.data.records import write_jsonl
  from jaxrl.tasks import get_task
  monkeypatch.chdir(repo_root)
  task = get_task("addition")
  train_sft = str(tmp_path / "sft_train.jsonl")
  write_jsonl(train_sft, task.sft_records("train", 20_000, 0, error_rate=0.6,
                                          error_mode="systematic"))
  sft_test = str(tmp_path / "sft_test.jsonl")  # held-out demonstrations, all right
  write_jsonl(sft_test, task.sft_records("test", 256, 1))
  train_rl, test = str(tmp_path / "rl_train.jsonl"), str(tmp_path / "test.jsonl")
  write_jsonl(train_rl, task.records("train", 5_000, 2))
  write_jsonl(test, task.records("test", 256, 1))
  sft, grpo = str(tmp_path / "sft"), str(tmp_path / "grpo")
  # As a user runs them (conftest.jaxrl_cli: a subprocess on one CPU device, default XLA
  # flags), 2-3x faster than in this process's 8 fake devices at optimisation level 0.
  jaxrl_cli(["sft", "--config", "configs/sft_tiny.py", "--workdir", sft,
             f"--config.seed={LEARN_SEED}",
             "--config.data.task=", f"--config.data.train_file={train_sft}",
             "--config.train.steps=900", "--config.train.save_every=900",
             f"--config.data.eval_file={sft_test}", "--config.optim.warmup_steps=30",
             "--config.eval.every=900"])
  jaxrl_cli(["grpo", "--config", "configs/grpo_tiny.py", "--workdir", grpo,
             f"--config.seed={LEARN_SEED}", f"--config.init.checkpoint={sft}",
             "--config.data.task=", f"--config.data.train_file={train_rl}",
             f"--config.data.eval_file={test}", "--config.rewards=exact_match",
             "--config.train.steps=40", "--config.train.save_every=40",
             "--config.eval.every=10", "--config.eval.examples=256"])
  evals = [r["eval/accuracy"] for r in _metrics(grpo) if "eval/accuracy" in r]
  print("held-out eval/accuracy:", evals)
  assert len(evals) == 5
  sft_evals = [r["eval/loss"] for r in _metrics(sft) if "eval/loss" in r]
  assert len(sft_evals) == 2  # steps 0 and 900
  # SFT learnt: the held-out loss of right answers falls, and greedy decoding (GRPO's step-0
  # eval is the SFT policy's) answers well above the untrained model's ~0.
  bars.below("SFT held-out loss / step 0's", sft_evals[-1] / sft_evals[0], 0.15)
  bars.above("SFT held-out accuracy (GRPO's step 0)", evals[0], 0.35)
  bars.above("held-out gain", evals[-1] - evals[0], MARGIN - 1e-9)  # 0.03 itself passes
  bars.check()
