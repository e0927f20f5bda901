"""GRPO's scoring (step 3): the configured reward functions on the completions' text (host
Python) and frozen reward models on the learner mesh (one jitted forward; combined by an
ensemble rule, optionally normalised, mixed by weight)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from jaxrl.errors import ConfigError
from jaxrl.parallel import batch_sharding
from jaxrl.parallel.distributed import to_host
from jaxrl.rewards import RewardSpec, parse_specs, register, score
from jaxrl.rewards import model as rm_lib

if TYPE_CHECKING:
  from jaxrl.algorithms.grpo.parts import Parts


def score_rollout(p: Parts, rollout, prompts: list[dict]) -> tuple[np.ndarray, dict]:
  """[N] rewards of a rollout of `prompts` x G (rows p*G .. p*G+G-1 answer prompt p) and their
  stats: each reward's mean, train `accuracy` when the task's checker is not a reward, the
  reward models' scores, and timing_s/reward."""
  r = p.config.rollout
  texts = [p.tokenizer.decode(row[:n]) for row, n in zip(rollout.completion_ids,
                                                         rollout.lengths)]
  fields = {k: [prompts[i // r.group_size].get(k) for i in range(len(texts))]
            for k in prompts[0]}
  fields["completion_length"] = [int(n) for n in rollout.lengths]
  t0 = time.perf_counter()
  rewards, reward_stats = score(p.scorer.specs, texts, fields, normalize=p.config.normalize_rewards)
  if p.task is not None and f"reward/task_{p.task.name}" not in reward_stats:
    # The task's checker is not a reward here, but train accuracy is still worth logging.
    reward_stats["accuracy"] = float(np.mean([p.task.check(c, a) for c, a in
                                              zip(texts, fields["answer"])]))
  if p.scorer.rms is not None:
    t1 = time.perf_counter()
    rm_values, rm_stats = rm_rewards(p, rollout)
    rewards = rewards + rm_values
    reward_stats.update(rm_stats, **{"timing_s/reward_model": time.perf_counter() - t1})
  reward_stats["timing_s/reward"] = time.perf_counter() - t0
  return rewards, reward_stats


def rm_rewards(p: Parts, rollout) -> tuple[np.ndarray, dict]:
  """weight x the reward models' combined score [N] (each RM normalised first, when asked),
  and stats; the combined raw score is logged as reward/rm_mean, the proxy the alarm
  watches."""
  rm_cfg = p.config.reward_model
  tokens, positions, last, logp_mask = rm_lib.completion_inputs(
      rollout, length=p.rollouts.length, pad_id=p.tokenizer.pad_id, eos_id=p.tokenizer.eos_id)
  dev = p.put({"tokens": tokens, "positions": positions, "logp_mask": logp_mask})
  scores_mn = p.scorer.rms.score(dev["tokens"], dev["positions"],
                          p.put({"last": last}, batch_sharding(p.mesh, 1, "learner"))["last"],
                          dev["logp_mask"])
  scores_mn = to_host(scores_mn)  # every process scores every row (see to_host)
  raw = np.asarray(rm_lib.ensemble(scores_mn, mode=rm_cfg.ensemble, k=rm_cfg.k))
  value = raw if p.scorer.rm_norm is None else np.asarray(rm_lib.ensemble(
      p.scorer.rm_norm.normalize(scores_mn), mode=rm_cfg.ensemble, k=rm_cfg.k))
  stats = {"reward/rm_mean": float(raw.mean()), "reward/rm_std": float(raw.std())}
  if len(scores_mn) > 1:
    stats.update({f"reward/rm_{i}": float(x.mean()) for i, x in enumerate(scores_mn)})
  return float(rm_cfg.weight) * value, stats


def task_reward(task):
  """Registers the task's checker as reward "task_<name>" and returns its name."""
  name = f"task_{task.name}"

  def check(completions, *, batch, **_):
    return [float(task.check(c, a)) for c, a in zip(completions, batch["answer"])]

  register(name)(check)
  return name


def reward_specs(text: str, task, kwargs=None) -> list[RewardSpec]:
  """Parses `rewards` ("task", "exact_match:1.0,format:0.1", ...); "task" is the task's own
  checker; "none" is no verifiable reward. `kwargs` maps a reward name to its keyword arguments
  (config `reward_kwargs`, e.g. {"format": {"pattern": "^\\d+$"}})."""
  if text.strip() in ("none", ""):
    return []  # a reward model alone (setup() checks that one is configured)
  parts = []
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, sep, weight = part.partition(":")
    if name == "task":
      if task is None:
        raise ConfigError("rewards names 'task' but data.task is empty: name a reward such as "
                          "exact_match, or set data.task.")
      name = task_reward(task)
    parts.append(name + sep + weight)
  kwargs = dict(kwargs or {})
  specs = parse_specs(",".join(parts))
  unknown = sorted(set(kwargs) - {s.name for s in specs} - {"task"})
  if unknown:
    raise ConfigError(f"reward_kwargs names {unknown[0]!r}, which `rewards` does not use: "
                      f"rewards are {', '.join(s.name for s in specs)}.")
  task_name = task_reward(task) if task is not None else None
  return [RewardSpec(s.name, s.weight, dict(kwargs.get(
      "task" if s.name == task_name else s.name, {}))) for s in specs]
