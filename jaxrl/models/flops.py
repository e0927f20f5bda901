"""Model FLOPs: the arithmetic a forward pass needs, for the throughput metrics (perf/tflops/*).

A phase's TFLOP/s is its model FLOPs over its wall time. The count is what the model needs,
not what an implementation spends: padding, a decode window wider than the sequence, the masked
half of a causal score matrix and recomputation are not counted, so the figure compares
implementations and hardware on the same work (PaLM's "model FLOPs", Chowdhery et al. 2022,
appendix B; MaxText logs the same kind of figure as TFLOP/s per device).

Per token fed through the model, 2 FLOPs per weight of every matrix product: q, k, v and the
output projection, the MLP's gate, up and down, and the LM head (tied or not; the embedding
lookup is a gather). Per (query, key) pair a token attends to, 4 * num_heads * head_dim per
layer: q.k and the weighted sum of v. Norms, RoPE, SwiGLU's product and softmax are left out:
XLA's cost analysis of the compiled forward counts 0.6% (bench preset) to 1.1% (tiny) more, and
3x this count for the gradient within 4% (tests/test_flops.py). A backward pass costs twice its
forward: the activations' gradients and the weights'. With LoRA the frozen base has no weight
gradients, so a train step's backward costs one forward and the adapters' (train_flops).

A sequence of prompt P and completion C feeds P + C - 1 tokens: the completion's last token
is sampled (or scored) but never fed. Token i of the sequence attends to i + 1 keys. With
`share_prompt`, each group's prompt is fed once for its G completions, as jaxrl's sampler
(group insert) and learner (Transformer.grouped_hidden) run it; without, once per row.
"""

from __future__ import annotations

import numpy as np

from jaxrl.models.config import ModelConfig


def matmul_weights(cfg: ModelConfig, *, lm_head: bool = True) -> int:
  """Weights that take part in a matrix product per token (biases and norms excluded);
  lm_head=False leaves out the [V, D] head (a reward model's backbone computes no logits)."""
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
  return cfg.num_layers * layer + (cfg.vocab_size * d if lm_head else 0)


def forward_flops(cfg: ModelConfig, *, tokens: float, pairs: float,
                  lm_head: bool = True) -> float:
  """FLOPs of a forward pass that feeds `tokens` tokens with `pairs` (query, key) pairs."""
  attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
  return 2.0 * matmul_weights(cfg, lm_head=lm_head) * tokens + float(attention) * pairs


def train_flops(cfg: ModelConfig, forward: float) -> float:
  """Model FLOPs of a forward and its backward, given the forward's: 3x, or 2x with LoRA (the
  frozen base takes no weight gradients; the adapters' arithmetic is left out, as the forward
  count leaves it out: rank r adds 2r(D + N) per weight matrix, about 1% at rank 16)."""
  return (2.0 if cfg.lora_rank else 3.0) * forward


def sequence_counts(prompt_lengths, completion_lengths, prompt_index=None, *,
                    share_prompt: bool = True) -> tuple[float, float]:
  """(tokens, pairs) fed to run rows of prompt + completion, each row's prompt once per
  distinct prompt_index when `share_prompt` (rows with the same index share their prompt)."""
  p = np.asarray(prompt_lengths, np.float64)
  c = np.maximum(np.asarray(completion_lengths, np.float64) - 1, 0)  # the last is never fed
  if share_prompt and prompt_index is not None:
    _, first = np.unique(np.asarray(prompt_index), return_index=True)
    prompts = p[first]
  else:
    prompts = p
  tokens = prompts.sum() + c.sum()
  # prompt token i attends to i + 1 keys; completion token j (fed at position p + j) to p + j + 1
  pairs = (prompts * (prompts + 1) / 2).sum() + (c * p + c * (c + 1) / 2).sum()
  return float(tokens), float(pairs)


def rollout_flops(cfg: ModelConfig, rollout, *, share_prompt: bool = True) -> float:
  """Model FLOPs of one forward pass over a Rollout's prompts and completions: the sampler's
  work to generate it, and a learner forward's (reference, old log-probs) to score it."""
  tokens, pairs = sequence_counts(rollout.prompt_lengths, rollout.lengths,
                                  rollout.prompt_index, share_prompt=share_prompt)
  return forward_flops(cfg, tokens=tokens, pairs=pairs)


def packed_counts(segment_ids, positions) -> tuple[float, float]:
  """(tokens, pairs) fed by rows of packed examples (jaxrl.data.pipeline's segment_ids, 0 on
  padding, and positions, restarting per example): a real token at position p attends to the
  p + 1 keys of its own example."""
  real = np.asarray(segment_ids) > 0
  return float(real.sum()), float((np.asarray(positions)[real] + 1).sum())


def packed_flops(cfg: ModelConfig, batch: dict, prefix: str = "", *,
                 lm_head: bool = True) -> float:
  """Model FLOPs of one forward pass over a packed batch's rows (any leading shape: SFT rows
  [B, S], preference pairs [B, 2, S]); `prefix` picks other rows of the same batch ("kl_")."""
  tokens, pairs = packed_counts(batch[prefix + "segment_ids"], batch[prefix + "positions"])
  return forward_flops(cfg, tokens=tokens, pairs=pairs, lm_head=lm_head)
