"""Llama-family decoder (flax.nnx), its config and presets."""

from jaxrl.models.config import PRESETS, ModelConfig, RopeScaling, get_preset, model_config_from
from jaxrl.models.llama import (CACHE_AXES, KVCache, Transformer, abstract_model, apply,
                                apply_logprobs, apply_rope, cache_shape, init_cache,
                                rope_inv_freq, token_logprobs)
from jaxrl.models.reward import RewardModel, last_index, reward_apply

__all__ = [
    "CACHE_AXES", "KVCache", "ModelConfig", "PRESETS", "RewardModel", "RopeScaling",
    "Transformer", "abstract_model", "apply", "apply_logprobs", "apply_rope", "cache_shape",
    "get_preset", "init_cache", "last_index", "model_config_from", "reward_apply",
    "rope_inv_freq", "token_logprobs",
]
