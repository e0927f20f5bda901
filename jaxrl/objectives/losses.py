"""Policy losses for the GRPO family: pure functions returning per-token values [B, T].

The caller reduces with `aggregate(..., mode=)`; masks mark completion tokens. Log-probs are
log pi(token) of the sampled tokens under temperature scaling, the same quantity the sampler
returns, so ratios compare like with like.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def clipped_pg_loss(*, logp, old_logp, adv, mask=None, eps_low: float = 0.2,
                    eps_high: float = 0.2, dual_clip_c: float | None = None,
                    ratio_level: str = "token"):
  """PPO's clipped surrogate, negated: -min(r A, clip(r, 1-eps_low, 1+eps_high) A).

  Shapes: logp, old_logp [B, T]; adv [B, T] or [B] (broadcast over tokens); mask [B, T].
  Returns (loss_bt, clipped_low_bt, clipped_high_bt): the per-token loss and where the ratio
  was clipped below / above (for clipfrac/low and clipfrac/high).

  Variants:
    * eps_high > eps_low is DAPO's clip-higher (Yu et al. 2025), which leaves room for
      low-probability tokens to grow.
    * dual_clip_c (Ye et al. 2020, dual-clip PPO): for A < 0 the loss is capped at -c A, so a
      huge ratio on a negative advantage cannot dominate. c must exceed 1.
    * ratio_level="sequence" is GSPO (Zheng et al. 2025): one ratio per sequence,
      exp(mean over its tokens of logp - old_logp), used for every token. GSPO's paper clips
      that ratio with eps around 3e-4 / 4e-4; pass them.
  """
  if adv.ndim == 1:
    adv = adv[:, None]
  log_ratio = logp - old_logp
  if ratio_level == "sequence":
    m = jnp.ones_like(logp) if mask is None else mask
    seq = (log_ratio * m).sum(-1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    log_ratio = jnp.broadcast_to(seq, logp.shape)
  elif ratio_level != "token":
    raise ValueError(f"ratio_level={ratio_level!r}: use 'token' or 'sequence'")
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  surrogate = jnp.minimum(ratio * adv, clipped * adv)
  if dual_clip_c is not None:
    surrogate = jnp.where(adv < 0, jnp.maximum(surrogate, dual_clip_c * adv), surrogate)
  # Clipping is active where the clipped branch wins the min (the gradient is then zero).
  low = (ratio < 1.0 - eps_low) & (adv < 0)
  high = (ratio > 1.0 + eps_high) & (adv > 0)
  return -surrogate, low, high


def kl_penalty(*, logp, ref_logp, estimator: str = "k3", clamp: float | None = None):
  """Per-token KL(pi || pi_ref) estimates from samples of pi (Schulman 2020, "Approximating KL
  Divergence"): with log r = ref_logp - logp,
    k1 = -log r                     unbiased, high variance, can be negative
    k2 = (log r)^2 / 2              biased, low variance
    k3 = (r - 1) - log r            unbiased, low variance, >= 0 (GRPO's choice)
  `clamp` bounds the result to [-clamp, clamp] (verl clamps k3 at 10); None leaves it.
  """
  log_r = ref_logp - logp
  if estimator == "k1":
    kl = -log_r
  elif estimator == "k2":
    kl = 0.5 * jnp.square(log_r)
  elif estimator == "k3":
    # Clip inside exp so a token the reference finds impossible cannot overflow to inf.
    kl = jnp.exp(jnp.clip(log_r, -20.0, 20.0)) - 1.0 - log_r
  else:
    raise ValueError(f"estimator={estimator!r}: use 'k1', 'k2' or 'k3'")
  return kl if clamp is None else jnp.clip(kl, -clamp, clamp)


def kl_in_reward(*, rewards_b, kl_bt, mask_bt, beta: float):
  """KL placed in the reward instead of the loss: r - beta * sum_t KL_t per sequence (the
  InstructGPT/PPO arrangement; the KL then shapes the advantage, not the gradient)."""
  return rewards_b - beta * (kl_bt * mask_bt).sum(-1)


def adaptive_kl_beta(beta: float, *, kl: float, target: float, horizon: int = 10_000,
                     n_steps: int = 1) -> float:
  """Ziegler et al. 2019's proportional controller: nudges beta toward the KL target."""
  error = min(max(kl / target - 1.0, -0.2), 0.2)
  return beta * (1.0 + error * n_steps / horizon)


def truncated_is_weight(*, old_logp, sampler_logp, cap: float = 2.0):
  """min(pi_old / pi_sampler, cap), stop-gradient: corrects for the sampler's numerics (or
  staleness) differing from the learner's (Yao et al. 2025, truncated importance sampling)."""
  return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logp - sampler_logp), cap))


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")


def aggregate_sums(loss_bt, mask_bt, *, mode: str = "token-mean", norm_len: int | None = None):
  """(numerator, denominator) of `aggregate`, so micro-batches and devices can add them up
  before one division (the shared train step divides the summed loss by the summed weight)."""
  m = mask_bt.astype(loss_bt.dtype)
  masked = loss_bt * m
  B, T = loss_bt.shape
  if mode == "token-mean":
    return masked.sum(), m.sum()
  if mode == "seq-mean-token-mean":
    return (masked.sum(-1) / jnp.maximum(m.sum(-1), 1.0)).sum(), jnp.asarray(B, loss_bt.dtype)
  if mode == "seq-mean-token-sum":
    return masked.sum(), jnp.asarray(B, loss_bt.dtype)
  if mode == "seq-mean-token-sum-norm":
    return masked.sum() / (norm_len or T), jnp.asarray(B, loss_bt.dtype)
  raise ValueError(f"mode={mode!r}: choose one of {', '.join(AGGREGATIONS)}")


def aggregate(loss_bt, mask_bt, *, mode: str = "token-mean", norm_len: int | None = None):
  """Reduces a per-token loss to a scalar.

    token-mean               sum / number of valid tokens in the batch (DAPO)
    seq-mean-token-mean      mean over sequences of each sequence's token mean (GRPO paper)
    seq-mean-token-sum       mean over sequences of each sequence's token sum
    seq-mean-token-sum-norm  sum / (B * norm_len), a constant normaliser (Dr. GRPO);
                             norm_len defaults to T, the padded completion length
  """
  num, den = aggregate_sums(loss_bt, mask_bt, mode=mode, norm_len=norm_len)
  return num / jnp.maximum(den, 1.0)


def masked_mean(x_bt, mask_bt):
  m = mask_bt.astype(x_bt.dtype)
  return (x_bt * m).sum() / jnp.maximum(m.sum(), 1.0)
