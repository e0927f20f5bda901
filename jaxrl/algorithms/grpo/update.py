"""GRPO's update (step 6) and the learner forwards it shares with the experience: the
log-probs of a batch in either layout, where the old log-probs come from, the loss, and one
step's num_iterations x minibatches optimizer updates."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.backends import compiler_options
from jaxrl.models import apply_logprobs
from jaxrl.parallel import shard_activations
from jaxrl.parallel.distributed import to_host
from jaxrl.objectives import losses
from jaxrl.algorithms.grpo.batch import device_batch

if TYPE_CHECKING:
  from jaxrl.algorithms.grpo.batch import Experience
  from jaxrl.algorithms.grpo.parts import Parts


def update(p: Parts, state, experience: Experience):
  """Step 6: algo.num_iterations passes over the experience, each split into algo.minibatches
  optimizer updates of the clipped surrogate (+ beta * KL, - entropy bonus) through the shared
  jitted train step, in an order drawn from (seed, step). Returns the state and the updates'
  metrics on the host: their means (the last one's lr), the old policy's entropy and
  is_ratio/mean (old_policy_means), and timing_s/update."""
  t0 = time.perf_counter()
  upd = []
  for mb in minibatches(p, experience):
    state, m = p.learner.train_step(state, p.put(device_batch(p, mb, p.config.optim.accum_steps)))
    upd.append(m)
  upd = to_host(upd)
  t_update = time.perf_counter() - t0

  def mean(k):
    return float(np.mean([u[k] for u in upd]))

  # The old policy's token sums: the separate forward's, else the (one) update's own.
  old = old_policy_means(experience.old_sums if experience.old_sums is not None else upd[0])
  return state, {"loss": mean("loss"), "grad_norm": mean("grad_norm"),
                 "lr": float(upd[-1]["lr"]), "kl": mean("kl"), "entropy": old["entropy"],
                 "clipfrac/low": mean("clipfrac/low"), "clipfrac/high": mean("clipfrac/high"),
                 "is_ratio/mean": old["is_ratio/mean"], "timing_s/update": t_update}


def minibatches(p: Parts, experience: Experience):
  """The host minibatches of one step's updates, in order: algo.num_iterations passes over the
  experience's batch, each split into algo.minibatches in an order drawn from (seed, step).
  With the shared-prompt layout a minibatch holds whole groups (their prompt rows and their G
  completion rows each)."""
  a, G = p.config.algo, p.config.rollout.group_size
  full = experience.batch
  N = full["mask"].shape[0]
  rng = np.random.default_rng([p.config.seed, experience.step])
  for _ in range(a.num_iterations):
    if p.learner.grouped:
      for groups in np.array_split(rng.permutation(N // G), a.minibatches):
        rows = (groups[:, None] * G + np.arange(G)).reshape(-1)
        yield {k: v[groups] if k in ("prompt", "prompt_len") else v[rows]
               for k, v in full.items()}
    else:
      for mb in np.array_split(rng.permutation(N), a.minibatches):
        yield {k: v[mb] for k, v in full.items()}


# ----------------------------------------------------------------------------- old log-probs


def old_logp_from_update(a) -> bool:
  """Where the old log-probs (pi_old, the policy's own before this step's updates) come from;
  the one place that decides it. True: the update's own forward, under stop_gradient (the same
  values, one forward fewer; TRL does the same). That needs one update per step (num_iterations
  = minibatches = 1), and KL in the loss (KL in the reward needs them before the advantages).
  False: a separate forward in make_experience, whose values the batch carries as old_logp."""
  return bool(a.old_logp_from_update and a.num_iterations * a.minibatches == 1
              and a.kl_in == "loss")


def sampler_log_ratio(*, old_logp, sampler_logp, mask):
  """log(pi_old / pi_sampler) per token [N, T], 0 off the mask: the sampler's numerics (and
  staleness, when generation overlaps) against the learner's. Host (numpy) or device arrays."""
  xp = np if isinstance(old_logp, np.ndarray) else jnp
  return xp.where(mask > 0, old_logp - sampler_logp, 0.0)


def old_policy_sums(*, log_ratio, entropy, mask) -> dict:
  """Sums over the mask's tokens of pi_old / pi_sampler and of the old policy's entropy, and the
  token count: computed by whichever forward gave the old log-probs, on the device (the loss)
  or on the host (a separate forward), with the same operations."""
  xp = np if isinstance(log_ratio, np.ndarray) else jnp
  return {"is_ratio_tokens": (xp.exp(log_ratio) * mask).sum(),
          "entropy_tokens": (entropy * mask).sum(), "tokens": mask.sum()}


def old_policy_means(sums) -> dict:
  """is_ratio/mean and entropy, token means whatever the loss's aggregation, from
  old_policy_sums (or an update's metrics, which scale all three by the same weight)."""
  tokens = max(sums["tokens"], 1e-9)
  return {"entropy": float(sums["entropy_tokens"] / tokens),
          "is_ratio/mean": float(sums["is_ratio_tokens"] / tokens)}


# ----------------------------------------------------------------------------- forwards and loss


def batch_logprobs(graphdef, params, batch, temperature: float, *, entropy: bool = True):
  """(log-probs, entropy or None) of a learner batch's targets, in either form:
  grouped_learner_batch's (each prompt once; [N, Tc] on the completion's own index) or
  learner_batch's joined rows. Through Transformer.token_logprobs, so the LM head runs in
  chunks above model.chunk_min_vocab."""
  if "pack_tokens" in batch:
    return packed_logprobs(nnx.merge(graphdef, params), batch, temperature, entropy=entropy)
  if "prompt" in batch:
    model = nnx.merge(graphdef, params)
    h = model.grouped_hidden(batch["prompt"], batch["prompt_len"][:, 0], batch["completion"])
    return model.token_logprobs(h, batch["completion"], temperature=temperature,
                                entropy=entropy)
  return apply_logprobs(graphdef, params, batch["inputs"], batch["targets"], batch["positions"],
                        temperature=temperature, entropy=entropy)


def packed_logprobs(model, batch, temperature: float, *, entropy: bool = True):
  """batch_logprobs of a packed batch (packing.pack_completions): the forward over the
  packed rows (Transformer.packed_hidden), its log-probs (and entropy) gathered back to the
  [N, Tc] layout by pack_index. Token 0's come from its prompt's last position."""
  completion, index = batch["completion"], batch["pack_index"]
  (N, Tc), P = completion.shape, batch["prompt"].shape[0]
  G = N // P
  h_last, h = model.packed_hidden(batch["prompt"], batch["prompt_len"][:, 0],
                                  batch["pack_tokens"], batch["pack_offsets"],
                                  batch["pack_segments"], batch["pack_prompt"][:, 0])
  first = model.token_logprobs(jnp.repeat(h_last, G, axis=0)[:, None], completion[:, :1],
                               temperature=temperature, entropy=entropy)
  packed = model.token_logprobs(h, batch["pack_targets"], temperature=temperature,
                                entropy=entropy)

  def unpack(first_n1, packed_rw):
    if first_n1 is None:
      return None
    out = jnp.take(packed_rw.reshape(-1), index)
    return jnp.where(jnp.arange(Tc)[None, :] == 0, first_n1, out)
  return unpack(first[0], packed[0]), unpack(first[1], packed[1])


def logprob_micro_batches(config) -> int:
  """Micro-batches of the reference / old-policy log-prob forward over a step's batch: the
  update's own, algo.minibatches x optim.accum_steps, so each holds the rows of one of the
  update's micro-batches (grouped_forward checks that they divide the batch). The forward has
  no backward, so what fits the update fits it; one call over the whole step (the old way)
  held minibatches x accum_steps times the update's activations (Qwen3-4B GRPO on a v5e-8:
  19.5 GiB by the plan, over the chip's 16)."""
  return int(config.algo.minibatches) * int(config.optim.accum_steps)


def split_micro(batch, parts: int):
  """A batch -> `parts` micro-batches stacked on a new leading axis, as make_train_step splits
  its accum_steps: the shortest leading dimension counts the units (a row, or in the grouped
  form one prompt row with its G completion rows) and unit b * parts + i goes to micro-batch i,
  so every device keeps its own rows (no data moves) and a group is never split."""
  units = min(x.shape[0] for x in jax.tree.leaves(batch))

  def split(x):  # [B, ...] -> [parts, B / parts, ...]
    u = x.shape[0] // units
    x = x.reshape(units // parts, parts, u, *x.shape[1:])
    return jnp.moveaxis(x, 1, 0).reshape(parts, x.shape[0] * u, *x.shape[3:])
  return jax.tree.map(split, batch), units


def join_micro(stacked, units: int):
  """split_micro's inverse for per-row outputs [parts, B / parts, ...] -> [B, ...]."""
  def join(x):
    parts = x.shape[0]
    u = x.shape[1] * parts // units  # output rows per unit (the grouped form: G)
    x = x.reshape(parts, units // parts, u, *x.shape[2:])
    return jnp.moveaxis(x, 0, 1).reshape(units * u, *x.shape[3:])
  return jax.tree.map(join, stacked)


def make_batch_logprobs_fn(graphdef, temperature: float, *, mesh: Mesh | None = None,
                           entropy: bool = True, micro_batches: int = 1):
  """Jitted (params, learner batch of either form) -> (log-probs, entropy), compiled with the
  learner's CPU dot kernels for `mesh`'s devices (jaxrl.backends.compiler_options). entropy=False
  returns (log-probs, None) and skips the entropy's pass over the vocabulary (the reference
  forward's case: nothing reads the reference's entropy).

  micro_batches > 1 runs the forward in a lax.scan over that many micro-batches of the batch's
  rows (split_micro: whole groups, each device its own rows), so the program holds one
  micro-batch's activations at a time, as the update does (the trainer passes the update's
  minibatches x optim.accum_steps). Each row's log-probs depend on that row alone, so the
  values are the unsplit ones (tests/test_grpo_micro.py)."""
  def forward(params, batch):
    return batch_logprobs(graphdef, params, batch, temperature, entropy=entropy)

  def logprobs(params, batch):
    if micro_batches == 1:
      return forward(params, batch)
    micro, units = split_micro(batch, micro_batches)
    _, out = jax.lax.scan(lambda carry, mb: (carry, forward(params, mb)), None, micro)
    return join_micro(out, units)

  if mesh is None:
    return jax.jit(logprobs, compiler_options=compiler_options(jax.devices()))
  return jax.jit(shard_activations(logprobs, mesh),
                 compiler_options=compiler_options(mesh.devices.flat))


def make_logprobs_fn(graphdef, temperature: float):
  """Jitted (params, inputs, targets, positions) -> (log-probs, entropy) of the targets."""
  fn = make_batch_logprobs_fn(graphdef, temperature)
  return lambda params, inputs, targets, positions: fn(
      params, {"inputs": inputs, "targets": targets, "positions": positions})


def grpo_loss(graphdef, a, *, temperature: float, norm_len: int):
  """loss_fn for the shared train step: (sum, (weight, metric sums)) of the per-token loss
  pg + beta * KL - entropy_coef * entropy, aggregated by `a.aggregation`. Metrics (KL,
  entropy, clip fractions) are aggregated the same way as the loss.

  The truncated-IS weights come from the old and the sampler's log-probs
  (batch["sampler_logp"]). Without batch["old_logp"] (old_logp_from_update), the old log-probs
  are this forward's own under stop_gradient, and the metrics carry their old_policy_sums."""
  def loss_fn(params, batch, key):
    del key
    logp, entropy = batch_logprobs(graphdef, params, batch, temperature)
    mask = batch["mask"]
    own_old = "old_logp" not in batch
    old_logp = jax.lax.stop_gradient(logp) if own_old else batch["old_logp"]
    log_ratio = sampler_log_ratio(old_logp=old_logp, sampler_logp=batch["sampler_logp"],
                                  mask=mask)
    tis = (jnp.minimum(jnp.exp(log_ratio), a.tis_cap) if a.tis_cap > 0
           else jnp.ones_like(log_ratio))
    extra = old_policy_sums(log_ratio=log_ratio, entropy=jax.lax.stop_gradient(entropy),
                            mask=mask) if own_old else {}
    pg, low, high = losses.clipped_pg_loss(
        logp=logp, old_logp=old_logp, adv=batch["adv"], mask=mask,
        eps_low=a.eps_low, eps_high=a.eps_high,
        dual_clip_c=a.dual_clip_c if a.dual_clip_c > 1 else None, ratio_level=a.ratio_level)
    per_token = pg * tis
    kl = losses.kl_penalty(logp=logp, ref_logp=batch["ref_logp"], estimator=a.kl_estimator,
                           clamp=a.kl_clamp or None)
    if a.kl_in == "loss":
      per_token = per_token + batch["beta"] * kl
    per_token = per_token - a.entropy_coef * entropy

    def agg(x):
      return losses.aggregate_sums(x, mask, mode=a.aggregation, norm_len=norm_len)

    loss_sum, weight = agg(per_token)
    sums = {"kl": agg(kl)[0], "entropy": agg(entropy)[0],
            "clipfrac/low": agg(low.astype(jnp.float32))[0],
            "clipfrac/high": agg(high.astype(jnp.float32))[0], **extra}
    return loss_sum, (weight, sums)
  return loss_fn

