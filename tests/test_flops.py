"""Model FLOPs (jaxrl.models.flops), checked against hand counts, a loop over tokens and XLA's
own cost analysis of the compiled model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Transformer, apply, get_preset
from jaxrl.models.flops import forward_flops, matmul_weights, rollout_flops, sequence_counts
from jaxrl.sampler.rollout import Rollout


def test_matmul_weights_are_the_params_less_embedding_biases_and_norms():
  for name in ("tiny", "bench", "qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "qwen2.5-7b"):
    cfg = get_preset(name)
    d, n, k, h, L = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    bias = L * (n * h + 2 * k * h) if cfg.qkv_bias else 0
    qk_norm = L * 2 * h if cfg.qk_norm else 0
    norms = L * 2 * d + d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d  # untied: a second [V, D] table
    # Tied: the embedding table is the LM head's weight; untied: the input table is a lookup.
    assert matmul_weights(cfg) == cfg.num_params - bias - qk_norm - norms - head, name


def test_sequence_counts_by_hand_and_by_loop():
  # One prompt of 3 shared by completions of 2 and 4 tokens: the prompt feeds 3 tokens
  # (1 + 2 + 3 pairs); the completions feed 1 and 3 (their last is never fed), at positions
  # 3 and 3, 4, 5, attending to 4 and 4 + 5 + 6 keys.
  assert sequence_counts([3, 3], [2, 4], [0, 0]) == (7.0, 6 + 4 + 15)
  assert sequence_counts([3, 3], [2, 4], [0, 0], share_prompt=False) == (10.0, 12 + 4 + 15)
  rng = np.random.default_rng(0)
  P, G = 5, 4
  plen = rng.integers(1, 20, P)
  clen = rng.integers(0, 30, P * G)
  index = np.repeat(np.arange(P), G)
  for share in (True, False):
    tokens = pairs = 0
    for row in range(P * G):
      p = int(plen[index[row]])
      if not share or row % G == 0:
        for i in range(p):
          tokens, pairs = tokens + 1, pairs + i + 1
      for j in range(max(int(clen[row]) - 1, 0)):
        tokens, pairs = tokens + 1, pairs + p + j + 1
    assert sequence_counts(plen[index], clen, index, share_prompt=share) == (tokens, pairs)


@pytest.mark.parametrize("preset", ["tiny", "bench"])
def test_forward_flops_match_xla_cost_analysis(preset):
  """XLA's count of the compiled forward (every op, the full T x T score matrix) is ours for
  T x T pairs plus the elementwise ops we leave out: 0.6% (bench) to 1.1% (tiny) here."""
  cfg = get_preset(preset)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  B, T = 4, 32
  tokens = jnp.zeros((B, T), jnp.int32)
  analysis = jax.jit(lambda p, t: apply(graphdef, p, t)[0]).lower(
      params, tokens).compile().cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  ours = forward_flops(cfg, tokens=B * T, pairs=B * T * T)
  assert 1.0 <= analysis["flops"] / ours <= 1.02
  # A backward pass costs two forwards: XLA's count of the gradient is 3x ours within 4%.
  grad = jax.jit(jax.grad(lambda p, t: apply(graphdef, p, t)[0].sum())).lower(
      params, tokens).compile().cost_analysis()
  grad = grad[0] if isinstance(grad, list) else grad
  assert grad["flops"] / (3 * ours) == pytest.approx(1.0, abs=0.04)


def test_rollout_flops_count_a_shared_prompt_once():
  cfg = get_preset("tiny")
  G, P = 4, 2
  prompt_lengths = np.array([5] * G + [7] * G)
  lengths = np.array([3, 1, 0, 8, 2, 2, 2, 2])
  rollout = Rollout(
      prompt_ids=np.zeros((P * G, 7), np.int32), prompt_lengths=prompt_lengths,
      completion_ids=np.zeros((P * G, 8), np.int32), completion_mask=np.zeros((P * G, 8)),
      logprobs=np.zeros((P * G, 8), np.float32), lengths=lengths,
      finish_reasons=["length"] * (P * G), prompt_index=np.repeat(np.arange(P), G), stats={})
  shared, each = rollout_flops(cfg, rollout), rollout_flops(cfg, rollout, share_prompt=False)
  # Sharing saves G - 1 prompt passes per group.
  saved = (G - 1) * sum(forward_flops(cfg, tokens=p, pairs=p * (p + 1) / 2) for p in (5, 7))
  assert each - shared == pytest.approx(saved)
  tokens, pairs = sequence_counts(prompt_lengths, lengths, rollout.prompt_index)
  assert shared == forward_flops(cfg, tokens=tokens, pairs=pairs)


def test_a_reward_backbone_leaves_out_the_lm_head():
  cfg = get_preset("tiny")
  assert matmul_weights(cfg) - matmul_weights(cfg, lm_head=False) == cfg.vocab_size * cfg.embed_dim
  assert (forward_flops(cfg, tokens=10, pairs=0) - forward_flops(cfg, tokens=10, pairs=0,
                                                                  lm_head=False)
          == 2 * 10 * cfg.vocab_size * cfg.embed_dim)
