"""A reward model: the Llama-family decoder with a scalar head on the last real token.

    model = RewardModel(cfg, rngs=nnx.Rngs(0))
    scores_b = model(tokens_bt, positions_bt, last_b)         # [B] float32

The params are a pure nested dict like the policy's, {"backbone": <Transformer params>,
"head": [D]}, every leaf with `axes` metadata, so the same layouts shard it and the same
checkpoints hold it. The backbone starts from an SFT checkpoint (or a preset / HF checkpoint);
the head is new. It reads the final-normed hidden state of each row's last non-pad token
(TRL's and OpenRLHF's convention), which has attended to the whole prompt and response.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.llama import Transformer, _dtype

# HF's initializer_range for a sequence-classification head: scores start within ~0.2 of
# zero, so the Bradley-Terry loss starts near ln 2 and the head does not swamp the backbone.
HEAD_INIT_STD = 0.02


class RewardModel(nnx.Module):
  """The decoder's hidden states and a linear head [D] -> one scalar per row (no bias: the
  Bradley-Terry loss only sees differences, and centering handles the offset).

  With logprob_feature=True the score also adds w * (the mean log-probability of the response
  tokens under the backbone's own LM head), w a learned scalar that starts at 1: the model
  starts from its backbone's own judgment of the response and learns from there. A backbone
  taken from an SFT policy already knows which answers are likely: on built-in addition the SFT
  policy's own log-probability ranks held-out honest pairs correctly 96% of the time, while a
  last-token head alone learnt 58-66%. The response tokens are those of `logp_mask_bt` (1 where
  the next token is a response token, as a pair batch's loss_mask) up to the last read token.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, logprob_feature: bool = False):
    self.cfg = cfg
    self.logprob_feature = logprob_feature
    self.backbone = Transformer(cfg, rngs=rngs)
    if not cfg.tie_embeddings and not logprob_feature:
      # hidden() never reads the LM head; keeping it would cost V x D of dead weight (and
      # optimizer state) on every device.
      del self.backbone.lm_head
    self.head = nnx.Param(
        (jax.random.normal(rngs.params(), (cfg.embed_dim,)) * HEAD_INIT_STD).astype(
            _dtype(cfg.param_dtype)), axes=("embed",))
    if logprob_feature:
      self.logprob_weight = nnx.Param(jnp.ones((), _dtype(cfg.param_dtype)), axes=())

  def __call__(self, tokens_bt, positions_bt, last_b, *, segment_ids_bt=None, logp_mask_bt=None):
    h_btd, _ = self.backbone.hidden(tokens_bt, positions_bt, segment_ids_bt=segment_ids_bt)
    h_bd = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)[:, 0]
    score_b = jnp.einsum("BD,D->B", h_bd.astype(jnp.float32), self.head[...].astype(jnp.float32))
    if self.logprob_feature:
      if logp_mask_bt is None:
        raise ValueError("a RewardModel with logprob_feature needs logp_mask_bt")
      logp_bt, _ = self.backbone.token_logprobs(h_btd, jnp.roll(tokens_bt, -1, axis=1),
                                                entropy=False)
      T = tokens_bt.shape[1]
      mask_bt = (logp_mask_bt > 0) & (jnp.arange(T)[None, :] < last_b[:, None])
      mean_b = (logp_bt * mask_bt).sum(1) / jnp.maximum(mask_bt.sum(1), 1)
      score_b = score_b + self.logprob_weight[...].astype(jnp.float32) * mean_b
    return score_b

  def head_values(self, h_btd):
    """The head on every position's hidden state: [B, T] float32 (PPO's critic reads a value
    per token where the reward model reads one per row)."""
    return jnp.einsum("BTD,D->BT", h_btd.astype(jnp.float32),
                      self.head[...].astype(jnp.float32))

  def values(self, tokens_bt, positions_bt, *, segment_ids_bt=None):
    """V of every position [B, T]: the head on the final-normed hidden state at t, which has
    read tokens 0..t (so V_t sits where the log-prob of token t+1 does)."""
    h_btd, _ = self.backbone.hidden(tokens_bt, positions_bt, segment_ids_bt=segment_ids_bt)
    return self.head_values(h_btd)

  def grouped_values(self, prompt_pt, prompt_len_p, completion_nt):
    """values() in the shared-prompt form (Transformer.grouped_hidden): [N, Tc], index t the
    value of the state that predicts completion_nt[n, t]."""
    return self.head_values(self.backbone.grouped_hidden(prompt_pt, prompt_len_p,
                                                         completion_nt))


def last_index(mask_bt) -> jax.Array:
  """[B] index of each row's last true entry of `mask_bt` (its last non-pad token); 0 for an
  all-false row."""
  T = mask_bt.shape[1]
  return jnp.maximum(jnp.max(jnp.where(mask_bt > 0, jnp.arange(T), -1), axis=1), 0)


def reward_apply(graphdef, params, tokens_bt, positions_bt, last_b, *, segment_ids_bt=None,
                 logp_mask_bt=None):
  """Pure forward over nnx.split state: scores [B] float32. Jit this, not the module."""
  model = nnx.merge(graphdef, params)
  return model(tokens_bt, positions_bt, last_b, segment_ids_bt=segment_ids_bt,
               logp_mask_bt=logp_mask_bt)
