"""Chunked log-probs: the LM head over chunks of positions gives the unchunked log-probs,
entropy and losses, values and gradients, at every learner call site, and keeps far fewer
bytes live. The vocabulary is forced above model.chunk_min_vocab on tiny models; 12 positions
in chunks of 5 make three chunks, the last one ragged."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import (PRESETS, RewardModel, Transformer, abstract_model, get_preset,
                          reward_apply, token_logprobs)
from jaxrl.models.logprobs import chunked_token_logprobs, lm_head
from jaxrl.parallel import init_params, make_mesh, shard_activations
from jaxrl.algorithms.grpo.update import batch_logprobs
from jaxrl.algorithms.dpo import make_seq_logps
from jaxrl.algorithms.sft import sft_loss

V, B, T, CHUNK = 700, 3, 12, 5


def _cfgs(preset="tiny"):
  """(unchunked, chunked) configs of one tiny model with a vocabulary of V."""
  cfg = get_preset(preset).replace(vocab_size=V)
  assert not cfg.chunked_logits  # V is below the default threshold
  return cfg, cfg.replace(chunk_min_vocab=V, logits_chunk=CHUNK)


def _assert_grads_close(ga, gb, tol=1e-5):
  """Within float32 rounding (tol) of the largest gradient entry (the function's check in
  float64 agrees to 1e-13; what is left here is the order of float32 sums over V)."""
  scale = max(float(np.abs(np.asarray(y)).max()) for y in jax.tree.leaves(gb))
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol * scale)


# Tied without the entropy and untied with it; the call-site tests below cover the other two
# (GRPO's tied head with the entropy; SFT, DPO and the RM, untied, without).
@pytest.mark.parametrize("tied,entropy", [(True, False), (False, True)])
def test_chunked_equals_unchunked_function(tied, entropy):
  """The function alone, against token_logprobs of the full logits: both outputs and the
  gradients with respect to the hidden states and the head, at temperature 0.7."""
  D = 16
  ks = jax.random.split(jax.random.key(0), 5)
  h = jax.random.normal(ks[0], (B, T, D))
  w = jax.random.normal(ks[1], (V, D) if tied else (D, V))
  t = jax.random.randint(ks[2], (B, T), 0, V)
  g_logp, g_ent = jax.random.normal(ks[3], (B, T)), jax.random.normal(ks[4], (B, T))

  def plain(h, w):
    return token_logprobs(lm_head(h, w, tied=tied), t, temperature=0.7)

  def chunked(h, w, chunk=CHUNK):
    return chunked_token_logprobs(h, w, t, tied=tied, temperature=0.7, chunk=chunk,
                                  entropy=entropy)

  def loss(f, *a):
    logp, ent = f(*a)
    return jnp.sum(g_logp * logp) + (jnp.sum(g_ent * ent) if entropy else 0.0)

  (lp0, ent0), (lp1, ent1) = plain(h, w), jax.jit(chunked)(h, w)
  np.testing.assert_allclose(lp1, lp0, atol=2e-5, rtol=1e-6)
  if entropy:
    np.testing.assert_allclose(ent1, ent0, atol=2e-5, rtol=1e-6)
  else:
    assert ent1 is None
  g0 = jax.grad(functools.partial(loss, plain), argnums=(0, 1))(h, w)
  for chunk in (CHUNK, 4, T, 64):  # ragged, exact, one chunk, one chunk larger than T
    g1 = jax.jit(jax.grad(lambda h, w: loss(chunked, h, w, chunk), argnums=(0, 1)))(h, w)
    _assert_grads_close(g1, g0)


def _model(cfg, cls=Transformer, **kw):
  return nnx.split(cls(cfg, rngs=nnx.Rngs(7), **kw))


def _sft_batch(cfg, seed=1):
  toks = jax.random.randint(jax.random.key(seed), (B, T), 3, cfg.vocab_size)
  mask = (jnp.arange(T)[None, :] >= jnp.array([[2], [5], [0]])).astype(jnp.float32)
  return {"inputs": toks, "targets": jnp.roll(toks, -1, 1), "loss_mask": mask,
          "positions": jnp.broadcast_to(jnp.arange(T), (B, T)),
          "segment_ids": jnp.ones((B, T), jnp.int32)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sft_loss_chunked_equals_unchunked(dtype):
  """An untied head; in bf16 compute (float32 parameters) within bf16 rounding."""
  plain, chunked = (c.replace(dtype=dtype) for c in _cfgs("tiny-qwen3"))
  batch = _sft_batch(plain)
  out = []
  for cfg in (plain, chunked):
    graphdef, params = _model(cfg)
    fn = jax.jit(jax.value_and_grad(lambda p: sft_loss(graphdef)(p, batch, None)[0]))
    out.append(fn(params))
  bf16 = dtype == "bfloat16"
  np.testing.assert_allclose(float(out[1][0]), float(out[0][0]), rtol=1e-3 if bf16 else 1e-6)
  _assert_grads_close(out[1][1], out[0][1], tol=1e-2 if bf16 else 1e-5)


def test_grpo_logprobs_chunked_and_remat_equal_plain_on_a_mesh(devices):
  """GRPO's grouped forward (each prompt once, its G completions attending to it; the loss
  reads log-probs and entropy), sharded as the learner runs it on 8 devices with the
  backend's attention kernel, the vocab split over `tensor` and rows over `fsdp`: chunked and
  rematerialised, the same values and gradients as plain."""
  mesh = make_mesh(data=1, fsdp=2, tensor=4)
  plain, chunked = _cfgs("tiny-qwen2")
  chunked = chunked.replace(remat="full")
  P, G, Tp = 2, 2, 6
  batch = {"prompt": jax.random.randint(jax.random.key(2), (P, Tp), 3, V),
           "prompt_len": jnp.array([[4], [6]]),
           "completion": jax.random.randint(jax.random.key(4), (P * G, T), 3, V)}
  w = jax.random.normal(jax.random.key(5), (P * G, T))
  out = []
  for cfg in (plain, chunked):
    graphdef, params = init_params(cfg, mesh, "learner", seed=3)

    def loss(p):
      logp, ent = batch_logprobs(graphdef, p, batch, 0.8)
      return jnp.sum(w * logp) - 0.01 * jnp.sum(ent), (logp, ent)
    out.append(jax.jit(shard_activations(jax.value_and_grad(loss, has_aux=True), mesh))(params))
  ((v0, (lp0, e0)), g0), ((v1, (lp1, e1)), g1) = out
  np.testing.assert_allclose(lp1, lp0, atol=2e-5)
  np.testing.assert_allclose(e1, e0, atol=2e-5)
  np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
  _assert_grads_close(g1, g0)


def test_dpo_and_reward_logprobs_chunked_equal_unchunked():
  """DPO's sequence log-prob sums (policy and reference) and the reward model's log-prob
  feature: the same values and gradients chunked."""
  plain, chunked = _cfgs("tiny-qwen3")
  b, r = _sft_batch(plain), _sft_batch(plain, seed=2)
  rows = {k: jnp.stack([b[k], r[k]], axis=1) for k in b}  # [B, 2, T] pairs
  last = jnp.array([T - 1, T - 3, 5])
  out = []
  for cfg in (plain, chunked):
    graphdef, params = _model(cfg)
    seq = make_seq_logps(graphdef)
    dpo = jax.value_and_grad(lambda p: jnp.sum(seq(p, rows)[0] * jnp.array([1.0, -1.0])))
    rgd, rparams = _model(cfg, functools.partial(RewardModel, logprob_feature=True))
    rm = jax.value_and_grad(lambda p: jnp.sum(reward_apply(
        rgd, p, b["inputs"], b["positions"], last, logp_mask_bt=b["loss_mask"]) ** 2))
    out.append((jax.jit(dpo)(params), jax.jit(rm)(rparams)))
  for (v0, g0), (v1, g1) in zip(*out):
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-5)
    _assert_grads_close(g1, g0)


def test_chunking_is_on_for_large_vocabularies_only():
  assert all(not PRESETS[p].chunked_logits for p in ("tiny", "small", "bench"))
  assert all(PRESETS[p].chunked_logits for p in ("qwen3-0.6b", "qwen2.5-7b", "llama-3.1-8b"))
  assert not PRESETS["qwen3-0.6b"].replace(logits_chunk=0).chunked_logits


def test_chunked_loss_keeps_far_fewer_bytes():
  """XLA's count of a gradient program's temporaries on a Qwen-vocabulary model (one layer,
  V = 151,936) over 4 rows x 512 positions: unchunked, the [4, 512, V] float32 logits and their
  gradient (1.16 GiB each) are live; chunked by 128 positions, one chunk's."""
  base = get_preset("tiny-qwen3").replace(vocab_size=151_936, num_layers=1, max_seq_len=512)
  rows = jax.ShapeDtypeStruct((4, 512), jnp.int32)
  batch = {"inputs": rows, "targets": rows, "positions": rows}
  temp = {}
  for name, cfg in (("plain", base.replace(logits_chunk=0)),
                    ("chunked", base.replace(logits_chunk=128))):
    graphdef, shapes, _ = abstract_model(cfg)

    def loss(p, b):
      logp, ent = batch_logprobs(graphdef, p, b, 1.0)
      return logp.sum() + 0.01 * ent.sum()
    temp[name] = jax.jit(jax.grad(loss)).lower(shapes, batch).compile().memory_analysis(
    ).temp_size_in_bytes
  logits_bytes = 4 * 512 * 151_936 * 4
  assert temp["plain"] > 2 * logits_bytes, temp
  assert temp["chunked"] < logits_bytes, temp
