"""PPO's critic-side math: per-token rewards, GAE, returns, whitening, the clipped value loss
and explained variance. Pure functions over masked [B, T] arrays.

`mask_bt` marks the action tokens (the sampled completion's tokens, in the learner batch's
alignment: index t is the action taken from the state read at index t, so the values V_t come
from the hidden state at the same index as the log-prob of that action). Positions off the mask
are skipped, not treated as steps: a row's trajectory is its masked tokens in order, the last
one terminal (V after it is 0). The completion need not start at index 0 (the learner batch
puts the prompt first) and may have holes.

References: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
Advantage Estimation" (GAE); Schulman et al. 2017, "Proximal Policy Optimization Algorithms"
and OpenAI baselines' PPO2 (the clipped value loss); Ziegler et al. 2019 / Ouyang et al. 2022
(the per-token KL penalty in the reward, the RLHF arrangement TRL's PPOTrainer, verl and
OpenRLHF follow).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def last_token_mask(mask_bt):
  """[B, T] float, 1.0 at each row's last masked index (none for an all-zero row)."""
  T = mask_bt.shape[1]
  last_b = jnp.max(jnp.where(mask_bt > 0, jnp.arange(T), -1), axis=1)
  return ((jnp.arange(T)[None, :] == last_b[:, None]) & (last_b[:, None] >= 0)).astype(
      jnp.float32)


def token_rewards(*, score_b, kl_bt, mask_bt, beta: float):
  """Per-token rewards of the RLHF arrangement (kl_in=reward):

      r_t = -beta * KL_t                         for every masked token t
      r_T = score - beta * KL_T                  at the row's last masked token T

  `score_b` [B] is the outcome reward (the task's checker, the reward model's score), `kl_bt`
  the per-token KL estimate of log pi_old - log pi_ref (k1 or k3, losses.kl_penalty). The sum
  over a row equals losses.kl_in_reward's sequence reward; only where the reward lands differs.
  Zero off the mask."""
  m = mask_bt.astype(jnp.float32)
  return (-beta * kl_bt + score_b[:, None] * last_token_mask(mask_bt)) * m


def gae(*, rewards_bt, values_bt, mask_bt, gamma: float = 1.0, lam: float = 0.95):
  """Generalized advantage estimation over each row's masked tokens, and the returns:

      delta_t = r_t + gamma * V_{t'} - V_t         t' the next masked index (V = 0 past the last)
      A_t     = delta_t + gamma * lam * A_{t'}      (A = 0 past the last)
      R_t     = A_t + V_t                           (the critic's regression target)

  A reverse lax.scan over T; an unmasked index passes the carry (V_{t'}, A_{t'}) through
  unchanged, so padding, the prompt and holes are not steps. Returns (adv_bt, returns_bt),
  both 0 off the mask. gamma = 1, lam = 0.95 are TRL's PPOTrainer defaults (verl and OpenRLHF
  default lam = 1). Values and rewards are treated as constants (no gradient flows)."""
  r = jax.lax.stop_gradient(rewards_bt).astype(jnp.float32)
  v = jax.lax.stop_gradient(values_bt).astype(jnp.float32)
  m = mask_bt > 0

  def back(carry, x):
    next_v, next_a = carry
    r_t, v_t, m_t = x
    delta = r_t + gamma * next_v - v_t
    a_t = delta + gamma * lam * next_a
    carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
    return carry, jnp.where(m_t, a_t, 0.0)

  B = r.shape[0]
  zero = jnp.zeros((B,), jnp.float32)
  _, adv_tb = jax.lax.scan(back, (zero, zero), (r.T, v.T, m.T), reverse=True)
  adv = adv_tb.T
  return adv, jnp.where(m, adv + v, 0.0)


def masked_mean(x_bt, mask_bt):
  """The mean of x over the mask's entries (0 for an empty mask)."""
  m = mask_bt.astype(jnp.float32)
  return (x_bt * m).sum() / jnp.maximum(m.sum(), 1.0)


def masked_var(x_bt, mask_bt, *, unbiased: bool = True):
  """The variance of x over the mask's entries; unbiased (n - 1) as TRL's masked_var."""
  m = mask_bt.astype(jnp.float32)
  n = m.sum()
  mean = masked_mean(x_bt, mask_bt)
  ss = (jnp.square(x_bt - mean) * m).sum()
  return ss / jnp.maximum(n - 1.0 if unbiased else n, 1.0)


def whiten(x_bt, mask_bt, *, shift_mean: bool = True, eps: float = 1e-8):
  """(x - mean) / sqrt(var + eps) with the mean and the (unbiased) variance over the mask's
  entries, 0 off the mask: TRL's masked_whiten, applied to the advantages over the batch's
  valid tokens. shift_mean=False keeps the mean (only rescales)."""
  mean = masked_mean(x_bt, mask_bt)
  out = (x_bt - mean) * jax.lax.rsqrt(masked_var(x_bt, mask_bt) + eps)
  if not shift_mean:
    out = out + mean
  return jnp.where(mask_bt > 0, out, 0.0)


def clipped_value_loss(*, values_bt, old_values_bt, returns_bt, value_clip: float | None):
  """PPO2's clipped value loss per token, and where the clipped branch won:

      V_clip = V_old + clip(V - V_old, -c, c)
      L_t    = 1/2 * max((V - R)^2, (V_clip - R)^2)

  c = value_clip (TRL's cliprange_value, 0.2); None is the plain 1/2 (V - R)^2. The max keeps
  the update pessimistic: moving V more than c from V_old toward R gains nothing. Returns
  (loss_bt, clipped_bt), clipped_bt true where (V_clip - R)^2 > (V - R)^2 (critic/clipfrac,
  as TRL's vf_clipfrac). The caller reduces over the mask."""
  unclipped = jnp.square(values_bt - returns_bt)
  if value_clip is None:
    return 0.5 * unclipped, jnp.zeros(values_bt.shape, bool)
  v_clip = old_values_bt + jnp.clip(values_bt - old_values_bt, -value_clip, value_clip)
  clipped = jnp.square(v_clip - returns_bt)
  return 0.5 * jnp.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(*, values_bt, returns_bt, mask_bt):
  """1 - Var(R - V) / Var(R) over the mask's entries: 1 is a perfect critic, 0 no better than
  a constant, negative worse than one. A constant target (Var(R) = 0) gives 1.0 when V matches
  it exactly and 0.0 otherwise (scikit-learn's force_finite), never NaN."""
  var_r = masked_var(returns_bt, mask_bt, unbiased=False)
  var_res = masked_var(returns_bt - values_bt, mask_bt, unbiased=False)
  return jnp.where(var_r > 0, 1.0 - var_res / jnp.where(var_r > 0, var_r, 1.0),
                   jnp.where(var_res > 0, 0.0, 1.0))
