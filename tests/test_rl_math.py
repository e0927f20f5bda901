"""Golden values for advantages and losses (published vectors and hand-worked arrays)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.objectives import advantages, losses


def test_clipped_pg_golden():
  # adv [1, -1, 2], ratios [0.5, 1, 1.5], eps 0.2 -> per-token [-0.5, 1.0, -2.4].
  ratio = jnp.array([[0.5, 1.0, 1.5]])
  loss, low, high = losses.clipped_pg_loss(logp=jnp.log(ratio), old_logp=jnp.zeros((1, 3)),
                                           adv=jnp.array([[1.0, -1.0, 2.0]]))
  np.testing.assert_allclose(loss, [[-0.5, 1.0, -2.4]], rtol=1e-6)
  assert low.tolist() == [[False, False, False]] and high.tolist() == [[False, False, True]]


def test_dual_clip_golden():
  # adv [1, -1, -4], ratios [0.5, 1, 10], c = 3 -> [-0.5, 1.0, 12.0] (not 40).
  ratio = jnp.array([[0.5, 1.0, 10.0]])
  adv = jnp.array([[1.0, -1.0, -4.0]])
  loss, _, _ = losses.clipped_pg_loss(logp=jnp.log(ratio), old_logp=jnp.zeros((1, 3)), adv=adv,
                                      dual_clip_c=3.0)
  np.testing.assert_allclose(loss, [[-0.5, 1.0, 12.0]], rtol=1e-5)
  plain, _, _ = losses.clipped_pg_loss(logp=jnp.log(ratio), old_logp=jnp.zeros((1, 3)), adv=adv)
  np.testing.assert_allclose(plain[0, 2], 40.0, rtol=1e-5)


def test_clip_higher_is_asymmetric():
  # DAPO: eps_low 0.2, eps_high 0.28; ratio 1.25 with A=1 is not clipped, 1.3 is (at 1.28).
  ratio = jnp.array([[1.25, 1.3, 0.75]])
  loss, low, high = losses.clipped_pg_loss(logp=jnp.log(ratio), old_logp=jnp.zeros((1, 3)),
                                           adv=jnp.array([[1.0, 1.0, -1.0]]), eps_low=0.2,
                                           eps_high=0.28)
  np.testing.assert_allclose(loss, [[-1.25, -1.28, 0.8]], rtol=1e-6)
  assert high.tolist() == [[False, True, False]] and low.tolist() == [[False, False, True]]


def test_gspo_uses_one_ratio_per_sequence():
  # Sequence log-ratios: row 0 tokens [0.2, -0.2, (pad 5.0)] -> mean 0 -> ratio 1 everywhere.
  logp = jnp.array([[0.2, -0.2, 5.0], [0.1, 0.1, 0.1]])
  mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
  loss, _, _ = losses.clipped_pg_loss(logp=logp, old_logp=jnp.zeros((2, 3)),
                                      adv=jnp.array([1.0, 1.0]), mask=mask, eps_low=1.0,
                                      eps_high=1.0, ratio_level="sequence")
  np.testing.assert_allclose(loss[0], [-1.0, -1.0, -1.0], rtol=1e-6)
  np.testing.assert_allclose(loss[1], -np.exp(0.1) * np.ones(3), rtol=1e-6)


def test_kl_estimators_golden():
  # logp [-1, -1, -1] vs ref [0, -15, -30]: k1 [-1, 14, 29], k2 [0.5, 98, 420.5],
  # k3 = e^(ref-logp) - (ref-logp) - 1 ~ [0.7183, 13, 28].
  logp = jnp.array([-1.0, -1.0, -1.0])
  ref = jnp.array([0.0, -15.0, -30.0])
  np.testing.assert_allclose(losses.kl_penalty(logp=logp, ref_logp=ref, estimator="k1"),
                             [-1.0, 14.0, 29.0], rtol=1e-6)
  np.testing.assert_allclose(losses.kl_penalty(logp=logp, ref_logp=ref, estimator="k2"),
                             [0.5, 98.0, 420.5], rtol=1e-6)
  np.testing.assert_allclose(losses.kl_penalty(logp=logp, ref_logp=ref, estimator="k3"),
                             [0.7182818, 13.000001, 28.0], rtol=1e-5)
  np.testing.assert_allclose(
      losses.kl_penalty(logp=logp, ref_logp=ref, estimator="k3", clamp=10.0),
      [0.7182818, 10.0, 10.0], rtol=1e-5)


def _loop_grpo(r, eps):
  out = np.zeros_like(r)
  for b in range(r.shape[0]):
    g = r[b]
    mean = sum(g) / len(g)
    std = (sum((x - mean) ** 2 for x in g) / (len(g) - 1)) ** 0.5
    for i, x in enumerate(g):
      out[b, i] = (x - mean) / (std + eps)
  return out


def _loop_rloo(r):
  out = np.zeros_like(r)
  for b in range(r.shape[0]):
    for i in range(r.shape[1]):
      others = [r[b, j] for j in range(r.shape[1]) if j != i]
      out[b, i] = r[b, i] - sum(others) / len(others)
  return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_and_rloo_equal_loop_implementations(seed):
  rng = np.random.default_rng(seed)
  r = rng.normal(size=(6, 8)).astype(np.float64)
  r[0] = 1.0  # a zero-variance group
  np.testing.assert_allclose(advantages.grpo(rewards_bg=jnp.asarray(r), eps=1e-6),
                             _loop_grpo(r, 1e-6), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(advantages.rloo(rewards_bg=jnp.asarray(r)), _loop_rloo(r),
                             rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(advantages.grpo(rewards_bg=jnp.asarray(r)))[0] == 0)


def test_other_estimators_hand_values():
  r = jnp.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
  np.testing.assert_allclose(advantages.dr_grpo(rewards_bg=r),
                             [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]])
  # Batch mean 0.625, population std sqrt(0.234375) = 0.4841229.
  np.testing.assert_allclose(advantages.reinforce_pp(rewards_bg=r, eps=0.0),
                             (np.asarray(r) - 0.625) / 0.4841229, rtol=1e-6)
  # REINFORCE++-baseline: the group-centred values (as for dr_grpo), over their batch std.
  c = np.array([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]])
  np.testing.assert_allclose(advantages.reinforce_pp_baseline(rewards_bg=r, eps=0.0),
                             c / c.std(), rtol=1e-6)
  np.testing.assert_allclose(advantages.compute("rloo", rewards_bg=jnp.array([[10.0, -10.0]]),
                                                clip=5.0), [[5.0, -5.0]])
  assert advantages.zero_std_groups(rewards_bg=jnp.array([[1.0, 1.0], [0.0, 1.0]])).tolist() == [
      True, False]


def test_aggregation_modes_hand_values():
  loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
  mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
  assert float(losses.aggregate(loss, mask, mode="token-mean")) == pytest.approx(10 / 4)
  assert float(losses.aggregate(loss, mask, mode="seq-mean-token-mean")) == pytest.approx(
      (2.0 + 4.0) / 2)
  assert float(losses.aggregate(loss, mask, mode="seq-mean-token-sum")) == pytest.approx(
      (6.0 + 4.0) / 2)
  assert float(losses.aggregate(loss, mask, mode="seq-mean-token-sum-norm")) == pytest.approx(
      10 / (2 * 3))
  assert float(losses.aggregate(loss, mask, mode="seq-mean-token-sum-norm",
                                norm_len=5)) == pytest.approx(10 / 10)
  with pytest.raises(ValueError, match="choose one of token-mean"):
    losses.aggregate(loss, mask, mode="mean")


def test_kl_in_reward_adaptive_beta_and_tis():
  r = losses.kl_in_reward(rewards_b=jnp.array([1.0, 0.0]), kl_bt=jnp.array([[0.5, 0.5], [1.0,
                          2.0]]), mask_bt=jnp.array([[1.0, 0.0], [1.0, 1.0]]), beta=0.1)
  np.testing.assert_allclose(r, [0.95, -0.3], rtol=1e-6)
  # KL twice the target: error clipped to +0.2; beta grows by 0.2 * n / horizon.
  assert losses.adaptive_kl_beta(0.1, kl=0.2, target=0.1, horizon=100, n_steps=10) == \
      pytest.approx(0.1 * 1.02)
  assert losses.adaptive_kl_beta(0.1, kl=0.09, target=0.1, horizon=100, n_steps=10) == \
      pytest.approx(0.1 * (1 - 0.01))
  w = losses.truncated_is_weight(old_logp=jnp.array([0.0, 0.0]),
                                 sampler_logp=jnp.array([-0.1, -5.0]), cap=2.0)
  np.testing.assert_allclose(w, [np.exp(0.1), 2.0], rtol=1e-6)
