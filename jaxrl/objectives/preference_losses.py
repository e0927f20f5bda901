"""Offline preference losses (the DPO family): pure functions over per-sequence log-probs.

Every input is per example, [B]: `*_logps` are sums over the response tokens (and the eos) of
log pi(token), `*_len` their token counts, so a function that wants length-normalised log-probs
divides itself and says so. Each loss returns (loss_b, metrics) where loss_b [B] is the loss of
each example and metrics maps TRL's names to [B] values; the caller reduces (a mean over pairs,
or a masked mean for KTO's chosen/rejected subsets):

    rewards/chosen, rewards/rejected   the loss's implied reward of each response (detached)
    rewards/margins                    chosen minus rejected
    rewards/accuracies                 1.0 where the chosen reward exceeds the rejected one
    logps/chosen, logps/rejected       the policy's summed log-probs (as TRL logs them)

The variants follow TRL's DPOTrainer (sigmoid, ipo), KTOTrainer, ORPOTrainer and CPOTrainer
(simpo), which is what most users will compare against; each docstring says where that departs
from the paper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSSES = ("dpo", "ipo", "kto", "orpo", "simpo")
NEEDS_REFERENCE = {"dpo": True, "ipo": True, "kto": True, "orpo": False, "simpo": False}


def _pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> dict:
  c, r = jax.lax.stop_gradient(chosen_rewards), jax.lax.stop_gradient(rejected_rewards)
  return {"rewards/chosen": c, "rewards/rejected": r, "rewards/margins": c - r,
          "rewards/accuracies": (c > r).astype(jnp.float32),
          "logps/chosen": jax.lax.stop_gradient(chosen_logps),
          "logps/rejected": jax.lax.stop_gradient(rejected_logps)}


def _smoothed_sigmoid_loss(z, label_smoothing: float):
  """-(1 - eps) log sigma(z) - eps log sigma(-z): the binary cross-entropy against a label that
  is wrong with probability eps (eps = 0 is the plain -log sigma(z))."""
  return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(
      -z)


def dpo_loss(*, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
             beta: float = 0.1, label_smoothing: float = 0.0):
  """DPO (Rafailov et al. 2023, "Direct Preference Optimization"), TRL's loss_type="sigmoid".

      h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))   (summed log-probs)
      loss = -log sigma(beta h)

  label_smoothing = eps > 0 is conservative DPO (cDPO; Mitchell 2023, "A note on DPO with noisy
  preferences"): each label is assumed flipped with probability eps, so the loss is
  -(1 - eps) log sigma(beta h) - eps log sigma(-beta h); its minimum sits at a finite margin
  instead of pushing h to infinity. Implied rewards are beta * (log pi - log pi_ref).
  When the policy equals the reference, h = 0 and the loss is ln 2 for every eps.
  """
  chosen_ratio = chosen_logps - ref_chosen_logps
  rejected_ratio = rejected_logps - ref_rejected_logps
  loss = _smoothed_sigmoid_loss(beta * (chosen_ratio - rejected_ratio), label_smoothing)
  return loss, _pair_metrics(beta * chosen_ratio, beta * rejected_ratio, chosen_logps,
                             rejected_logps)


def ipo_loss(*, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_len,
             rejected_len, beta: float = 0.1, per_token: bool = True):
  """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences", the Psi = identity case of Psi-PO): a squared regression of the log-ratio
  margin onto 1/(2 beta) (here beta is the paper's tau), which, unlike DPO's sigmoid, does not
  keep pushing the margin up once the preference is fitted.

      h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))
      loss = (h - 1 / (2 beta))^2

  per_token=True (the default) follows TRL's loss_type="ipo": every log-prob is first divided by
  its response's token count, so h is a difference of per-token averages and 1/(2 beta) is on
  that scale. per_token=False is the paper's h over summed log-probs. Implied rewards are
  beta * (log pi - log pi_ref) on the same (averaged or summed) log-probs.
  """
  if per_token:
    cl, rl = jnp.maximum(chosen_len, 1.0), jnp.maximum(rejected_len, 1.0)
    chosen_logps, ref_chosen_logps = chosen_logps / cl, ref_chosen_logps / cl
    rejected_logps, ref_rejected_logps = rejected_logps / rl, ref_rejected_logps / rl
  chosen_ratio = chosen_logps - ref_chosen_logps
  rejected_ratio = rejected_logps - ref_rejected_logps
  loss = jnp.square(chosen_ratio - rejected_ratio - 1.0 / (2.0 * beta))
  return loss, _pair_metrics(beta * chosen_ratio, beta * rejected_ratio, chosen_logps,
                             rejected_logps)


def kto_reference_point(*, logps, ref_logps, mask=None):
  """KTO's z0: the batch estimate of KL(pi || pi_ref), mean(log pi - log pi_ref) over the rows
  given, clamped at 0 and detached (no gradient flows through the reference point).

  The paper (and TRL) pass mismatched pairs here: prompt x_i with the completion of another
  example y_j, so the estimate is of the KL over completions the policy did not condition on.
  Passing the batch's own rows instead is the cheaper estimate (no extra forward); it is biased
  upward on data the policy is already trained toward. `mask` [B] selects the rows to average.
  """
  diff = logps - ref_logps
  if mask is None:
    z0 = jnp.mean(diff)
  else:
    z0 = jnp.sum(diff * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  return jax.lax.stop_gradient(jnp.maximum(z0, 0.0))


def kto_loss(*, logps, ref_logps, label, z0, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0):
  """KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization"),
  over unpaired examples, as TRL's KTOTrainer:

      r = log pi(y|x) - log pi_ref(y|x)                  (summed log-probs)
      desirable   (label 1):  lambda_D * (1 - sigma(beta (r - z0)))
      undesirable (label 0):  lambda_U * (1 - sigma(beta (z0 - r)))

  z0 is the detached KL reference point (`kto_reference_point`). The paper writes the loss as
  lambda_y - v(x, y); dropping the constant lambda_y (as TRL does) changes no gradient. The
  paper suggests weights with lambda_D n_D / (lambda_U n_U) in [1, 4/3] when the classes are
  imbalanced. Shapes: logps, ref_logps, label [B] (label 1.0 desirable, 0.0 undesirable).

  Metrics are per row; rewards/chosen and logps/chosen are meaningful on desirable rows only,
  rewards/rejected and logps/rejected on undesirable ones (reduce them with masked means, as
  the masks `count/chosen` and `count/rejected` give). rewards/accuracies is 1.0 where the row
  sits on its label's side of the reference point (r > z0 for desirable, r < z0 otherwise).
  """
  ratio = logps - ref_logps
  desirable = desirable_weight * (1.0 - jax.nn.sigmoid(beta * (ratio - z0)))
  undesirable = undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (z0 - ratio)))
  loss = jnp.where(label > 0.5, desirable, undesirable)
  reward = jax.lax.stop_gradient(beta * ratio)
  lp = jax.lax.stop_gradient(logps)
  is_d = (label > 0.5).astype(jnp.float32)
  right = jnp.where(label > 0.5, ratio > z0, ratio < z0).astype(jnp.float32)
  metrics = {"rewards/chosen": reward * is_d, "rewards/rejected": reward * (1.0 - is_d),
             "rewards/accuracies": jax.lax.stop_gradient(right),
             "logps/chosen": lp * is_d, "logps/rejected": lp * (1.0 - is_d),
             "count/chosen": is_d, "count/rejected": 1.0 - is_d,
             "kl": jnp.broadcast_to(z0, ratio.shape)}
  return loss, metrics


def _log1m_exp(x):
  """log(1 - exp(x)) for x < 0, accurate near 0 and for large |x| (Maechler 2012)."""
  x = jnp.minimum(x, -1e-7)  # a probability of exactly 1 has infinite odds
  return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo_loss(*, chosen_logps, rejected_logps, chosen_len, rejected_len, lam: float = 0.1):
  """ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference
  Model"): the NLL of the chosen response plus lambda times an odds-ratio term, no reference.

      p_w = exp(log pi(y_w) / |y_w|),  p_l likewise     (length-averaged log-probs)
      log OR = log(p_w / (1 - p_w)) - log(p_l / (1 - p_l))
      loss = -log pi(y_w) / |y_w|  -  lambda * log sigma(log OR)

  As TRL's ORPOTrainer (whose `beta` is this lambda), implied rewards are lambda times the
  length-averaged log-probs. Departure: the NLL here is each chosen response's per-token mean,
  averaged over pairs; TRL's is the token-level mean over the whole batch (the two agree when
  the chosen responses have equal lengths). Extra metrics: nll_loss, log_odds_ratio (the mean
  of log sigma(log OR)) and log_odds_chosen (log OR).
  """
  c = chosen_logps / jnp.maximum(chosen_len, 1.0)
  r = rejected_logps / jnp.maximum(rejected_len, 1.0)
  log_odds = (c - r) - (_log1m_exp(c) - _log1m_exp(r))
  ratio = jax.nn.log_sigmoid(log_odds)
  nll = -c
  loss = nll - lam * ratio
  metrics = _pair_metrics(lam * c, lam * r, chosen_logps, rejected_logps)
  metrics.update({"nll_loss": jax.lax.stop_gradient(nll),
                  "log_odds_ratio": jax.lax.stop_gradient(ratio),
                  "log_odds_chosen": jax.lax.stop_gradient(log_odds)})
  return loss, metrics


def simpo_loss(*, chosen_logps, rejected_logps, chosen_len, rejected_len, beta: float = 2.0,
               gamma: float = 0.5, label_smoothing: float = 0.0):
  """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
  Reward"): the implied reward is the length-normalised log-prob beta / |y| log pi(y|x), and the
  chosen one must beat the rejected one by a target margin gamma; there is no reference model.

      loss = -log sigma(beta log pi(y_w) / |y_w| - beta log pi(y_l) / |y_l| - gamma)

  The same as TRL's CPOTrainer(loss_type="simpo"), which writes the margin as gamma / beta
  inside the bracket and also takes label smoothing (as cDPO, above). The paper's typical
  beta is 2.0-2.5 with gamma / beta around 0.5.
  """
  c = beta * chosen_logps / jnp.maximum(chosen_len, 1.0)
  r = beta * rejected_logps / jnp.maximum(rejected_len, 1.0)
  loss = _smoothed_sigmoid_loss(c - r - gamma, label_smoothing)
  return loss, _pair_metrics(c, r, chosen_logps, rejected_logps)


def nll_term(*, chosen_logps, chosen_len):
  """The optional SFT term on the chosen response, -log pi(y_w) / |y_w| per pair, which a
  trainer adds with a weight alpha (RPO, Pang et al. 2024, "Iterative Reasoning Preference
  Optimization"; TRL's rpo_alpha). It keeps the chosen response's likelihood from falling
  while the margin grows, the known failure of plain DPO on tasks with one right answer."""
  return -chosen_logps / jnp.maximum(chosen_len, 1.0)
