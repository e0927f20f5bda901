"""model.remat: every policy gives the plain model's loss and gradients, keeps less for the
backward, and leaves the sampler's programs as they were. (tests/test_chunked.py checks GRPO's
grouped forward on 8 devices rematerialised and chunked.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.errors import ConfigError
from jaxrl.models import ModelConfig, Transformer, abstract_model, apply, get_preset
from jaxrl.models.config import REMAT
from jaxrl.algorithms.grpo.update import batch_logprobs

POLICIES = [r for r in REMAT if r != "none"]


def _grads(cfg, batch):
  """(loss, grads) of a GRPO-like per-token loss (log-probs and entropy) over `batch`, through
  the learner's batch_logprobs."""
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(3)))
  w = jax.random.normal(jax.random.key(5), batch["targets"].shape)

  def loss(p, b):
    logp, ent = batch_logprobs(graphdef, p, b, 0.9)
    return jnp.sum(w * logp) + 0.1 * jnp.sum(w * ent)
  return jax.jit(jax.value_and_grad(loss))(params, batch)


def _close(a, b):
  (va, ga), (vb, gb) = a, b
  np.testing.assert_allclose(float(va), float(vb), rtol=1e-6)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5 * float(
        np.abs(np.asarray(y)).max()) + 1e-7)


def _rows(cfg, B=4, T=10):
  toks = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
  return {"inputs": toks, "targets": jnp.roll(toks, -1, 1),
          "positions": jnp.broadcast_to(jnp.arange(T), (B, T))}


@pytest.mark.parametrize("policy", POLICIES)
def test_remat_gradients_equal_plain(policy):
  cfg = get_preset("tiny-qwen3")
  batch = _rows(cfg)
  _close(_grads(cfg.replace(remat=policy), batch), _grads(cfg, batch))


def test_remat_keeps_less_for_the_backward():
  """XLA's own count of the gradient program's temporaries: remat is really in effect, and
  the policies order as they should (full < no-batch dots < all dots < none)."""
  cfg0 = get_preset("small")
  toks = jax.ShapeDtypeStruct((4, 128), jnp.int32)
  temp = {}
  for policy in REMAT:
    cfg = cfg0.replace(remat=policy)
    graphdef, shapes, _ = abstract_model(cfg)
    batch = {"inputs": toks, "targets": toks,
             "positions": jax.ShapeDtypeStruct((4, 128), jnp.int32)}
    fn = jax.jit(jax.grad(lambda p, b: batch_logprobs(graphdef, p, b, 1.0)[0].sum()))
    temp[policy] = fn.lower(shapes, batch).compile().memory_analysis().temp_size_in_bytes
  assert (temp["full"] < temp["dots_with_no_batch_dims_saveable"] < temp["dots_saveable"]
          < temp["none"]), temp
  assert temp["full"] < temp["none"] / 3, temp


def test_remat_leaves_decoding_alone():
  """The sampler's programs: a cached decode step traces no remat at all, and the
  full-sequence forward (prefill) gives bit-identical logits and KV."""
  cfg = get_preset("tiny")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  graphdef_r, _ = nnx.split(Transformer(cfg.replace(remat="full"), rngs=nnx.Rngs(0)))
  toks = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
  fwd = jax.jit(apply, static_argnums=0)
  (la, kva), (lb, kvb) = fwd(graphdef, params, toks), fwd(graphdef_r, params, toks)
  np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
  np.testing.assert_array_equal(np.asarray(kva[0][0]), np.asarray(kvb[0][0]))

  def decode(g):
    return jax.make_jaxpr(lambda p, c: apply(g, p, toks[:, :1], jnp.array([[7], [7]]),
                                             cache=c))(params, kva)
  assert "remat" in str(jax.make_jaxpr(
      lambda p: jax.grad(lambda q: apply(graphdef_r, q, toks)[0].sum())(p))(params))
  assert "remat" not in str(decode(graphdef_r))
  assert str(decode(graphdef_r)) == str(decode(graphdef))


def test_remat_bad_value_is_one_sentence():
  with pytest.raises(ConfigError, match=r"model.remat='dots'.*Choose one of: none, full"):
    ModelConfig(**{**get_preset("tiny").__dict__, "remat": "dots"})


def test_memory_knobs_are_config_overrides():
  """--config.model.remat / logits_chunk / chunk_min_vocab reach the ModelConfig every program
  is built from, with their types checked like every model field."""
  from jaxrl import config as config_lib
  c = config_lib.base_config()
  c.model.remat, c.model.logits_chunk, c.model.chunk_min_vocab = "full", "64", 256
  cfg = config_lib.model_config(c)
  assert (cfg.remat, cfg.logits_chunk, cfg.chunk_min_vocab) == ("full", 64, 256)
  assert cfg.chunked_logits  # the tiny preset's 512 words are above 256
  bad = config_lib.base_config()
  bad.model.logits_chunk = 1.5
  with pytest.raises(ConfigError, match="model.logits_chunk=1.5 has the wrong type"):
    config_lib.model_config(bad)
