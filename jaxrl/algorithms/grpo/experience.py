"""GRPO's experience (steps 1-5 of a step), one function per role: the rollouts and their
scores (scored_rollouts: sync the policy's weights into the sampler, generate, score), the
learner's log-probs of the sampled tokens (learner_forwards: reference and old) and the
advantages (group_advantages). What they make, Experience and its batch layouts, is in batch.py."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxrl.backends import on_cpu
from jaxrl.models.flops import rollout_flops
from jaxrl.parallel.distributed import to_host
from jaxrl.objectives import advantages as adv_lib
from jaxrl.objectives import losses
from jaxrl.algorithms.grpo.rewards import score_rollout
from jaxrl.algorithms.grpo.batch import (INPUTS, ROLLOUT, Experience, completion_width,
                                         device_batch, grouped_learner_batch, learner_batch)
from jaxrl.algorithms.grpo.update import logprob_micro_batches, old_policy_sums, sampler_log_ratio
from jaxrl.sampler import Rollout, generate
from jaxrl.sampler import metrics as rollout_metrics
from jaxrl.sampler.rollout import generate_stream
from jaxrl.sampler.scheduler import Options

if TYPE_CHECKING:
  from jaxrl.algorithms.grpo.parts import Parts


def group_advantages(p: Parts, f: Forwards) -> dict[str, np.ndarray]:
  """Step 5: the advantages of the named estimator over each group of G (KL in the reward
  shapes the rewards first when kl_in="reward"), one per completion, broadcast over its tokens:
  {"adv": [N, T]}."""
  a, r = p.config.algo, p.config.rollout
  mask = f.batch["mask"]
  seq_rewards = f.scored.rewards_bg.reshape(-1)
  if a.kl_in == "reward":
    kl_tok = np.asarray(losses.kl_penalty(logp=f.old_np, ref_logp=f.ref_np,
                                          estimator=a.kl_estimator,
                                          clamp=a.kl_clamp or None))
    seq_rewards = np.asarray(losses.kl_in_reward(rewards_b=seq_rewards, kl_bt=kl_tok,
                                                 mask_bt=mask, beta=p.learner.beta.value))
  adv = np.asarray(adv_lib.compute(a.advantage, rewards_bg=seq_rewards.reshape(
      -1, r.group_size), clip=a.adv_clip or None)).reshape(-1)
  return {"adv": np.broadcast_to(adv[:, None], mask.shape).astype(np.float32)}


@dataclasses.dataclass
class Forwards:
  """Steps 1-4's output, before any advantage: the scored rollout, its learner batch (host
  arrays: the model inputs, mask, sampler_logp, old_logp when a separate forward gave them,
  ref_logp), the inputs on the devices (`dev`) and the old policy's and reference's log-probs.
  GRPO's step 5 adds group-relative advantages; PPO's, a critic's values and GAE."""
  scored: "Scored"
  inputs: tuple[str, ...]   # the model inputs' keys of `batch` (either layout)
  batch: dict[str, np.ndarray]
  dev: dict                 # batch's inputs as global arrays
  old_np: np.ndarray | None  # the old policy's log-probs, when a separate forward ran
  ref_np: np.ndarray
  old_sums: dict | None
  times: dict

  def experience(self, p: Parts, extra: dict[str, np.ndarray]) -> Experience:
    """The Experience of this rollout with `extra` (the advantages, and whatever else the
    update reads) added to the learner batch, and beta."""
    mask = self.batch["mask"]
    batch = {**self.batch, **extra, "beta": np.full(mask.shape, p.learner.beta.value, np.float32)}
    s = self.scored
    return Experience(
        step=s.step, version=s.version, rollout=s.rollout, rewards_bg=s.rewards_bg,
        batch=batch, old_sums=self.old_sums, reward_stats=s.reward_stats,
        gen_stats=s.gen_stats, frac_zero=s.frac_zero, times=self.times)


def learner_forwards(p: Parts, state, scored: Scored) -> Forwards:
  """Step 4: the scored rollout's learner batch, and the learner's log-probs of its sampled
  tokens (the old policy's unless the update's own forward gives them, and the frozen
  reference's)."""
  a, r = p.config.algo, p.config.rollout
  rollout = scored.rollout
  if p.learner.grouped:  # each group's prompt once, its G completions after it
    # Packed, the forward's positions do not grow with the width (the rows are what runs), so
    # it is the longest a completion can be: one shape fewer to compile per row count.
    longest = p.rollouts.length - p.rollouts.prompt_len
    width = (longest if a.pack_completions else
             completion_width(rollout.completion_ids.shape[1], longest))
    batch = grouped_learner_batch(
        rollout, prompt_len=p.rollouts.prompt_len, group=r.group_size, pad_id=p.tokenizer.pad_id,
        width=width)
    inputs = INPUTS[True]
    if a.pack_completions:  # the programs' batches are packed (packing.device_batch)
      batch["completion_len"] = rollout.lengths.astype(np.int32)
      inputs += ("completion_len",)
  else:
    batch = learner_batch(rollout, length=p.rollouts.length, pad_id=p.tokenizer.pad_id)
    inputs = INPUTS[False]
  mask = batch["mask"]
  if a.mask_truncated:
    truncated = np.array([x == "length" for x in rollout.finish_reasons])
    mask[truncated] = 0.0
  dev = p.put(device_batch(p, {k: batch[k] for k in inputs}, logprob_micro_batches(p.config)))
  # 4. The learner's log-probs of the sampled tokens: the old policy's, unless the update's
  # own forward gives them (update.old_logp_from_update), and the frozen reference's.
  old, old_np, old_sums, t_old = {}, None, None, 0.0
  if not p.learner.old_from_update:
    t0 = time.perf_counter()
    old_logp, entropy = jax.block_until_ready(p.learner.logprobs_fn(state.params, dev))
    t_old = time.perf_counter() - t0
    old_np, entropy = to_host((old_logp, entropy))
    old = {"old_logp": old_np.astype(np.float32)}
    log_ratio = sampler_log_ratio(old_logp=old_np, sampler_logp=batch["sampler_logp"],
                                  mask=mask)
    old_sums = old_policy_sums(log_ratio=log_ratio, entropy=entropy, mask=mask)
  t0 = time.perf_counter()
  ref_logp, _ = jax.block_until_ready(p.learner.logprobs_fn(p.learner.reference, dev))
  t_ref = time.perf_counter() - t0
  ref_np = to_host(ref_logp)
  batch = {**{k: batch[k] for k in inputs + ROLLOUT}, **old,
           "ref_logp": ref_np.astype(np.float32)}
  return Forwards(scored=scored, inputs=inputs, batch=batch, dev=dev, old_np=old_np,
                  ref_np=ref_np, old_sums=old_sums,
                  times={"gen": scored.t_gen, "gen_wait": scored.waited, "old": t_old,
                         "ref": t_ref})


# ----------------------------------------------------------------------------- rollouts


@dataclasses.dataclass
class Scored:
  """Steps 1-3's output: a rollout of B prompts x G, its rewards and stats, the GRPO step it is
  for and the oldest weight version that sampled it (older than the step when async)."""
  step: int
  version: int
  rollout: Rollout
  rewards_bg: np.ndarray  # [B, G]
  reward_stats: dict
  gen_stats: dict
  frac_zero: float
  t_gen: float            # the rollout's own wall time, scoring excluded
  waited: float           # what the learner waited for it (less than t_gen when async)


def scored_rollouts(p: Parts, state, prompts: list[dict], step: int) -> Scored:
  """Steps 1-3 (the rollouts and the scorer). Synchronous: sync the weights, then
  generate and score. With rollout.async_generation, the rollout producer (producer.py) has
  been generating into its queue on the sampler's own devices, up to rollout.max_staleness
  versions behind: this step publishes its weights to it and takes B groups."""
  if p.config.rollout.async_generation:
    return queued_rollouts(p, state, step)
  params_s = p.rollouts.sampler_copy.refresh(state.params)  # 1
  scored = sample_and_score(p, params_s, prompts, step)  # 2-3
  p.rollouts.stream.mark()
  p.rollouts.sampler_copy.before_update()  # colocated: its memory goes to the update
  return scored


def queued_rollouts(p: Parts, state, step: int):
  """Async steps 1-3: take B groups from the queue and publish this step's weights (a fresh
  sampler copy of version `step`, which the producer frees once no unit needs it); the prompt
  stream then checkpoints the queue's resume point (producer.py's resume rule)."""
  from jaxrl.parallel.distributed import process_zero_value
  from jaxrl.algorithms.grpo.producer import RolloutQueue
  r, a = p.config.rollout, p.config.algo
  if p.rollouts.queue is None:  # the first step of this run, fresh or resumed
    stream = p.rollouts.stream
    p.rollouts.queue = RolloutQueue(
        sample=lambda params, prompts, unit, **kw: sample(p, params, prompts, unit, 0, **kw),
        stream=stream.clone(), batch=r.prompts_per_step, group=r.group_size,
        max_staleness=r.get("max_staleness", 1), filter_zero_std=a.filter_zero_std,
        max_refill_rounds=a.max_refill_rounds, start_step=step,
        partial=bool(r.get("partial_rollouts", False)),
        end_step=p.config.train.steps, resume=stream.resume_queue,
        snapshot=stream.snapshot, release=p.rollouts.weight_sync.release,
        # Partial rollouts across processes: every process switches at process 0's choice.
        agree=(process_zero_value("rollout_version")
               if r.get("partial_rollouts") and jax.process_count() > 1 else None),
        streamer=(functools.partial(stream_units, p) if r.get("streaming") else None),
        # Several CPU processes: the producer and the learner take turns (producer.py).
        serial=jax.process_count() > 1 and on_cpu(p.run.placement.sampler.mesh.devices.flat),
        score=lambda rollout, prompts: score_rollout(p, rollout, prompts))
  # 1. This step's weights. With max_staleness=1, published after its groups are taken (they
  # need version step - 1), so that the sync never runs beside a rollout, as before the queue;
  # only the queue's first step needs its own version first. With k >= 2 the producer is
  # decoding beside the sync either way, and version `step` gates the unit for step + k (and,
  # with partial rollouts, is the newest a decode call can switch to): published before the
  # learner waits for its groups, it is there while the learner waits, not after.
  early = step == p.rollouts.queue.floor or p.rollouts.queue.k > 1
  if early:
    p.rollouts.queue.publish(step, p.rollouts.weight_sync(state.params))
  taken = p.rollouts.queue.take(step)  # 2-3, done in the background
  if not early:
    p.rollouts.queue.publish(step, p.rollouts.weight_sync(state.params))
  p.rollouts.stream.queue_state = p.rollouts.queue.checkpoint_state()
  groups, G = taken.groups, r.group_size
  first = taken.units[groups[0].unit]
  if all(g.unit == first.index for g in groups) and [g.index for g in groups] == list(
      range(len(groups))):  # one unit whole, as without dynamic sampling: its own arrays
    rollout, rewards_bg = first.rollout, first.rewards_bg
  else:
    parts = [(taken.units[g.unit].rollout, taken.units[g.unit].rewards_bg, g.index)
             for g in groups]
    rollout, rewards_bg = _concat_groups(parts, G), np.stack([rw[i] for _, rw, i in parts])
  t_gen = sum(u.t_gen for u in taken.new)
  zero = np.asarray(adv_lib.zero_std_groups(rewards_bg=first.rewards_bg))
  # Train-side stats (accuracy, response lengths) of the first unit the step takes from, as
  # the synchronous refill reports its first round's: before filtering.
  gen_stats = {**rollout_metrics(first.rollout), **taken.metrics,
               "perf/tflops/gen": sum(rollout_flops(p.cfg, u.rollout) for u in taken.new)
               / max(t_gen, 1e-9) / 1e12}
  return Scored(step, min(g.version for g in groups), rollout, rewards_bg, first.reward_stats,
                gen_stats, float(zero.mean()), t_gen, taken.metrics["timing_s/gen_wait"])


def sample_and_score(p: Parts, params_s, prompts: list[dict], step: int) -> Scored:
  """Steps 2-3: sample B prompts x G completions with the engine (continuous batching, one
  prefill per group) and score them; with dynamic sampling (algo.filter_zero_std), groups whose
  G rewards are all equal are replaced by groups sampled for fresh prompts."""
  a, G = p.config.algo, p.config.rollout.group_size
  t0 = time.perf_counter()
  flops = []  # the model FLOPs of every rollout sampled, refills included

  def sample_counted(batch_prompts, round_):
    ro, rw, st = sample(p, params_s, batch_prompts, step, round_)
    flops.append(rollout_flops(p.cfg, ro))
    return ro, rw, st

  rollout, rewards, reward_stats = sample_counted(prompts, 0)
  rewards_bg = rewards.reshape(-1, G)
  zero = np.asarray(adv_lib.zero_std_groups(rewards_bg=rewards_bg))
  frac_zero = float(zero.mean())
  gen_stats = rollout_metrics(rollout)
  if a.filter_zero_std and zero.any():
    rollout, rewards_bg = _refill(rollout, rewards_bg, zero, sample_counted, p.rollouts.stream,
                                  a.max_refill_rounds, G)
  t_gen = time.perf_counter() - t0 - reward_stats["timing_s/reward"]
  gen_stats["perf/tflops/gen"] = sum(flops) / max(t_gen, 1e-9) / 1e12
  return Scored(step, step, rollout, rewards_bg, reward_stats, gen_stats, frac_zero, t_gen,
                t_gen)


def _seed(p: Parts, step: int, round_: int) -> int:
  """The sampling seed of (run seed, step, round)."""
  return int(jax.random.randint(jax.random.fold_in(jax.random.key(p.config.seed),
                                                   step * 16 + round_), (), 0, 2**31 - 1))


def _options(p: Parts) -> Options:
  """The scheduler's options, from config.rollout."""
  return Options.from_config(p.config.rollout, p.tokenizer.pad_id)


def stream_units(p: Parts, next_unit, weights):
  """The async producer's streaming rollouts (rollout.streaming): yields (tag, rollout) per
  unit as generate_stream finishes them, each unit sampled with its step seed (round 0), as
  `sample` samples it."""
  r = p.config.rollout

  def opened(wait):
    got = next_unit(wait)
    if got is None:
      return None
    tag, records = got  # tag: (unit index, its prompt records)
    return tag, [p.run.prompts.ids(x) for x in records], _seed(p, tag[0], 0)

  yield from generate_stream(p.rollouts.engine, opened, weights=weights, n=r.group_size,
                             max_prompt_len=p.rollouts.prompt_len, options=_options(p))


def sample(p: Parts, params_s, prompts: list[dict], step: int, round_: int, weights=None):
  """(rollout, [N] rewards, reward stats) of `prompts` x G, with a seed drawn from (seed, step,
  round). `weights` (partial rollouts): newer (version, params) between decode calls."""
  r = p.config.rollout
  seed = _seed(p, step, round_)

  if p.rollouts.env is not None:  # multi-turn: the environment's rewards (jaxrl.envs.rollout)
    return env_rollout(p, params_s, prompts, seed, weights)
  ids = [p.run.prompts.ids(x) for x in prompts]  # chat-templated for instruct checkpoints
  rollout = generate(p.rollouts.engine, params_s, ids, n=r.group_size, seed=seed,
                     max_prompt_len=p.rollouts.prompt_len, weights=weights, options=_options(p))
  rewards, reward_stats = score_rollout(p, rollout, prompts)
  return rollout, rewards, reward_stats


def env_rollout(p: Parts, params_s, prompts: list[dict], seed: int, weights=None):
  """(rollout, [N] rewards, reward stats) of G conversations per prompt with the configured
  environment, each continuing its own KV cache between turns (jaxrl.envs.rollout.continued):
  rewards are its summed step rewards (reward/env), accuracy the share of conversations it
  marked correct, and its seconds are the rollout's (timing_s/env)."""
  from jaxrl.envs.rollout import continued
  r, ro = p.config.rollout, p.rollouts
  rollout, rewards, extra = continued(
      ro.engine, params_s, prompts, env=ro.env, renderer=ro.renderer, n=r.group_size, seed=seed,
      max_turns=r.max_turns, budget=ro.length - ro.prompt_len, max_prompt_len=ro.prompt_len,
      decode=p.tokenizer.decode, env_workers=r.get("env_workers", 8), options=_options(p),
      weights=weights)
  stats = {"reward/env": float(rewards.mean()), "accuracy": extra["accuracy"],
           "reward/errors": 0.0, "timing_s/reward": 0.0}
  return rollout, rewards, stats


def _refill(rollout, rewards_bg, zero, sample, stream, rounds: int, G: int):
  """Dynamic sampling (DAPO): replaces all-equal groups with groups sampled for fresh prompts,
  up to `rounds` extra rounds. The group count stays fixed (a group that cannot be replaced
  stays, with zero advantage), so the learner's jits never recompile."""
  B = len(zero)
  parts = [(rollout, rewards_bg, g) for g in np.flatnonzero(~zero)]
  for i in range(1, rounds + 1):
    if len(parts) >= B:
      break
    ro, rw, _ = sample(next(stream), i)
    rw_bg = rw.reshape(-1, G)
    z = np.asarray(adv_lib.zero_std_groups(rewards_bg=rw_bg))
    parts += [(ro, rw_bg, g) for g in np.flatnonzero(~z)]
  parts += [(rollout, rewards_bg, g) for g in np.flatnonzero(zero)]  # fill up, zero advantage
  parts = parts[:B]
  return _concat_groups(parts, G), np.stack([rw[g] for _, rw, g in parts])


def _concat_groups(parts, G: int):
  """A Rollout made of the given (rollout, rewards, group) groups, padded to common widths."""
  rows = [(ro, g * G + j) for ro, _, g in parts for j in range(G)]
  lp = max(ro.prompt_ids.shape[1] for ro, _ in rows)
  lc = max(ro.completion_ids.shape[1] for ro, _ in rows)

  def stack(name, width, fill=0):
    arrs = [getattr(ro, name)[s] for ro, s in rows]
    out = np.full((len(rows), width), fill, arrs[0].dtype)
    for i, a in enumerate(arrs):
      out[i, :len(a)] = a
    return out

  first = rows[0][0]
  return dataclasses.replace(
      first, prompt_ids=stack("prompt_ids", lp), completion_ids=stack("completion_ids", lc),
      completion_mask=stack("completion_mask", lc), logprobs=stack("logprobs", lc),
      prompt_lengths=np.array([ro.prompt_lengths[s] for ro, s in rows]),
      lengths=np.array([ro.lengths[s] for ro, s in rows]),
      finish_reasons=[ro.finish_reasons[s] for ro, s in rows],
      prompt_index=np.arange(len(rows)) // G,
      versions=stack("versions", lc, fill=-1) if first.versions is not None else None)
