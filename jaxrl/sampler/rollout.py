"""The rollout driver: n samples for each prompt, continuously batched over decode slots.

    out = generate(engine, params, prompts, n=G, seed=step_seed, slots=64)

Sample i * n + g is prompt i's g-th sample. The driver keeps a queue of samples. Whenever slots
are free it prefills the prompts they need (several per call, bucketed by length) and inserts
each prompt's prefix into as many free slots as it has samples waiting, so a group of G shares
one prefill. Then it runs `steps_per_call` decode steps in one jitted scan, reads the tokens and
done flags back in one transfer, and frees finished slots for the next round. One long sample
never holds up the batch, and the host syncs once per `steps_per_call` tokens, not per token.
Before each insert and each scan it widens the KV cache's window just enough for the longest
live sequence (Engine.grow, in half-octave steps: see `window_bucket`), so that early decode
steps do not read cache positions no slot has reached.

With `continuous=False` the driver batches statically instead: it refills only when every slot
is free (the baseline the benchmark compares against). With `share_prefix=False` each sample
prefills its own copy of the prompt (the baseline for group insert). Both settings return the
same samples as the defaults, because a token's key depends only on (seed, sample, token).

The slots, admission (dense and paged caches, preemption) and token records are
jaxrl.sampler.scheduler's; `generate` and `generate_stream` are its two sources.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any, Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrl.errors import ConfigError
from jaxrl.sampler.engine import Engine, bucket
from jaxrl.sampler.scheduler import Options, Scheduler, Unit


@dataclasses.dataclass
class Rollout:
  """Padded rollout arrays, N = prompts x n rows (prompt-major), plus the driver's stats.

  prompt_ids [N, Lp] and completion_ids [N, Lc] are right-padded with pad_id; completion_mask
  [N, Lc] is 1 on generated tokens (the stop token included); logprobs [N, Lc] are the
  sampler's log pi(token) under temperature before truncation (0 on padding). A multi-turn
  rollout (jaxrl.envs.rollout) holds the whole conversation after the prompt in completion_ids
  and `lengths`; its completion_mask is 1 on the model's tokens only, 0 on template and tool
  tokens (whose logprobs are 0), and the learner trains on the mask. finish_reasons
  is "stop" (eos or a stop id) or "length" (max_new_tokens or the cache's end).
  """

  prompt_ids: np.ndarray
  prompt_lengths: np.ndarray
  completion_ids: np.ndarray
  completion_mask: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finish_reasons: list[str]
  prompt_index: np.ndarray
  stats: dict
  # [N, Lc] the policy version that sampled each token (-1 on padding), when generate() was
  # given `weights` (partial rollouts: the weights may change between decode calls).
  versions: np.ndarray | None = None


def generate(engine: Engine, params, prompts, *, n: int = 1, seed: int = 0,
             max_prompt_len: int | None = None, progress: bool = False,
             weights: Callable[[], tuple[int, Any]] | None = None,
             options: Options | None = None, **settings) -> Rollout:
  """Generates n samples per prompt (lists of token ids) with `engine`'s sampling settings,
  batched by `options` (jaxrl.sampler.scheduler.Options; keyword `settings` replace its
  fields: slots=, steps_per_call=, kv_cache=, ...). weights: called before every prefill and
  decode call, returns (version, params) to use from there on instead of `params` (partial
  rollouts); Rollout.versions then says which version sampled each token."""
  opts = dataclasses.replace(options or Options(), **settings)
  prompts = [list(map(int, p)) for p in prompts]
  if n < 1:
    raise ConfigError(f"n={n} is not valid: ask for at least 1 sample per prompt.")
  for i, p in enumerate(prompts):
    if not p:
      raise ConfigError(f"prompt {i} is empty: every prompt needs at least one token (e.g. bos).")
  t_start = time.perf_counter()
  key = jax.random.key(seed)
  sched = Scheduler(engine, opts, n=n, key=key,
                    max_prompt_len=bucket(max_prompt_len or max(map(len, prompts), default=1)))
  unit = Unit(None, prompts, key, n)
  queue = deque(sched.open(unit))
  bar = tqdm(total=len(queue), desc="sampling", unit="sample", disable=not progress,
             leave=False)
  while queue or sched.busy():
    left = unit.left
    sched.admit(queue, params, weights)
    if sched.busy():  # (every inserted sample may have finished on its first token)
      sched.preempt(queue)
      sched.decode(params, weights)
    bar.update(left - unit.left)
  bar.close()
  rollout = _assemble(prompts, n, unit.toks, unit.lps, engine.sampling, opts.pad_id,
                      sched.stats(), time.perf_counter() - t_start)
  return with_versions(rollout, unit.vers) if weights is not None else rollout


def with_versions(rollout: Rollout, vers: list[list[int]]) -> Rollout:
  """The rollout with each completion token's policy version (-1 past its end)."""
  versions = np.full(rollout.completion_ids.shape, -1, np.int32)
  for s, v in enumerate(vers):
    versions[s, :len(v)] = v
  return dataclasses.replace(rollout, versions=versions)


def _assemble(prompts, n, toks, lps, sp, pad_id, stats, wall) -> Rollout:
  num = len(toks)
  lp_max = max(map(len, prompts), default=1)
  lc_max = max(map(len, toks), default=1)
  prompt_ids = np.full((num, lp_max), pad_id, np.int32)
  completion_ids = np.full((num, lc_max), pad_id, np.int32)
  mask = np.zeros((num, lc_max), np.int32)
  logprobs = np.zeros((num, lc_max), np.float32)
  stops = set(sp.stop_tokens)
  reasons = []
  for s in range(num):
    p, c = prompts[s // n], toks[s]
    prompt_ids[s, :len(p)] = p
    completion_ids[s, :len(c)] = c
    mask[s, :len(c)] = 1
    logprobs[s, :len(c)] = lps[s]
    reasons.append("stop" if c and c[-1] in stops else "length")
  lengths = mask.sum(1).astype(np.int32)
  generated = int(lengths.sum())
  stats = dict(stats, tokens_generated=generated, wall_s=wall,
               tokens_per_s=generated / max(wall, 1e-9),
               decode_tokens_per_s=int(stats["live_slot_steps"]) / max(stats["decode_s"], 1e-9),
               slot_utilisation=stats["live_slot_steps"] / max(stats["slot_steps"], 1))
  return Rollout(prompt_ids=prompt_ids,
                 prompt_lengths=np.array([len(prompts[s // n]) for s in range(num)], np.int32),
                 completion_ids=completion_ids, completion_mask=mask, logprobs=logprobs,
                 lengths=lengths, finish_reasons=reasons,
                 prompt_index=np.arange(num, dtype=np.int32) // n, stats=stats)


def metrics(rollout: Rollout) -> dict:
  """The rollout's stats under docs/design.md's metric names, for trainers to log."""
  st = rollout.stats
  # Over the model's own tokens: a multi-turn rollout's completion also holds template and
  # tool tokens (completion_mask 0; single-turn, the mask covers `lengths` exactly).
  model_tokens = rollout.completion_mask.sum(1)
  return {"timing_s/gen": st["wall_s"], "perf/gen_tokens_per_s": st["tokens_per_s"],
          "response_length/mean": float(model_tokens.mean()) if len(model_tokens) else 0.0,
          "sampler/prefill_s": st["prefill_s"], "sampler/decode_s": st["decode_s"],
          "sampler/slot_utilisation": st["slot_utilisation"],
          "response_length/clip_ratio": float(np.mean(
              [r == "length" for r in rollout.finish_reasons])) if rollout.finish_reasons else 0.0,
          "sampler/tokens_generated": st["tokens_generated"],
          "sampler/live_peak": st.get("live_peak", 0),
          **({"sampler/kv_pages": st["kv_pages"], "sampler/kv_pages_peak": st["kv_pages_peak"],
              "sampler/kv_preemptions": st["kv_preemptions"]} if "kv_pages" in st else {}),
          # Multi-turn rollouts (jaxrl.envs.rollout): the environments' counts and seconds.
          **({"env/turns/mean": st["env_turns"], "env/tool_calls/mean": st["env_tool_calls"],
              "env/bad_tool_calls": st["env_bad_tool_calls"], "timing_s/env": st["env_s"]}
             if "env_turns" in st else {})}


def generate_stream(engine: Engine, next_unit: Callable, *, weights: Callable[[], tuple[int, Any]],
                    n: int, max_prompt_len: int, options: Options | None = None, **settings):
  """Streaming continuous batching over a sequence of units (the async producer's partial
  rollouts): yields (tag, Rollout) per unit, in the order the units were opened.

  next_unit(wait) -> (tag, prompts, seed) | None opens the next unit: its prompts' n samples
  each, keyed by its own seed (so sample i * n + g of a unit is token for token what
  generate(..., seed=seed) samples for it with the same weights). It is asked whenever n
  slots are free and no opened unit has a sample waiting; wait=False while other slots are
  live or were just filled (None: not now, go on decoding), wait=True when none is (None:
  there is no next unit, the stream ends). A unit's samples join the scheduler's queue, so a
  unit's short completions free slots for the next unit's samples instead of idling beside
  its long ones; each slot draws with its unit's key (Engine.generate_steps with key=None).
  weights() is called before every prefill and decode call, as generate()'s `weights` (every
  token's version is in Rollout.versions). One state serves every unit: the dense cache's
  window follows the longest live sequence, grown before a call that needs more and narrowed
  (Engine.narrow) when that sequence has left. `options` and `settings` as generate()'s.

  A unit's Rollout.stats count the scheduler's work from its opening to its emission (decode
  calls are shared by the units in flight, so two units' counts overlap), except gen_s: the
  prefill and decode seconds since the previous unit's emission, which the producer sums as
  busy time (each second counted once)."""
  opts = dataclasses.replace(options or Options(), **settings)
  if opts.slots < n:
    raise ConfigError(f"slots={opts.slots} cannot hold a group of {n}: raise rollout.slots.")
  sched = Scheduler(engine, opts, n=n, max_prompt_len=bucket(max_prompt_len), narrow=True)
  units: deque = deque()  # opened units, not yet emitted, in order
  queue: deque = deque()  # their samples not yet admitted (preempted ones at the front)
  since = dict(sched.counters)  # the counters at the last emission
  while True:
    admitted = 0
    while True:  # open units and admit their samples while either makes progress
      opened = False
      if not queue and len(sched.free()) >= n and not sched.stalled:
        got = next_unit(not sched.busy() and not admitted)
        if got is not None:
          tag, prompts, seed = got
          units.append(Unit(tag, prompts, jax.random.key(seed), n))
          queue.extend(sched.open(units[-1]))
          opened = True
      now = sched.admit(queue, None, weights) if queue else 0
      admitted += now
      if not (opened or now):
        break
    if not admitted and not sched.busy():
      break  # nothing in flight and no next unit: the stream has ended
    sched.preempt(queue)
    sched.decode(None, weights)
    while units and not units[0].left:  # emit the finished units at the front, in order
      u = units.popleft()
      sched.close(u)
      c = sched.counters
      stats = dict(sched.stats(u.at_open), gen_s=c["prefill_s"] + c["decode_s"]
                   - since["prefill_s"] - since["decode_s"])
      since = dict(c)
      rollout = _assemble(u.prompts, n, u.toks, u.lps, engine.sampling, opts.pad_id, stats,
                          time.perf_counter() - u.t0)
      yield u.tag, with_versions(rollout, u.vers)
