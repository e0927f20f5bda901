"""JetStream-style sampler: an engine over decode slots and a continuously batched rollout
driver. See engine.py for the contract and sampling.py for keys and logprobs."""

from jaxrl.sampler.engine import DecodeState, Engine, Prefix, bucket, window, window_bucket
from jaxrl.sampler.rollout import Rollout, generate, metrics
from jaxrl.sampler.sampling import SamplingParams, is_stop, sample_logits, token_keys

__all__ = [
    "DecodeState", "Engine", "Prefix", "Rollout", "SamplingParams", "bucket", "generate",
    "is_stop", "metrics", "sample_logits", "token_keys", "window", "window_bucket",
]
