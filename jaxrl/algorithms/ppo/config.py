"""PPO's config: GRPO's sections (the rollout, rewards, alarms, eval, placement are the same)
with the algorithm's knobs set for PPO, the GAE knobs, and the critic's own section."""

from __future__ import annotations

import ml_collections

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.algorithms.grpo import config as grpo_config

def check_critic(config) -> None:
  """The critic section's ranges, at config load."""
  config_lib.check_at_least(config, 0, "critic.warmup_steps", "critic.value_clip")
  config_lib.check_positive(config, "critic.lr", example="1e-5")
  if config.critic.lora not in LORA_CHOICES:
    raise ConfigError(f"critic.lora={config.critic.lora!r} is not one of {LORA_CHOICES}: "
                      "'actor' gives the critic the actor's model.lora (adapters and the value "
                      "head over a frozen base when the actor uses LoRA), 'off' a full critic.")
  a = config.algo
  for key in ("gamma", "lam"):
    v = float(a[key])
    if not 0.0 <= v <= 1.0:
      raise ConfigError(f"algo.{key}={v} is outside [0, 1]: GAE's discount and trace decay are "
                        f"in [0, 1] (TRL's defaults: gamma 1.0, lam 0.95).")


LORA_CHOICES = ("actor", "off")

CHOICES = {
    **grpo_config.CHOICES,
    "algo.advantage": ("gae",),
    "critic": check_critic,
}


def algo_section(**overrides) -> ml_collections.ConfigDict:
  """GRPO's knobs, set as TRL's PPOTrainer sets them: the KL penalty per token in the reward
  (k1, beta 0.05), no advantage clip, token-mean; plus GAE's gamma and lambda and the
  advantages' whitening."""
  c = grpo_config.algo_section(
      advantage="gae", adv_clip=0.0, beta=0.05, kl_estimator="k1", kl_in="reward",
      kl_clamp=10.0, num_iterations=1, minibatches=1)
  c.update(dict(
      gamma=1.0,                 # GAE's discount
      lam=0.95,                  # GAE's lambda (verl / OpenRLHF default 1.0)
      whiten_advantages=True,    # (A - mean) / std over the batch's valid tokens
  ))
  c.update(overrides)
  return c


def critic_section(**overrides) -> ml_collections.ConfigDict:
  """The critic: a value head on the decoder's every token, trained by its own optimizer (the
  optim section's, at critic.lr) on the clipped value loss."""
  c = ml_collections.ConfigDict(dict(
      # What the critic starts from: "policy" (init.checkpoint / model.hf_path, a new head),
      # "reward_model" (reward_model.checkpoints' first run, whole), or a run dir (a `jaxrl rm`
      # run whole; a sft / grpo run's decoder with a new head): critic.critic_source.
      init="policy",
      lr=1e-4,            # the critic's learning rate; its other optimizer keys are optim's
      value_clip=0.2,     # PPO2's clip of V around V_old (TRL's cliprange_value); 0 = off
      warmup_steps=0,     # steps where the critic alone trains (the policy waits)
      # "actor": the critic takes model.lora as the actor does (with LoRA: adapters and the
      # value head train over its own frozen, maybe int8, copy of the base; without: a full
      # critic); "off": a full critic even when the actor uses LoRA.
      lora="actor",
  ))
  c.update(overrides)
  return c


def default_config():
  """Every field a PPO run reads: GRPO's (jaxrl/algorithms/grpo/config.py), algo as above, one
  sample per prompt (G = 1 is PPO proper) and the critic section."""
  c = grpo_config.default_config()
  c.algo = algo_section()
  c.rollout.group_size = 1
  c.rollout.prompts_per_step = 64
  c.critic = critic_section()
  return c
