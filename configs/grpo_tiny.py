"""GRPO on a built-in task with a tiny model, on CPU.

    jaxrl sft  --config configs/sft_tiny.py --workdir runs/sft_tiny
    jaxrl grpo --config configs/grpo_tiny.py:gain --config.init.checkpoint=runs/sft_tiny \
        --workdir runs/grpo_gain
    jaxrl grpo --config configs/grpo_tiny.py:runlocal --workdir /tmp/grpo   # seconds: a pulse

From the sft_tiny policy run `:gain`, not the default (measured 2026-12-03, AMD EPYC 2-core
CPU, GRPO seeds 0-4 from the sft_tiny policy of seed 0 of each mesh; docs/guides/recipes.md).
`:gain` is DAPO's settings (no KL, clip-higher, dynamic sampling) for 400 steps on 2-digit sums,
scored on 1024 held-out 2-digit sums: held-out greedy accuracy (0.90-0.95 at step 0) rose in
10 of 10 runs, by +0.036 median (+0.029 to +0.040) on 1 device and +0.027 (+0.021 to +0.060) on
8 fake devices (240 steps gave +0.022 and +0.017; +0.05 is not reached); KL (no longer in the
loss) crosses the 0.1 alarm for 7-16 steps per run, and the full 1-2 digit task ends within
-0.041 to +0.013 of the SFT policy. The default (GRPO, 80 steps at lr 5e-5, 1-2 digit sums)
keeps that policy's accuracy within 0.043 and KL under the alarm but does not raise it (+0.020
median on 1 device, -0.023 on 8); from a policy with something left to learn it gains: the
demo's SFT (a labeller that drops the carry) -> the default at lr 2e-5 gains +0.094 to +0.265
over the same seeds. Training and scoring on carry sums only ("addition:carry=1") looks like a
large gain (0.88 -> 0.99) but teaches the policy to always carry: the full task falls 0.93 ->
0.83.

Your own data (no code changes): a JSONL of {"prompt", "answer"} plus a named reward, e.g.
    --config.data.task= --config.data.train_file=my.jsonl --config.data.eval_file=my_test.jsonl \
    --config.rewards=exact_match --config.init.checkpoint=runs/my_sft

arg: "" (the demo's and the tests' base), "runlocal" (2 steps), "gain" (above), "dapo"
(clip-higher, token-mean, dynamic sampling, no KL), "dr_grpo", "gspo", "rloo", "async"
(disaggregated placement, 4 learner + 4 sampler devices; generation for step k+1 overlaps step
k's update; truncated IS at 2).
"""

from jaxrl.algorithms.grpo import default_config


def get_config(arg=None):
  c = default_config()  # every field, with what it means: jaxrl/algorithms/grpo/config.py
  if arg == "runlocal":
    c.rollout.update(prompts_per_step=4, group_size=4, slots=16)
    c.train.update(steps=2, log_every=1, save_every=2)
    c.eval.update(every=2, examples=16, batch_size=16)
  elif arg in ("dapo", "gain"):
    c.algo.update(eps_low=0.2, eps_high=0.28, beta=0.0, aggregation="token-mean",
                  filter_zero_std=True)
    if arg == "gain":  # where the sft_tiny policy has something left to learn, scored finely
      c.data.task = "addition:min_digits=2"
      c.train.steps = 400  # 240 gained less in 10 of 10 runs (recipes.md)
      c.eval.update(every=80, examples=1024)
  elif arg == "dr_grpo":
    c.algo.update(advantage="dr_grpo", aggregation="seq-mean-token-sum-norm")
  elif arg == "gspo":
    c.algo.update(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4,
                  aggregation="seq-mean-token-mean")
  elif arg == "rloo":
    c.algo.update(advantage="rloo")
  elif arg == "async":
    c.placement.update(mode="disaggregated", learner_devices=-1)
    c.rollout.async_generation = True
    c.algo.tis_cap = 2.0
  elif arg not in (None, ""):
    raise ValueError(f"unknown arg {arg!r}: use '', runlocal, gain, dapo, dr_grpo, gspo, rloo or "
                     "async")
  return c
