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
  Bradley-Terry loss only sees differences, and centering handles the offset)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.backbone = Transformer(cfg, rngs=rngs)
    if not cfg.tie_embeddings:
      # hidden() never reads the LM head; keeping it would cost V x D of dead weight (and
      # optimizer state) on every device.
      del self.backbone.lm_head
    self.head = nnx.Param(
        (jax.random.normal(rngs.params(), (cfg.embed_dim,)) * HEAD_INIT_STD).astype(
            _dtype(cfg.param_dtype)), axes=("embed",))

  def __call__(self, tokens_bt, positions_bt, last_b, *, segment_ids_bt=None):
    h_btd, _ = self.backbone.hidden(tokens_bt, positions_bt, segment_ids_bt=segment_ids_bt)
    h_bd = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)[:, 0]
    return jnp.einsum("BD,D->B", h_bd.astype(jnp.float32), self.head[...].astype(jnp.float32))


def last_index(mask_bt) -> jax.Array:
  """[B] index of each row's last true entry of `mask_bt` (its last non-pad token); 0 for an
  all-false row."""
  T = mask_bt.shape[1]
  return jnp.maximum(jnp.max(jnp.where(mask_bt > 0, jnp.arange(T), -1), axis=1), 0)


def reward_apply(graphdef, params, tokens_bt, positions_bt, last_b, *, segment_ids_bt=None):
  """Pure forward over nnx.split state: scores [B] float32. Jit this, not the module."""
  model = nnx.merge(graphdef, params)
  return model(tokens_bt, positions_bt, last_b, segment_ids_bt=segment_ids_bt)
