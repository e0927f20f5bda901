"""The multi-turn rollout driver: G conversations per prompt, turns interleaving generation
with environment steps, up to rollout.max_turns.

    ro, rewards_n, stats = conversations(gen, records, env=(name, make_env),
                                         renderer=ChatRenderer(tok, data_cfg), n=G, seed=s,
                                         max_turns=4, budget=256)

`gen(prompts, n, seed)` is a single-turn generator (jaxrl.sampler.generate over the run's
engine). Turn 1 samples a group's G first turns from one shared prefill of the prompt; from
then on every conversation still going is generated together, prompted with its whole
conversation so far: each turn RE-PREFILLS the conversation (the KV of the earlier turns is
not kept between turns yet; Engine.extend, which continues a slot's KV with appended tokens
and gives the same logits, is the building block for that). Between turns each conversation's
environment reads the model's turn (its tool calls parsed in the checkpoint's format) and
answers; its answer is rendered through the chat template (jaxrl.envs.chat).

A conversation ends when its environment says done (or has no observation), after max_turns
model turns, or when it reaches its `budget` of tokens after the prompt (model and
observation tokens together, the learner batch's completion width; finish "length"). A turn
cut at rollout.max_new_tokens is still a turn: the environment reads it, and its
end-of-turn token is written after it as a template token (not trained).

The result is a Rollout whose completion is everything after the prompt: completion_mask is
1 on the model's own tokens (trained, in the KL) and 0 on template and tool tokens, logprobs
are the sampler's on model tokens and 0 elsewhere, and `lengths` spans the whole
conversation. Rewards are each conversation's summed step rewards.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from jaxrl.envs import Timed
from jaxrl.envs.chat import ChatRenderer, assistant_turn
from jaxrl.errors import ConfigError
from jaxrl.sampler.rollout import Rollout

_STAT_SUMS = ("prefill_s", "decode_s", "prefill_calls", "prefill_prompts", "prefill_tokens",
              "decode_steps", "slot_steps", "live_slot_steps")


@dataclasses.dataclass
class Conversation:
  env: Timed
  messages: list[dict]
  tokens: list[int] = dataclasses.field(default_factory=list)   # after the prompt
  model: list[int] = dataclasses.field(default_factory=list)    # 1: a model token
  logprobs: list[float] = dataclasses.field(default_factory=list)
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


def conversations(gen: Callable[..., Rollout], records: list[dict], *, env, renderer,
                  n: int, seed: int, max_turns: int, budget: int, pad_id: int,
                  decode: Callable[[list[int]], str]):
  """(Rollout of len(records) x n conversations, [N] rewards, stats) (see the module doc).
  `env` is (name, make_env); `decode` the tokenizer's decode of a turn's ids."""
  name, factory = env
  t0 = time.perf_counter()
  clock = [0.0]  # the environments' own seconds
  convs, firsts = [], []
  for i, record in enumerate(records):
    group = []
    for _ in range(n):
      e = Timed(name, factory, clock)
      ids, messages = prompt_ids(renderer, e, record)
      group.append((ids, messages, e))
    if any(ids != group[0][0] for ids, _, _ in group):
      raise ConfigError(f"environment {name!r}: reset() gave record {i}'s {n} conversations "
                        "different prompts; a GRPO group needs one prompt: make reset "
                        "depend on the record only.")
    firsts.append(group[0][0])
    convs += [Conversation(env=e, messages=m) for _, m, e in group]
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
      c = convs[i]
      toks = [int(t) for t in ro.completion_ids[row, :ro.lengths[row]]]
      lps = [float(x) for x in ro.logprobs[row, :ro.lengths[row]]]
      cut = ro.finish_reasons[row] == "length"
      room = budget - len(c.tokens)
      full = len(toks) >= room
      toks, lps = toks[:room], lps[:room]
      c.tokens += toks
      c.model += [1] * len(toks)
      c.logprobs += lps
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
        continue
      more = renderer.observation_ids(before, said, obs, c.env.tools, closed=not cut)
      if len(c.tokens) + len(more) >= budget:  # no room left for another model token
        c.finish, c.done = "length", True
        continue
      c.finish = "stop"
      c.tokens += more
      c.model += [0] * len(more)
      c.logprobs += [0.0] * len(more)
      c.messages = c.messages + list(obs)
  wall = time.perf_counter() - t0
  rollout = _assemble(firsts, n, convs, pad_id, stats, wall, clock[0])
  return rollout, np.array([c.reward for c in convs], np.float32), {
      "accuracy": float(np.mean([c.correct for c in convs]))}


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
