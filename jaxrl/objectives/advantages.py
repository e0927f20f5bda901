"""Advantage estimators for the GRPO family: pure functions of rewards.

Rewards arrive as [B, G]: B prompts, G sampled completions each (one scalar per completion,
outcome reward). Every function returns [B, G] advantages, broadcast over tokens by the caller.

| name                  | baseline                          | scale               | paper |
|-----------------------|-----------------------------------|---------------------|-------|
| grpo                  | group mean                        | group std (unbiased)| Shao et al. 2024 (DeepSeekMath) |
| dr_grpo               | group mean                        | none                | Liu et al. 2025 (Dr. GRPO) |
| rloo                  | mean of the other G-1 samples     | none                | Ahmadian et al. 2024 |
| reinforce_pp          | none                              | batch mean/std      | Hu 2025 (REINFORCE++) |
| reinforce_pp_baseline | group mean                        | batch std           | Hu 2025 (REINFORCE++-baseline) |

Departures: GRPO uses the unbiased (G-1) std, as TRL does, with `eps` added to the std rather
than inside a sqrt. Outcome rewards only: REINFORCE++'s per-token KL-shaped returns come from
the caller putting KL in the reward (losses.kl_in_reward) before calling these.
"""

from __future__ import annotations

import jax.numpy as jnp


def grpo(*, rewards_bg, eps: float = 1e-6):
  """(r - mean_group) / (std_group + eps), unbiased std. A zero-variance group gets 0."""
  mean = rewards_bg.mean(axis=1, keepdims=True)
  std = rewards_bg.std(axis=1, ddof=1, keepdims=True)
  return (rewards_bg - mean) / (std + eps)


def dr_grpo(*, rewards_bg):
  """r - mean_group: Dr. GRPO drops the std division, which over-weights easy/hard groups."""
  return rewards_bg - rewards_bg.mean(axis=1, keepdims=True)


def rloo(*, rewards_bg):
  """r_i - mean_{j != i} r_j, the leave-one-out baseline (= G/(G-1) * (r_i - mean))."""
  G = rewards_bg.shape[1]
  total = rewards_bg.sum(axis=1, keepdims=True)
  return rewards_bg - (total - rewards_bg) / (G - 1)


def reinforce_pp(*, rewards_bg, eps: float = 1e-6):
  """(r - mean_batch) / (std_batch + eps): normalised over the whole batch, no group baseline."""
  return (rewards_bg - rewards_bg.mean()) / (rewards_bg.std() + eps)


def reinforce_pp_baseline(*, rewards_bg, eps: float = 1e-6):
  """Group mean subtracted, then scaled by the batch std of the result."""
  centred = rewards_bg - rewards_bg.mean(axis=1, keepdims=True)
  return centred / (centred.std() + eps)


ESTIMATORS = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def compute(name: str, *, rewards_bg, clip: float | None = 5.0):
  """The named estimator, then clipping to +-clip (None disables)."""
  adv = ESTIMATORS[name](rewards_bg=jnp.asarray(rewards_bg, jnp.float32))
  return adv if clip is None else jnp.clip(adv, -clip, clip)


def zero_std_groups(*, rewards_bg):
  """[B] bool: groups whose G rewards are all equal (no learning signal under group baselines)."""
  return jnp.all(rewards_bg == rewards_bg[:, :1], axis=1)
