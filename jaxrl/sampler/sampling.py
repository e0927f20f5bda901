"""Sampling settings, per-token keys, and the pure function that picks a token from logits.

The logprob returned with every token is log pi(token) under temperature scaling, *before*
top-k / top-p / min-p truncation:

    logp = log_softmax(logits / temperature)[token]

Truncation only decides which tokens may be drawn; it does not renormalise the reported
probability. This is exactly what the learner recomputes (jaxrl.models.token_logprobs with the
same temperature), so importance ratios between sampler and learner compare like with like. With
greedy decoding the token is the argmax and its logprob is the same expression.

Keys. A token's key is fold_in(fold_in(key(seed), sample), t): `sample` is the sample's global
index in the rollout (prompt * n + g) and `t` its token index (0 is the token sampled from the
prefill). Every (sample, token) pair gets its own key, so no key is reused across steps, slots or
samples, and a sample's tokens do not depend on which slot or step it was scheduled in:
continuous and static batching draw the same samples from the same seed. Callers that generate
several rollouts pass a fresh seed for each (e.g. fold the RL step into it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (hashable: they are compiled into the decode step).

  top_k=0, top_p=1.0 and min_p=0.0 each mean "off". `greedy` takes the argmax; its logprob is
  still reported under `temperature`. Generation stops at `eos_id`, at any of `stop_ids`, or after
  `max_new_tokens` tokens; the stop token is part of the completion.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  greedy: bool = False
  max_new_tokens: int = 64
  eos_id: int | None = 2
  stop_ids: tuple[int, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "stop_ids", tuple(int(s) for s in self.stop_ids))
    checks = [
        ("temperature", self.temperature > 0, "a number > 0 (use greedy for argmax)"),
        ("top_k", self.top_k >= 0, "an integer >= 0 (0 turns it off)"),
        ("top_p", 0 < self.top_p <= 1, "a number in (0, 1] (1 turns it off)"),
        ("min_p", 0 <= self.min_p < 1, "a number in [0, 1) (0 turns it off)"),
        ("max_new_tokens", self.max_new_tokens >= 1, "an integer >= 1"),
    ]
    for key, ok, want in checks:
      if not ok:
        raise ConfigError(f"sampling.{key}={getattr(self, key)!r} is not valid: use {want}.")

  @property
  def stop_tokens(self) -> tuple[int, ...]:
    return tuple(sorted(set(self.stop_ids) | ({self.eos_id} if self.eos_id is not None else set())))


def token_keys(key: jax.Array, sample_b: jax.Array, t_b: jax.Array) -> jax.Array:
  """Per-row keys [B]: fold_in(fold_in(key, sample), t). See the module docstring."""
  return step_keys(sample_keys(key, sample_b), t_b)


def sample_keys(key: jax.Array, sample_b: jax.Array) -> jax.Array:
  """Per-row keys [B] of each sample, fold_in(key, sample): token_keys' first fold, which a
  decode scan makes once per call (a slot's sample is fixed while it decodes)."""
  return jax.vmap(lambda s: jax.random.fold_in(key, s))(sample_b)


def step_keys(sample_keys_b: jax.Array, t_b: jax.Array) -> jax.Array:
  """Per-row keys [B] of token t of each sample, from sample_keys: fold_in(key_b, t_b)."""
  return jax.vmap(jax.random.fold_in)(sample_keys_b, t_b)


def sample_logits(logits_bv: jax.Array, keys_b: jax.Array, sp: SamplingParams, *,
                  mxu: bool = False):
  """(token [B] int32, logprob [B] float32) from fp32 logits [B, V].

  The logprob is log_softmax(logits / temperature) at the token, before truncation.

  mxu: the TPU's form of the untruncated draw (jaxrl.backends.decode_on_matrix_unit): the inverse
  CDF's block sums as a product on the matrix unit, and the log-probs' maximum taken as minus
  their log-sum-exp instead of another pass over [B, V]. The same tokens and log-probs, up to
  the order in which a block sum adds its 32 terms (see _inverse_cdf).
  """
  x_bv = logits_bv.astype(jnp.float32) / sp.temperature
  untruncated = not (sp.top_k and sp.top_k < logits_bv.shape[-1]) and not sp.min_p and (
      sp.top_p >= 1)
  if mxu and untruncated and not sp.greedy:
    # jax.nn.log_softmax's own steps, its log-sum-exp kept: max(logp) = max(x - m) - lse rounds
    # to 0 - lse exactly (rounding is monotone and max(x - m) is 0), so the draw's
    # exp(logp - max(logp)) is exp(logp + lse), bit for bit, without a reduction over V.
    shifted_bv = x_bv - jax.lax.stop_gradient(jnp.max(x_bv, axis=-1, keepdims=True))
    lse_b1 = jnp.log(jnp.sum(jnp.exp(shifted_bv), axis=-1, keepdims=True))
    logp_bv = shifted_bv - lse_b1
    token_b = _inverse_cdf(keys_b, logp_bv, mxu=True, neg_max_b1=lse_b1)
    return token_b, jnp.take_along_axis(logp_bv, token_b[:, None], axis=-1)[:, 0]
  logp_bv = jax.nn.log_softmax(x_bv, axis=-1)
  if sp.greedy:
    token_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  else:
    masked_bv = logp_bv
    neg = jnp.float32(-jnp.inf)
    if sp.top_k and sp.top_k < logits_bv.shape[-1]:
      kth_b = jax.lax.top_k(logp_bv, sp.top_k)[0][:, -1:]
      masked_bv = jnp.where(logp_bv >= kth_b, masked_bv, neg)
    if sp.min_p > 0:
      # min-p: keep tokens whose probability is at least min_p times the most likely one's.
      floor_b = jnp.max(logp_bv, axis=-1, keepdims=True) + jnp.log(sp.min_p)
      masked_bv = jnp.where(logp_bv >= floor_b, masked_bv, neg)
    if sp.top_p < 1:
      # Nucleus: the smallest set of most likely tokens whose mass reaches top_p (the token
      # that crosses the threshold is kept). Computed on the already-truncated distribution.
      sorted_bv = jnp.sort(masked_bv, axis=-1)[:, ::-1]
      probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
      before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # mass strictly above each token
      keep_bv = before_bv < sp.top_p
      cutoff_b = jnp.min(jnp.where(keep_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
      masked_bv = jnp.where(masked_bv >= cutoff_b, masked_bv, neg)
    token_b = _inverse_cdf(keys_b, masked_bv)
  logprob_b = jnp.take_along_axis(logp_bv, token_b[:, None], axis=-1)[:, 0]
  return token_b, logprob_b


def _inverse_cdf(keys_b: jax.Array, logp_bv: jax.Array, block: int = 32, *, mxu: bool = False,
                 neg_max_b1: jax.Array | None = None) -> jax.Array:
  """One draw per row from softmax(logp_bv) (-inf entries are never drawn), by inverse CDF on
  one uniform per row: the block of `block` tokens whose mass holds u * total, then the token
  inside that block.

  Exact up to fp32 rounding, like jax.random.categorical (Gumbel-max), which needs a uniform
  per vocabulary entry: on XLA:CPU its threefry bits were the decode step's largest non-matmul
  op (443 us per step at batch 64, V = 512; 37 us as this). Each choice takes the last
  position with positive mass whose exclusive prefix is <= the target, so a zero-probability
  token cannot be drawn even where rounding makes the prefix sums uneven.

  mxu: the block sums as a product with a ones matrix at full float32 precision on the matrix
  unit. XLA:TPU sums 32 neighbouring lanes with cross-lane shuffles: compiled for v5e, that
  [B, V / 32, 32] sum was the decode step's costliest op after the LM head (105 us per step at
  Qwen3-0.6B batch 64, 13 us as the product); on CPU the product would do 128x the sum's
  work. A block's 32 terms are then added in the matrix unit's order, so a target within a
  rounding error of a block's edge may fall on the other side of it. neg_max_b1: minus
  max(logp_bv) per row [B, 1], when the caller has it (the pass that finds it is skipped).
  """
  B, V = logp_bv.shape
  if V % block:
    block = V
  nb = V // block
  u_b = jax.vmap(jax.random.uniform)(keys_b)
  if neg_max_b1 is None:
    p_bv = jnp.exp(logp_bv - jnp.max(logp_bv, axis=-1, keepdims=True))
  else:
    p_bv = jnp.exp(logp_bv + neg_max_b1)
  p_bnk = p_bv.reshape(B, nb, block)

  def pick(mass_bm, target_b):
    # mass [B, M] >= 0, target in [0, total): the position whose cumulative interval holds it.
    excl_bm = jnp.cumsum(mass_bm, axis=-1) - mass_bm
    ok_bm = (mass_bm > 0) & (excl_bm <= target_b[:, None])
    return jnp.max(jnp.where(ok_bm, jnp.arange(mass_bm.shape[1]), 0), axis=-1), excl_bm

  if mxu:  # [B, nb, block] x [block, 128] (one lane tile of ones): every column is the sum
    ones_kc = jnp.ones((block, 128), p_bnk.dtype)
    s_bn = jnp.matmul(p_bnk, ones_kc, precision=jax.lax.Precision.HIGHEST)[..., 0]
  else:
    s_bn = jnp.sum(p_bnk, axis=-1)
  j_b, excl_bn = pick(s_bn, u_b * jnp.sum(s_bn, axis=-1))
  take = lambda x, i: jnp.take_along_axis(x, i[:, None], axis=1)[:, 0]
  # Where u falls inside block j, as a fraction of the block's mass, re-scaled to the block's own
  # sum (which may round differently from s_bn[j]).
  frac_b = jnp.clip((u_b * jnp.sum(s_bn, axis=-1) - take(excl_bn, j_b)) / take(s_bn, j_b), 0, 1)
  p_bk = jnp.take_along_axis(p_bnk, j_b[:, None, None], axis=1)[:, 0]
  i_b, _ = pick(p_bk, frac_b * jnp.sum(p_bk, axis=-1))
  return (j_b * block + i_b).astype(jnp.int32)


def is_stop(token_b: jax.Array, sp: SamplingParams) -> jax.Array:
  stops = sp.stop_tokens
  if not stops:
    return jnp.zeros(token_b.shape, bool)
  return jnp.any(token_b[:, None] == jnp.asarray(stops, jnp.int32)[None, :], axis=-1)


MODES = ("sample", "greedy")


def from_config(section, *, eos_id: int | None) -> SamplingParams:
  """SamplingParams from a config's `sampling` section (see configs/sample_tiny.py)."""
  stop_ids = section.get("stop_ids") or ()
  if isinstance(stop_ids, int):
    stop_ids = (stop_ids,)
  try:
    stop_ids = tuple(int(s) for s in stop_ids)
  except (TypeError, ValueError):
    raise ConfigError(f"sampling.stop_ids={section.get('stop_ids')!r} is not valid: give a tuple "
                      "of token ids, e.g. --config.sampling.stop_ids='(2, 10)'.") from None
  return SamplingParams(temperature=float(section.temperature), top_k=int(section.top_k),
                        top_p=float(section.top_p), min_p=float(section.min_p),
                        greedy=section.mode == "greedy",
                        max_new_tokens=int(section.max_new_tokens), eos_id=eos_id,
                        stop_ids=stop_ids)
