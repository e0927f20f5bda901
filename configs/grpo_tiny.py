"""GRPO on a built-in task with a tiny model, on CPU.

    jaxrl sft  --config configs/sft_tiny.py --workdir runs/sft_tiny
    jaxrl grpo --config configs/grpo_tiny.py --config.init.checkpoint=runs/sft_tiny \
        --workdir runs/grpo_tiny
    jaxrl grpo --config configs/grpo_tiny.py:runlocal --workdir /tmp/grpo   # seconds: a pulse

Your own data (no code changes): a JSONL of {"prompt", "answer"} plus a named reward, e.g.
    --config.data.task= --config.data.train_file=my.jsonl --config.data.eval_file=my_test.jsonl \
    --config.rewards=exact_match --config.init.checkpoint=runs/my_sft

arg: "" (the measured run), "runlocal" (2 steps), "dapo" (clip-higher, token-mean, dynamic
sampling, no KL), "dr_grpo", "gspo", "rloo".
"""

import ml_collections

from jaxrl.config import base_config
from jaxrl.parallel.distributed import distributed_section
from jaxrl.parallel.sync import placement_config
from jaxrl.rl.grpo import algo_section
from jaxrl.train.optim import optim_section


def get_config(arg=None):
  c = base_config()
  c.model.preset = "tiny"
  c.init = ml_collections.ConfigDict(dict(checkpoint=""))  # an SFT run dir to start from
  c.data = ml_collections.ConfigDict(dict(
      task="addition", train_file="", eval_file="", train_examples=20_000, on_bad_row="error"))
  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=16, group_size=8, max_new_tokens=8, temperature=1.0, top_k=0,
      top_p=1.0, slots=64, steps_per_call=8,
      ignore_eos=False))  # True: every completion runs to max_new_tokens (benchmarks)
  c.algo = algo_section()
  c.rewards = "task"  # "task" = the task's checker; else e.g. "exact_match:1.0,format:0.1"
  c.reward_kwargs = {}  # per reward, e.g. {"format": {"pattern": r"^\d+$"}}
  c.normalize_rewards = False
  # Measured on the tiny preset after 600 SFT steps: lr 5e-5 raised held-out accuracy
  # 0.711 -> 0.781 in 80 steps at KL <= 0.04; 2e-4 and above drifted (KL > 0.1) and lost accuracy.
  c.optim = optim_section(lr=5e-5, schedule="constant", warmup_steps=0, weight_decay=0.0,
                          clip_norm=1.0)
  c.train = ml_collections.ConfigDict(dict(
      steps=80, log_every=5, save_every=20, keep_checkpoints=2, async_checkpoints=True))
  c.eval = ml_collections.ConfigDict(dict(every=20, examples=256, batch_size=128))
  # Alarms: KL above kl_threshold; reward (mean over the last `window` steps) rising between two
  # evals while held-out accuracy falls by more than min_accuracy_drop.
  c.alarm = ml_collections.ConfigDict(dict(kl_threshold=0.1, window=20, min_accuracy_drop=0.03))
  c.placement = placement_config()
  c.distributed = distributed_section()
  if arg == "runlocal":
    c.rollout.update(prompts_per_step=4, group_size=4, slots=16)
    c.train.update(steps=2, log_every=1, save_every=2)
    c.eval.update(every=2, examples=16, batch_size=16)
  elif arg == "dapo":
    c.algo.update(eps_low=0.2, eps_high=0.28, beta=0.0, aggregation="token-mean",
                  filter_zero_std=True)
  elif arg == "dr_grpo":
    c.algo.update(advantage="dr_grpo", aggregation="seq-mean-token-sum-norm")
  elif arg == "gspo":
    c.algo.update(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4,
                  aggregation="seq-mean-token-mean")
  elif arg == "rloo":
    c.algo.update(advantage="rloo")
  elif arg not in (None, ""):
    raise ValueError(f"unknown arg {arg!r}: use '', runlocal, dapo, dr_grpo, gspo or rloo")
  return c
