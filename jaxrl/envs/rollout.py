"""The multi-turn rollout driver: G conversations per prompt, turns interleaving generation
with environment steps, up to rollout.max_turns.

    ro, rewards_n, stats = continued(engine, params, records, env=(name, make_env),
                                     renderer=ChatRenderer(tok, data_cfg), n=G, seed=s,
                                     max_turns=4, budget=256, max_prompt_len=P,
                                     decode=tok.decode, options=Options(slots=64))

`continued` is GRPO's driver. It batches continuously over decode slots: a record's G
conversations take G free slots from one prefill of its prompt, and when a slot's turn ends
its environment reads the model's turn (its tool calls parsed in the checkpoint's format) and
answers while the other slots keep decoding; the answer, rendered through the chat template
(jaxrl.data.chat), is appended to the slot's own KV cache (Engine.extend) and the slot decodes
its next turn from there, never re-prefilling the conversation. A conversation that is over
frees its slot for the next group. Environments step in a pool of rollout.env_workers
threads, so a slow one (a sandbox, a web call) holds up only its own conversation; each
conversation has its own environment instance, but instances may step concurrently.

`conversations` is the reference driver: each turn is one call of a single-turn generator
(jaxrl.sampler.generate, or a scripted one in tests) prompted with the whole conversation so
far, so it re-prefills every turn. Under greedy decoding both give the same conversations
(tests/test_agentic.py).

A conversation ends when its environment says done (or has no observation), after max_turns
model turns, or when it reaches its `budget` of tokens after the prompt (model and
observation tokens together, the learner batch's completion width; finish "length"). A turn
cut at rollout.max_new_tokens is still a turn: the environment reads it, and its
end-of-turn token is written after it as a template token (not trained).

The result is a Rollout whose completion is everything after the prompt: completion_mask is
1 on the model's own tokens (trained, in the KL) and 0 on template and tool tokens, logprobs
are the sampler's on model tokens and 0 elsewhere, and `lengths` spans the whole
conversation. Rewards are each conversation's summed step rewards. Stats: the sampler's
(prefill_tokens counts appended observation tokens too), env_s, env_turns, env_tool_calls
(means per conversation) and env_bad_tool_calls (the sum).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import jax
import numpy as np

from jaxrl.envs import Timed
from jaxrl.data.chat import ChatRenderer, assistant_turn
from jaxrl.errors import ConfigError
from jaxrl.sampler.engine import bucket
from jaxrl.sampler.rollout import Rollout, with_versions
from jaxrl.sampler.scheduler import Options, Scheduler, Unit

_STAT_SUMS = ("prefill_s", "decode_s", "prefill_calls", "prefill_prompts", "prefill_tokens",
              "decode_steps", "slot_steps", "live_slot_steps")


@dataclasses.dataclass
class Conversation:
  env: Timed
  messages: list[dict]
  tokens: list[int] = dataclasses.field(default_factory=list)   # after the prompt
  model: list[int] = dataclasses.field(default_factory=list)    # 1: a model token
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)  # per token; -1: not sampled
  reward: float = 0.0
  turns: int = 0
  tool_calls: int = 0
  bad_tool_calls: int = 0
  correct: bool = False
  finish: str = "stop"
  done: bool = False


def prompt_ids(renderer: ChatRenderer, env: Timed, record: dict) -> tuple[list[int], list]:
  """(the first turn's prompt ids, the reset messages) of a record under an environment."""
  messages = env.reset(record)
  return renderer.prompt_ids(messages, env.tools), messages


def _start(records, env, renderer, n):
  """(conversations, each record's prompt ids): G conversations per record, each with its own
  environment, reset."""
  name, factory = env
  convs, firsts = [], []
  for i, record in enumerate(records):
    group = []
    for _ in range(n):
      e = Timed(name, factory)
      ids, messages = prompt_ids(renderer, e, record)
      group.append((ids, messages, e))
    if any(ids != group[0][0] for ids, _, _ in group):
      raise ConfigError(f"environment {name!r}: reset() gave record {i}'s {n} conversations "
                        "different prompts; a GRPO group needs one prompt: make reset "
                        "depend on the record only.")
    firsts.append(group[0][0])
    convs += [Conversation(env=e, messages=m) for _, m, e in group]
  return convs, firsts


def _after_turn(c: Conversation, toks, lps, cut: bool, *, renderer, decode, max_turns: int,
                budget: int, vers=None) -> list[int] | None:
  """Takes a finished model turn (its tokens, log-probs, and whether max_new_tokens cut it;
  `vers`, each token's weight version) into the conversation and steps its environment: the
  observation's token ids to continue with, or None when the conversation is over."""
  room = budget - len(c.tokens)
  full = len(toks) >= room
  toks, lps = list(toks[:room]), list(lps[:room])
  c.tokens += toks
  c.model += [1] * len(toks)
  c.logprobs += lps
  c.versions += [-1] * len(toks) if vers is None else list(vers[:room])
  c.turns += 1
  said = assistant_turn(decode(toks), renderer.format)
  obs, reward, done, info = c.env.step(c.messages, said)
  c.reward += reward
  c.tool_calls += int(info.get("tool_calls", 0))
  c.bad_tool_calls += int(info.get("bad_tool_calls", 0))
  c.correct = c.correct or bool(info.get("correct", False))
  before, c.messages = c.messages, c.messages + [said]
  c.finish = "length" if cut or full else "stop"
  if full or done or not obs or c.turns == max_turns:
    c.done = True
    return None
  more = renderer.observation_ids(before, said, obs, c.env.tools, closed=not cut)
  if len(c.tokens) + len(more) >= budget:  # no room left for another model token
    c.finish, c.done = "length", True
    return None
  c.tokens += more
  c.model += [0] * len(more)
  c.logprobs += [0.0] * len(more)
  c.versions += [-1] * len(more)
  c.messages = c.messages + list(obs)
  c.finish = "stop"
  return more


def _result(convs, firsts, n, pad_id, stats, t0):
  rollout = _assemble(firsts, n, convs, pad_id, stats, time.perf_counter() - t0,
                      sum(c.env.seconds for c in convs))
  return rollout, np.array([c.reward for c in convs], np.float32), {
      "accuracy": float(np.mean([c.correct for c in convs]))}


def conversations(gen: Callable[..., Rollout], records: list[dict], *, env, renderer,
                  n: int, seed: int, max_turns: int, budget: int, pad_id: int,
                  decode: Callable[[list[int]], str]):
  """The re-prefill driver: (Rollout of len(records) x n conversations, [N] rewards, stats),
  each turn generated by `gen(prompts, n=, seed=)` prompted with the whole conversation so far
  (a single-turn generator: jaxrl.sampler.generate, or a scripted one in tests). `env` is
  (name, make_env); `decode` the tokenizer's decode of a turn's ids."""
  t0 = time.perf_counter()
  convs, firsts = _start(records, env, renderer, n)
  stats = {k: 0 for k in _STAT_SUMS}
  stats.update(live_peak=0, kv_positions_peak=0, turn_calls=0)
  for turn in range(max_turns):
    live = [i for i, c in enumerate(convs) if not c.done]
    if not live:
      break
    if turn == 0:  # one shared prefill per group
      ro = gen(firsts, n=n, seed=seed)
    else:
      ro = gen([firsts[i // n] + convs[i].tokens for i in live], n=1,
               seed=(seed + 7919 * turn) % 2**31)
    stats["turn_calls"] += 1
    for k in _STAT_SUMS:
      stats[k] += ro.stats.get(k, 0)
    for k in ("live_peak", "kv_positions_peak"):
      stats[k] = max(stats[k], ro.stats.get(k, 0))
    for row, i in enumerate(live):
      L = int(ro.lengths[row])
      _after_turn(convs[i], ro.completion_ids[row, :L].tolist(), ro.logprobs[row, :L].tolist(),
                  ro.finish_reasons[row] == "length", renderer=renderer, decode=decode,
                  max_turns=max_turns, budget=budget)
  return _result(convs, firsts, n, pad_id, stats, t0)


def continued(engine, params, records: list[dict], *, env, renderer, n: int, seed: int,
              max_turns: int, budget: int, max_prompt_len: int,
              decode: Callable[[list[int]], str], env_workers: int = 8,
              options: Options | None = None, weights=None, **settings):
  """The KV-continuing driver, a source of the rollout scheduler (jaxrl.sampler.scheduler):
  (Rollout, [N] rewards, stats) as `conversations` gives them. A record's G conversations
  take G free slots from one prefill of its prompt (whole groups); a slot whose turn ends is
  held while its environment steps in one of `env_workers` threads (0: in this loop) and the
  other slots keep decoding, and goes on from its own KV cache with the observation's tokens
  appended (Scheduler.extend) once its step is back, its next turn keyed as sample turn * N +
  conversation. A conversation that is over frees its slot for the next group. The threads'
  timing changes which slots are continued together, not the keys: a token's key is its
  sample's and its index's, whatever the batch. `weights` (partial rollouts, as generate's):
  newer (version, params) before each prefill, extend and decode call, each model token's
  version in Rollout.versions. `options` and `settings` (slots=,
  steps_per_call=, pad_id=, grow_cache=, kv_cache=...) as jaxrl.sampler.generate's; a paged
  cache admits by reserve, a held conversation keeping its pages."""
  opts = dataclasses.replace(options or Options(), **settings)
  t0 = time.perf_counter()
  convs, firsts = _start(records, env, renderer, n)
  N = len(convs)
  if opts.slots < n:
    raise ConfigError(f"rollout.slots={opts.slots} is fewer than rollout.group_size={n}: a "
                      "group's conversations share one prefill and need a slot each.")
  stops = set(engine.sampling.stop_tokens)
  max_prompt_len = bucket(max_prompt_len or max(map(len, firsts)))
  pool = ThreadPoolExecutor(env_workers) if env_workers > 0 else None
  pending: dict[int, Future] = {}  # slot -> its environment step: the observation ids or None
  turn_start = [0] * N  # where each conversation's current turn begins in its tokens

  def ended(u, s, b) -> bool:
    """The scheduler's on_done: hands the turn that just ended to its environment (a thread,
    or here) and holds the slot."""
    toks, lps = u.toks[s][turn_start[s]:], u.lps[s][turn_start[s]:]
    vers = u.vers[s][turn_start[s]:]
    cut = not toks or toks[-1] not in stops

    def step(c=convs[s]):
      return _after_turn(c, toks, lps, cut, renderer=renderer, decode=decode,
                         max_turns=max_turns, budget=budget, vers=vers)

    pending[b] = pool.submit(step) if pool is not None else Future()
    if pool is None:
      pending[b].set_result(step())
    return True

  # An observation is right-padded to a bucket of its length for Engine.extend, and the
  # padding's positions must fit in the window too: room for one such bucket past the budget
  # (a window grows only as far as it is needed, so this costs nothing until then).
  sched = Scheduler(engine, opts, n=n, max_prompt_len=max_prompt_len, key=jax.random.key(seed),
                    on_done=ended, whole_groups=True,
                    max_len=max_prompt_len + budget + 1 + bucket(budget, minimum=8))
  unit = Unit(None, firsts, sched.key, n)
  queue = deque(sched.open(unit))

  def collect(block: bool):
    """Continues the held slots whose environment step is back (waiting for one when
    `block`) and frees those whose conversation is over."""
    if block and pending and not any(f.done() for f in pending.values()):
      wait(list(pending.values()), return_when=FIRST_COMPLETED)
    cont = []
    for b in sorted(b for b, f in pending.items() if f.done()):
      more = pending.pop(b).result()  # an environment's EnvError is raised here
      if more is None:
        sched.release(b)
      else:
        s = sched.occupant[b][1]
        turn_start[s] = len(unit.toks[s]) + len(more)
        cont.append((b, more, convs[s].turns * N + s))
    if cont:
      sched.extend(cont, params, weights)

  try:
    while queue or sched.busy():
      collect(block=False)
      sched.admit(queue, params, weights)
      if not sched.live():  # every occupied slot waits on its environment
        collect(block=True)
        continue
      sched.decode(params, weights)
  finally:
    if pool is not None:
      pool.shutdown(wait=True, cancel_futures=True)
  stats = {k: v for k, v in sched.stats().items()
           if k in _STAT_SUMS or k.endswith("_peak") or k in ("kv_pages", "kv_preemptions")}
  stats["extend_calls"] = sched.counters.get("extend_calls", 0)
  stats["turn_calls"] = stats["extend_calls"] + stats["prefill_calls"]
  rollout, rewards, extra = _result(convs, firsts, n, opts.pad_id, stats, t0)
  if weights is not None:
    rollout = with_versions(rollout, [c.versions for c in convs])
  return rollout, rewards, extra


def _assemble(firsts, n, convs, pad_id, stats, wall, env_s) -> Rollout:
  N = len(convs)
  lp = max(map(len, firsts))
  lc = max(1, max(len(c.tokens) for c in convs))
  prompt = np.full((N, lp), pad_id, np.int32)
  completion = np.full((N, lc), pad_id, np.int32)
  mask = np.zeros((N, lc), np.int32)
  logprobs = np.zeros((N, lc), np.float32)
  for s, c in enumerate(convs):
    p = firsts[s // n]
    prompt[s, :len(p)] = p
    completion[s, :len(c.tokens)] = c.tokens
    mask[s, :len(c.tokens)] = c.model
    logprobs[s, :len(c.tokens)] = c.logprobs
  generated = int(mask.sum())
  stats = dict(stats, tokens_generated=generated, wall_s=wall,
               tokens_per_s=generated / max(wall, 1e-9),
               slot_utilisation=stats["live_slot_steps"] / max(stats["slot_steps"], 1),
               env_s=env_s, env_turns=float(np.mean([c.turns for c in convs])),
               env_tool_calls=float(np.mean([c.tool_calls for c in convs])),
               env_bad_tool_calls=float(sum(c.bad_tool_calls for c in convs)))
  return Rollout(prompt_ids=prompt,
                 prompt_lengths=np.array([len(firsts[s // n]) for s in range(N)], np.int32),
                 completion_ids=completion, completion_mask=mask, logprobs=logprobs,
                 lengths=np.array([len(c.tokens) for c in convs], np.int32),
                 finish_reasons=[c.finish for c in convs],
                 prompt_index=np.arange(N, dtype=np.int32) // n, stats=stats)
