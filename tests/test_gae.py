"""Golden tests of PPO's critic-side math (jaxrl/objectives/gae.py): GAE against a plain Python
loop on random ragged masked batches, the value-clip loss and explained variance on
hand-computed vectors, per-token rewards and whitening."""

import numpy as np
import pytest

from jaxrl.objectives import gae as gae_lib
from jaxrl.objectives import losses


def loop_gae(rewards, values, mask, gamma, lam):
  """The textbook recursion, one row at a time over its masked indices only."""
  B, T = rewards.shape
  adv, ret = np.zeros((B, T)), np.zeros((B, T))
  for b in range(B):
    idx = [t for t in range(T) if mask[b, t] > 0]
    next_v, next_a = 0.0, 0.0
    for t in reversed(idx):
      delta = rewards[b, t] + gamma * next_v - values[b, t]
      next_a = delta + gamma * lam * next_a
      next_v = values[b, t]
      adv[b, t] = next_a
      ret[b, t] = next_a + values[b, t]
  return adv, ret


def ragged_mask(rng, B, T, holes=False):
  """Rows whose completions start after a prompt of random length and end at a random length
  (some empty), optionally with holes inside."""
  mask = np.zeros((B, T), np.float32)
  for b in range(B):
    start = rng.integers(0, T // 2)
    n = rng.integers(0, T - start + 1)
    mask[b, start:start + n] = 1.0
  if holes:
    mask *= rng.random((B, T)) > 0.2
  return mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0), (1.0, 1.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_python_loop(gamma, lam, holes):
  rng = np.random.default_rng([int(gamma * 100), int(lam * 100), holes])
  B, T = 7, 13
  mask = ragged_mask(rng, B, T, holes)
  # Garbage off the mask must not leak in.
  rewards = rng.normal(size=(B, T)).astype(np.float32)
  values = rng.normal(size=(B, T)).astype(np.float32)
  adv, ret = gae_lib.gae(rewards_bt=rewards, values_bt=values, mask_bt=mask, gamma=gamma,
                         lam=lam)
  want_adv, want_ret = loop_gae(rewards * mask, values, mask, gamma, lam)
  np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(adv)[mask == 0] == 0) and np.all(np.asarray(ret)[mask == 0] == 0)


def test_gae_lam1_gamma1_is_reward_to_go_minus_value():
  # lam = gamma = 1: A_t = sum_{k >= t} r_k - V_t (the Monte Carlo return minus the baseline).
  r = np.array([[0.0, 1.0, 2.0, 3.0, 9.0]], np.float32)
  v = np.array([[5.0, 0.5, 0.25, 1.0, 7.0]], np.float32)
  m = np.array([[0, 1, 1, 1, 0]], np.float32)
  adv, ret = gae_lib.gae(rewards_bt=r, values_bt=v, mask_bt=m, gamma=1.0, lam=1.0)
  np.testing.assert_allclose(np.asarray(ret), [[0, 6, 5, 3, 0]], atol=1e-6)
  np.testing.assert_allclose(np.asarray(adv), [[0, 5.5, 4.75, 2.0, 0]], atol=1e-6)


def test_token_rewards_put_score_on_last_token_and_kl_everywhere():
  score = np.array([1.0, -2.0, 3.0], np.float32)
  kl = np.full((3, 5), 0.5, np.float32)
  m = np.array([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], np.float32)
  r = np.asarray(gae_lib.token_rewards(score_b=score, kl_bt=kl, mask_bt=m, beta=0.1))
  want = np.array([[0, -0.05, -0.05, 0.95, 0], [-0.05, -2.05, 0, 0, 0], [0, 0, 0, 0, 0]])
  np.testing.assert_allclose(r, want, atol=1e-6)
  # Summed, it is the sequence-level KL-in-reward of the GRPO path (a non-empty row).
  np.testing.assert_allclose(r.sum(1)[:2], np.asarray(losses.kl_in_reward(
      rewards_b=score, kl_bt=kl, mask_bt=m, beta=0.1))[:2], atol=1e-6)


def test_clipped_value_loss_hand_vectors():
  v = np.array([[1.0, 0.0, 2.0, 0.5]], np.float32)
  old = np.array([[0.0, 0.0, 1.0, 0.5]], np.float32)
  ret = np.array([[2.0, 1.0, 0.0, 0.5]], np.float32)
  loss, clipped = gae_lib.clipped_value_loss(values_bt=v, old_values_bt=old, returns_bt=ret,
                                             value_clip=0.2)
  # token 0: V moved 1.0 toward R=2; clipped V = 0.2: (0.2-2)^2=3.24 > (1-2)^2=1 -> 1.62, clipped
  # token 1: V = V_old: both (0-1)^2 = 1 -> 0.5, not clipped
  # token 2: V moved away from R=0 to 2; V_clip = 1.2: 1.44 < 4 -> 2.0, not clipped
  # token 3: exact -> 0
  np.testing.assert_allclose(np.asarray(loss), [[1.62, 0.5, 2.0, 0.0]], atol=1e-6)
  np.testing.assert_array_equal(np.asarray(clipped), [[True, False, False, False]])
  plain, never = gae_lib.clipped_value_loss(values_bt=v, old_values_bt=old, returns_bt=ret,
                                            value_clip=None)
  np.testing.assert_allclose(np.asarray(plain), [[0.5, 0.5, 2.0, 0.0]], atol=1e-6)
  assert not np.asarray(never).any()


def test_explained_variance_hand_vectors():
  m = np.array([[1, 1, 1, 1, 0]], np.float32)
  ret = np.array([[1.0, 2.0, 3.0, 4.0, 100.0]], np.float32)
  # Var(R) over the mask = 1.25; residual [0.5, 0.5, -0.5, -0.5] has variance 0.25 -> 0.8.
  v = np.array([[0.5, 1.5, 3.5, 4.5, -7.0]], np.float32)
  ev = float(gae_lib.explained_variance(values_bt=v, returns_bt=ret, mask_bt=m))
  assert ev == pytest.approx(0.8, abs=1e-6)
  assert float(gae_lib.explained_variance(values_bt=ret, returns_bt=ret, mask_bt=m)) == \
      pytest.approx(1.0)
  # A constant critic at the mean explains nothing; one off by a constant too.
  assert float(gae_lib.explained_variance(values_bt=np.full_like(ret, 2.5), returns_bt=ret,
                                          mask_bt=m)) == pytest.approx(0.0, abs=1e-6)
  # Anti-correlated: residual 2(R - 2.5) has variance 5 -> 1 - 4 = -3.
  assert float(gae_lib.explained_variance(values_bt=5.0 - ret, returns_bt=ret, mask_bt=m)) == \
      pytest.approx(-3.0, abs=1e-5)
  const = np.array([[2.0, 2.0, 2.0, 2.0, 0.0]], np.float32)
  assert float(gae_lib.explained_variance(values_bt=const, returns_bt=const, mask_bt=m)) == 1.0
  assert float(gae_lib.explained_variance(values_bt=const + ret, returns_bt=const,
                                          mask_bt=m)) == 0.0


def test_whiten_over_valid_tokens():
  m = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
  x = np.array([[1.0, 3.0, 50.0], [5.0, 7.0, -9.0]], np.float32)
  w = np.asarray(gae_lib.whiten(x, m))
  vals = np.array([1.0, 3.0, 5.0, 7.0])
  want = (vals - 4.0) / np.sqrt(vals.var(ddof=1) + 1e-8)
  np.testing.assert_allclose(w[m > 0], want, rtol=1e-5)
  assert np.all(w[m == 0] == 0)
