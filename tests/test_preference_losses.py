"""Golden values of the DPO-family losses on small hand-computed arrays."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.objectives import preference_losses as pl


def _a(*x):
  return jnp.asarray(x, jnp.float32)


def _sigmoid(z):
  return 1.0 / (1.0 + math.exp(-z))


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_dpo_is_ln2_when_policy_equals_reference(eps):
  logps_c, logps_r = _a(-3.0, -10.0, -0.5), _a(-7.0, -1.0, -2.5)
  loss, m = pl.dpo_loss(chosen_logps=logps_c, rejected_logps=logps_r, ref_chosen_logps=logps_c,
                        ref_rejected_logps=logps_r, beta=0.1, label_smoothing=eps)
  np.testing.assert_allclose(loss, [math.log(2)] * 3, rtol=1e-6)
  np.testing.assert_allclose(m["rewards/margins"], 0.0)
  np.testing.assert_allclose(m["rewards/accuracies"], 0.0)  # a tie is not a win
  np.testing.assert_allclose(m["logps/chosen"], logps_c)


def test_dpo_and_cdpo_hand_computed():
  # h = (-1 - -2) - (-3 - -2) = 2; beta h = 1.
  kw = dict(chosen_logps=_a(-1.0), rejected_logps=_a(-3.0), ref_chosen_logps=_a(-2.0),
            ref_rejected_logps=_a(-2.0), beta=0.5)
  loss, m = pl.dpo_loss(**kw)
  np.testing.assert_allclose(loss, [math.log1p(math.exp(-1))], rtol=1e-6)
  loss, m = pl.dpo_loss(**kw, label_smoothing=0.1)
  want = 0.9 * math.log1p(math.exp(-1)) + 0.1 * math.log1p(math.exp(1))  # 0.41326
  np.testing.assert_allclose(loss, [want], rtol=1e-6)
  np.testing.assert_allclose(m["rewards/chosen"], [0.5])
  np.testing.assert_allclose(m["rewards/rejected"], [-0.5])
  np.testing.assert_allclose(m["rewards/margins"], [1.0])
  np.testing.assert_allclose(m["rewards/accuracies"], [1.0])


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
  def f(c, r):
    return pl.dpo_loss(chosen_logps=c, rejected_logps=r, ref_chosen_logps=_a(-2.0),
                       ref_rejected_logps=_a(-2.0), beta=0.1)[0].sum()
  gc, gr = jax.grad(f, argnums=(0, 1))(_a(-2.0), _a(-2.0))
  # d/dc -log sigma(beta h) = -beta sigma(-beta h) = -0.05 at h = 0.
  np.testing.assert_allclose(gc, [-0.05], rtol=1e-6)
  np.testing.assert_allclose(gr, [0.05], rtol=1e-6)


def test_ipo_hand_computed_per_token_and_summed():
  # Chosen 2 tokens, rejected 3. Per-token: c=-1, r=-2, ref_c=-1.5, ref_r=-4/3:
  # h = 0.5 - (-2/3) = 7/6, 1/(2 beta) = 1, loss = (1/6)^2 = 1/36.
  kw = dict(chosen_logps=_a(-2.0), rejected_logps=_a(-6.0), ref_chosen_logps=_a(-3.0),
            ref_rejected_logps=_a(-4.0), chosen_len=_a(2.0), rejected_len=_a(3.0), beta=0.5)
  loss, m = pl.ipo_loss(**kw)
  np.testing.assert_allclose(loss, [1 / 36], rtol=1e-5)
  np.testing.assert_allclose(m["rewards/margins"], [0.5 * 7 / 6], rtol=1e-6)
  # The paper's sums: h = 1 - (-2) = 3, loss = (3 - 1)^2 = 4.
  loss, _ = pl.ipo_loss(**kw, per_token=False)
  np.testing.assert_allclose(loss, [4.0], rtol=1e-6)


def test_ipo_is_minimal_at_the_target_margin():
  # Policy = reference gives h = 0: loss (1/(2 beta))^2, and the gradient pushes h up.
  loss, _ = pl.ipo_loss(chosen_logps=_a(-1.0), rejected_logps=_a(-1.0),
                        ref_chosen_logps=_a(-1.0), ref_rejected_logps=_a(-1.0),
                        chosen_len=_a(1.0), rejected_len=_a(1.0), beta=0.25)
  np.testing.assert_allclose(loss, [4.0], rtol=1e-6)


def test_simpo_hand_computed():
  # beta/|y|: c = 2 * -2/2 = -2, r = 2 * -6/3 = -4; z = -2 + 4 - 0.5 = 1.5.
  loss, m = pl.simpo_loss(chosen_logps=_a(-2.0), rejected_logps=_a(-6.0), chosen_len=_a(2.0),
                          rejected_len=_a(3.0), beta=2.0, gamma=0.5)
  np.testing.assert_allclose(loss, [math.log1p(math.exp(-1.5))], rtol=1e-6)  # 0.201413
  np.testing.assert_allclose(m["rewards/chosen"], [-2.0])
  np.testing.assert_allclose(m["rewards/rejected"], [-4.0])
  np.testing.assert_allclose(m["rewards/margins"], [2.0])
  # With smoothing 0.2 as cDPO.
  loss, _ = pl.simpo_loss(chosen_logps=_a(-2.0), rejected_logps=_a(-6.0), chosen_len=_a(2.0),
                          rejected_len=_a(3.0), beta=2.0, gamma=0.5, label_smoothing=0.2)
  want = 0.8 * math.log1p(math.exp(-1.5)) + 0.2 * math.log1p(math.exp(1.5))
  np.testing.assert_allclose(loss, [want], rtol=1e-6)


def test_kto_crafted_batch_with_batch_reference_point():
  # r = [1, 0, -1, -2]; labels D, U, U, D; batch z0 = mean(r) = -0.5, clamped to 0.
  logps, ref = _a(-1.0, -2.0, -3.0, -4.0), _a(-2.0, -2.0, -2.0, -2.0)
  label = _a(1.0, 0.0, 0.0, 1.0)
  z0 = pl.kto_reference_point(logps=logps, ref_logps=ref)
  assert float(z0) == 0.0
  loss, m = pl.kto_loss(logps=logps, ref_logps=ref, label=label, z0=z0, beta=1.0,
                        desirable_weight=1.0, undesirable_weight=2.0)
  want = [1 - _sigmoid(1.0),            # desirable, r = 1
          2 * (1 - _sigmoid(0.0)),      # undesirable, r = 0: 1.0
          2 * (1 - _sigmoid(1.0)),      # undesirable, r = -1
          1 - _sigmoid(-2.0)]           # desirable, r = -2
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_allclose(m["rewards/accuracies"], [1.0, 0.0, 1.0, 0.0])
  np.testing.assert_allclose(m["rewards/chosen"], [1.0, 0.0, 0.0, -2.0])
  np.testing.assert_allclose(m["count/chosen"], [1.0, 0.0, 0.0, 1.0])


def test_kto_reference_point_from_mismatched_pairs_is_detached():
  kl_logps, kl_ref = _a(-1.0, -1.0), _a(-1.5, -1.7)  # KL estimate mean(0.5, 0.7) = 0.6
  logps, ref, label = _a(-1.0, -3.0), _a(-2.0, -2.0), _a(1.0, 0.0)

  def f(kl_logps, logps):
    z0 = pl.kto_reference_point(logps=kl_logps, ref_logps=kl_ref)
    return pl.kto_loss(logps=logps, ref_logps=ref, label=label, z0=z0, beta=1.0)[0].sum()

  want = (1 - _sigmoid(1.0 - 0.6)) + (1 - _sigmoid(0.6 - (-1.0)))
  np.testing.assert_allclose(f(kl_logps, logps), want, rtol=1e-6)
  g_kl, g_logps = jax.grad(f, argnums=(0, 1))(kl_logps, logps)
  np.testing.assert_array_equal(g_kl, 0.0)  # z0 carries no gradient
  assert g_logps[0] < 0 < g_logps[1]  # desirable pushed up, undesirable down


def test_orpo_crafted_case():
  # Chosen averages log 0.5 per token (odds 1), rejected log 0.2 (odds 1/4): log OR = log 4,
  # log sigma(log 4) = log 0.8; loss = NLL log 2 - 0.1 log 0.8.
  c, r = 2 * math.log(0.5), 3 * math.log(0.2)
  loss, m = pl.orpo_loss(chosen_logps=_a(c), rejected_logps=_a(r), chosen_len=_a(2.0),
                         rejected_len=_a(3.0), lam=0.1)
  np.testing.assert_allclose(loss, [math.log(2) - 0.1 * math.log(0.8)], rtol=1e-5)  # 0.715461
  np.testing.assert_allclose(m["log_odds_chosen"], [math.log(4)], rtol=1e-5)
  np.testing.assert_allclose(m["nll_loss"], [math.log(2)], rtol=1e-6)
  np.testing.assert_allclose(m["rewards/chosen"], [0.1 * math.log(0.5)], rtol=1e-6)
  np.testing.assert_allclose(m["rewards/accuracies"], [1.0])


def test_orpo_is_finite_near_probability_one():
  loss, m = pl.orpo_loss(chosen_logps=_a(-1e-9, -50.0), rejected_logps=_a(-1e-3, -60.0),
                         chosen_len=_a(1.0, 5.0), rejected_len=_a(1.0, 5.0), lam=1.0)
  assert np.isfinite(np.asarray(loss)).all()
  g = jax.grad(lambda c: pl.orpo_loss(chosen_logps=c, rejected_logps=_a(-1e-3, -60.0),
                                      chosen_len=_a(1.0, 5.0), rejected_len=_a(1.0, 5.0),
                                      lam=1.0)[0].sum())(_a(-1e-9, -50.0))
  assert np.isfinite(np.asarray(g)).all()


def test_nll_term_is_the_per_token_mean():
  np.testing.assert_allclose(pl.nll_term(chosen_logps=_a(-6.0, -1.0), chosen_len=_a(3.0, 2.0)),
                             [2.0, 0.5])
