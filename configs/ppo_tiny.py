"""PPO (a learned critic, GAE) on a built-in task with a tiny model, on CPU.

    jaxrl sft --config configs/sft_tiny.py --workdir runs/sft_tiny
    jaxrl ppo --config configs/ppo_tiny.py --config.init.checkpoint=runs/sft_tiny \
        --workdir runs/ppo_tiny
    jaxrl ppo --config configs/ppo_tiny.py:runlocal --workdir /tmp/ppo   # seconds: a pulse

The critic starts from the policy's decoder with a new value head (critic.init=policy); a
`jaxrl rm` run is another start: --config.critic.init=reward_model with
--config.reward_model.checkpoints=runs/rm (and --config.reward_model.weight=0 to train on the
task's reward alone), or --config.critic.init=runs/rm.

arg: "" (one sample per prompt, PPO proper), "runlocal" (2 steps, 1 warm-up step),
"group" (4 samples per prompt: GRPO's batch shape, the critic's baseline instead of the group's);
",lora" / ",qlora" on any of them (e.g. "runlocal,lora"): the actor and the critic train LoRA
adapters (and the critic its value head) over frozen bases, int8 with qlora (jaxrl.config.with_lora;
both learning rates x10).
"""

from jaxrl.config import lora_arg, with_lora
from jaxrl.algorithms.ppo import default_config


def get_config(arg=None):
  arg, kind = lora_arg(arg)
  c = default_config()  # every field, with what it means: jaxrl/algorithms/ppo/config.py and grpo's
  if arg == "runlocal":
    c.rollout.update(prompts_per_step=8, group_size=1, slots=16)
    c.train.update(steps=2, log_every=1, save_every=2)
    c.eval.update(every=2, examples=16, batch_size=16)
    c.critic.warmup_steps = 1
  elif arg == "group":
    c.rollout.update(prompts_per_step=16, group_size=4)
  elif arg not in (None, ""):
    raise ValueError(f"unknown arg {arg!r}: use '', runlocal or group (each with ,lora or "
                     ",qlora)")
  if kind:
    with_lora(c, quantize="int8" if kind == "qlora" else "")
    c.critic.lr = c.critic.lr * 10.0  # LoRA's usual ratio, as with_lora sets optim.lr
  return c
