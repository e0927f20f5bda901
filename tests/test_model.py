"""The model's two forward modes agree, on a 2 (fsdp) x 4 (tensor) mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models import apply, get_preset, init_cache, token_logprobs
from jaxrl.parallel import cache_sharding, init_params, make_mesh

TINY = ("tiny", "tiny-qwen2", "tiny-qwen3", "tiny-llama3")


@pytest.fixture(scope="module")
def mesh(devices):
  return make_mesh(data=1, fsdp=2, tensor=4)


def _forward():
  return jax.jit(lambda g, p, t, pos=None, seg=None, cache=None: apply(
      g, p, t, pos, segment_ids_bt=seg, cache=cache), static_argnums=0)


FWD = _forward()


@pytest.mark.parametrize("preset", TINY)
def test_cached_decode_matches_full_forward(mesh, preset):
  cfg = get_preset(preset)
  graphdef, params = init_params(cfg, mesh, "learner", seed=1)
  B, T, S = 2, 12, 16
  seq = jax.random.randint(jax.random.key(0), (B, T), 3, cfg.vocab_size)
  full, prefix_kv = FWD(graphdef, params, seq)
  full = np.asarray(full)

  # Slot 0 prefilled with 5 tokens, slot 1 with 3 (then right-padded): per-slot positions.
  lengths = np.array([5, 3])
  prompt = np.array(seq[:, :5])
  prompt[1, 3:] = 0
  cache = jax.device_put(init_cache(cfg, B, S),
                         [cache_sharding(mesh, cfg, B, S)] * cfg.num_layers)
  pos = jnp.broadcast_to(jnp.arange(5), (B, 5))
  logits, cache = FWD(graphdef, params, jnp.asarray(prompt), pos, cache=cache)
  for b in range(B):
    np.testing.assert_allclose(np.asarray(logits)[b, :lengths[b]], full[b, :lengths[b]],
                               atol=2e-5, rtol=1e-5)
  # Full-sequence mode hands back the prefix KV that a cached prefill writes.
  for c, x in zip(cache[0], prefix_kv[0]):  # keys, then values
    np.testing.assert_allclose(np.asarray(c)[0, :, :5], np.asarray(x)[0, :, :5], atol=1e-6)
  for i in range(T - lengths.max()):
    p = lengths + i
    tok = np.asarray(seq)[np.arange(B), p][:, None]
    logits, cache = FWD(graphdef, params, jnp.asarray(tok), jnp.asarray(p)[:, None],
                        cache=cache)
    np.testing.assert_allclose(np.asarray(logits)[:, 0], full[np.arange(B), p], atol=2e-5,
                               rtol=1e-5)
  assert cache[0][0].sharding.is_equivalent_to(cache_sharding(mesh, cfg, B, S), 4)


def test_packed_segments_match_separate_sequences(mesh):
  cfg = get_preset("tiny-qwen3")
  graphdef, params = init_params(cfg, mesh, "learner")
  a = jax.random.randint(jax.random.key(1), (1, 5), 3, 300)
  b = jax.random.randint(jax.random.key(2), (1, 7), 3, 300)
  packed = jnp.concatenate([a, b], 1)
  seg = jnp.array([[1] * 5 + [2] * 7])
  pos = jnp.array([list(range(5)) + list(range(7))])
  la, _ = FWD(graphdef, params, a)
  lb, _ = FWD(graphdef, params, b)
  lp, _ = FWD(graphdef, params, packed, pos, seg)
  np.testing.assert_allclose(np.asarray(lp)[0, :5], np.asarray(la)[0], atol=2e-5)
  np.testing.assert_allclose(np.asarray(lp)[0, 5:], np.asarray(lb)[0], atol=2e-5)


def test_token_logprobs_and_entropy_golden():
  # Two-way vocab: logits [0, ln 3] -> p = [1/4, 3/4]; logp(1) = ln 0.75, H = -(.25 ln .25 +
  # .75 ln .75) = 0.5623351. At temperature 2 the logits halve: p = [1/(1+sqrt 3), ...].
  logits = jnp.array([[[0.0, np.log(3.0)]]])
  lp, ent = token_logprobs(logits, jnp.array([[1]]))
  np.testing.assert_allclose(lp, [[np.log(0.75)]], rtol=1e-6)
  np.testing.assert_allclose(ent, [[0.5623351]], rtol=1e-6)
  lp2, _ = token_logprobs(logits, jnp.array([[0]]), temperature=2.0)
  np.testing.assert_allclose(lp2, [[np.log(1 / (1 + np.sqrt(3.0)))]], rtol=1e-6)


def test_bf16_compute_keeps_fp32_logits(mesh):
  cfg = get_preset("tiny").replace(dtype="bfloat16", param_dtype="bfloat16")
  graphdef, params = init_params(cfg, mesh, "learner")
  assert params["embed"].dtype == jnp.bfloat16
  tokens = jax.random.randint(jax.random.key(3), (2, 8), 3, 300)
  logits, _ = FWD(graphdef, params, tokens)
  assert logits.dtype == jnp.float32
  cfg32 = cfg.replace(dtype="float32", param_dtype="float32")
  g32, p32 = init_params(cfg32, mesh, "learner")
  ref, _ = FWD(g32, jax.tree.map(lambda x: x.astype(jnp.float32), params), tokens)
  # bf16 keeps ~3 significant digits; logits of a fresh model are O(0.1).
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=3e-2)


def test_gradients_flow_to_every_parameter(mesh):
  cfg = get_preset("tiny-qwen2")
  graphdef, params = init_params(cfg, mesh, "learner")
  tokens = jax.random.randint(jax.random.key(4), (2, 8), 3, 300)

  def loss(p):
    logits, _ = apply(graphdef, p, tokens[:, :-1])
    lp, _ = token_logprobs(logits, tokens[:, 1:])
    return -lp.mean()

  grads = jax.jit(jax.grad(loss))(params)
  norms = jax.tree.map(lambda g: float(jnp.abs(g).sum()), grads)
  # Biases start at zero but still get gradient; every leaf must be finite and nonzero.
  for path, n in jax.tree_util.tree_flatten_with_path(norms)[0]:
    assert np.isfinite(n) and n > 0, path
  # Gradients keep the parameters' shardings.
  gate = params["layers"][0]["mlp"]["gate"]
  assert grads["layers"][0]["mlp"]["gate"].sharding.is_equivalent_to(gate.sharding, 2)


def test_per_head_cache_write_is_the_per_slot_write():
  """The TPU's form of a decode step's cache write (one row per slot and KV head,
  jaxrl.backends.writes_cache_per_head) places the same values as the per-slot window, and
  drops a position past the cache's end the same way."""
  from jaxrl.models.llama import _write_positions
  cache = jax.random.normal(jax.random.key(0), (3, 2, 5, 4))
  new = jax.random.normal(jax.random.key(1), (3, 2, 4))
  pos = jnp.array([0, 4, 5])  # 5: past the end, written nowhere
  per_slot = _write_positions(cache, new, pos)
  np.testing.assert_array_equal(_write_positions(cache, new, pos, per_head=True), per_slot)
  np.testing.assert_array_equal(per_slot[1, :, 4], new[1])
  np.testing.assert_array_equal(per_slot[2], cache[2])
