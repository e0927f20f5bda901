"""Async GRPO learns as the synchronous run does: on the demo's task, from the demo's SFT
policy, an async run with max_staleness k = 2 reaches the synchronous run's held-out accuracy
within 0.03 in the same number of updates (issue 39)."""

import json
import os

import pytest

from conftest import LEARN_SEED, jaxrl_cli

STEPS = 40  # half the demo's 80: the gain is already +0.13 or more (the test's docstring)


def heldout_accuracy(repo_root, sft, workdir, *, seed=LEARN_SEED, steps=STEPS,
                     async_k=0) -> tuple[float, float]:
  """Held-out greedy accuracy after `steps` GRPO steps as the demo runs them (jaxrl.demo's
  GRPO settings, from `sft`), on configs/grpo_tiny.py:async's placement (disaggregated, half
  the devices each, truncated IS at 2) for both modes, so the runs differ only in async
  generation: async_k = 0 is synchronous, k > 0 async with max_staleness k. Run as a user runs
  it (conftest.jaxrl_cli: a subprocess under default XLA flags) on 2 CPU devices, 1 learner + 1
  sampler: 17.3 s a synchronous run alone here, against 21.2 s on 4 + 4, its loss and held-out
  accuracy equal to the bit at seed 0 (the async machinery over several devices is
  tests/test_async_grpo.py's)."""
  from jaxrl.demo import GRPO_OVERRIDES
  over = {**GRPO_OVERRIDES, "init.checkpoint": sft, "seed": seed, "train.steps": steps,
          "train.save_every": steps, "eval.every": steps, "train.log_every": steps,
          "rollout.async_generation": async_k > 0, "rollout.max_staleness": max(async_k, 1)}
  jaxrl_cli(["grpo", "--config", os.path.join(repo_root, "configs/grpo_tiny.py:async"),
             "--workdir", str(workdir), *[f"--config.{k}={v}" for k, v in over.items()]],
            devices=2)
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["step"] == steps
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  start = next(r["eval/accuracy"] for r in rows if r["step"] == 0)
  return start, summary["eval"]["eval/accuracy"]


@pytest.mark.slow
def test_async_k2_reaches_the_synchronous_heldout_accuracy(repo_root, tmp_path, sft_slip,
                                                           devices, bars):
  """40 steps each (~35 s for both runs alone here, from the committed sft_slip). Measured
  from one sft_slip draw (held-out 0.586; 2026-12-03, AMD EPYC, load ~10 on its 2 cores),
  sync / async k=2 held-out accuracy over GRPO seeds 0-3: 0.754 / 0.746, 0.773 / 0.773,
  0.715 / 0.715, 0.727 / 0.734: differences -0.008..+0.008 (1/256 is 0.004; on seed 1 the
  runs' rewards differed, staleness 2, the greedy accuracy did not), sync's gain over SFT
  +0.13..+0.19. So the issue's 0.03 holds with margin on every seed measured.

  Over the 12 cells of tools/learning_sweep.py (docs/design.md, Testing; 2026-12-07), from the
  committed sft_slip, the four ISA x dot-kernel cells of each seed gave the same figures to the last
  digit (GRPO from one checkpoint is bit-identical under both dot kernels and both ISA levels on
  this AMD EPYC, as jaxrl/backends/cpu/dots.py found), so the spread is the three seeds': sync's
  gain +0.051 to +0.105, |async k=2 - sync| 0.000-0.004 (one prompt in 256). Bars: a gain of +0.015
  (there was learning to match) and the issue's 0.03.

  cells (ISA dots seed: sync's held-out gain; |async k=2 - sync|):
  AVX2 eigen 0: +0.078, +0.004
  AVX2 ynnpack 0: +0.078, +0.004
  AVX eigen 0: +0.078, +0.004
  AVX ynnpack 0: +0.078, +0.004
  AVX2 eigen 1: +0.105, +0.004
  AVX2 ynnpack 1: +0.105, +0.004
  AVX eigen 1: +0.105, +0.004
  AVX ynnpack 1: +0.105, +0.004
  AVX2 eigen 2: +0.051, +0.000
  AVX2 ynnpack 2: +0.051, +0.000
  AVX eigen 2: +0.051, +0.000
  AVX ynnpack 2: +0.051, +0.000
  AVX-512 cells (an Intel Xeon with AMX, 2 cores, 2026-12-07; --isa native):
  AVX-512 eigen 0: +0.078, +0.004
  AVX-512 ynnpack 0: +0.078, +0.004
  AVX-512 eigen 1: +0.105, +0.004
  AVX-512 ynnpack 1: +0.105, +0.004
  AVX-512 eigen 2: +0.051, +0.000
  AVX-512 ynnpack 2: +0.051, +0.000"""
  # The SFT policy's accuracy on this seed's held-out prompts: the runs' step-0 eval.
  sft_acc, sync = heldout_accuracy(repo_root, sft_slip, tmp_path / "sync")
  _, k2 = heldout_accuracy(repo_root, sft_slip, tmp_path / "k2", async_k=2)
  print(f"held-out accuracy: sft {sft_acc:.3f}, sync {sync:.3f}, async k=2 {k2:.3f}")
  bars.above("sync's held-out gain", sync - sft_acc, 0.015)  # there was learning to match
  bars.below("|async k=2 - sync|", abs(k2 - sync), 0.0301)  # 0.03 itself passes
  bars.check()
