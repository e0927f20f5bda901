"""Parts: a GRPO run's fixed parts, built once by setup() (trainer.py) and read by every step
function (experience.py, update.py, rewards.py, batch.py, the monitors and PPO's trainer). It
sits below all of them, so none imports the trainer to name it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from jaxrl.data.prompts import PromptStream
from jaxrl.evals.evaluator import EnvEvaluator, Evaluator
from jaxrl.parallel.distributed import global_array
from jaxrl.parallel.sync import SamplerCopy, WeightSync
from jaxrl.rewards import RewardSpec
from jaxrl.rewards import model as rm_lib
from jaxrl.algorithms.grpo.monitors import Alarms, KLCoefficient
from jaxrl.sampler import Engine
from jaxrl.train.run import Run


@dataclasses.dataclass
class Rollouts:
  """Steps 1-2: the policy's weights into the sampler's layout, and the rollouts it samples
  from the prompt stream (async: through the producer's queue)."""
  engine: Engine
  weight_sync: WeightSync
  sampler_copy: SamplerCopy
  stream: PromptStream
  prompt_len: int             # prompts are right-padded to it
  length: int                 # prompt_len + max_new_tokens: the joined rows' length
  queue: Any = None           # async generation's RolloutQueue (producer.py), made on its
                              # first step; None until then and when synchronous
  # Multi-turn rollouts (jaxrl.envs): (name, make_env) and the chat renderer; None: single-turn.
  env: Any = None
  renderer: Any = None


@dataclasses.dataclass
class Scorer:
  """Step 3: the reward functions (host Python) and the frozen reward models on the learner's
  mesh, with their running normaliser."""
  specs: list[RewardSpec]
  rms: rm_lib.RewardModels | None
  rm_norm: rm_lib.RunningNorm | None


@dataclasses.dataclass
class Learner:
  """Steps 4-6: the learner's log-prob programs, the frozen reference, the train step and the
  KL coefficient."""
  shardings: Any              # the train state's
  shd: NamedSharding          # the learner batch's rows
  updates_per_step: int       # num_iterations x minibatches
  grouped: bool               # the shared-prompt layout (grouped_learner_batch)
  old_from_update: bool       # update.old_logp_from_update
  logprobs_fn: Any            # jitted (params, batch) -> (log-probs, entropy or None)
  train_step: Any             # jitted (state, batch) -> (state, metrics)
  reference: Any              # the frozen reference's params
  beta: KLCoefficient


@dataclasses.dataclass
class Parts:
  """A run's fixed parts, built once by setup(): the run, its three roles in the order a step
  calls them (rollouts, scorer, learner), the monitors and the held-out eval; PPO adds its
  critic (jaxrl.algorithms.ppo.critic.Critic). Only the host state (the stream, beta, the
  alarms, the reward models' normaliser, async generation's rollout queue) changes between
  steps."""
  run: Run                    # the run dir, learner mesh, placement, checkpointer
  task: Any                   # the built-in task (its checker), or None
  rollouts: Rollouts
  scorer: Scorer
  learner: Learner
  alarms: Alarms
  # The held-out eval (multi-turn with an environment); None: no held-out records or checker.
  evaluator: Evaluator | EnvEvaluator | None
  critic: Any = None          # PPO's critic role; None in GRPO

  # The run's: the config, the ModelConfig, the tokenizer and the learner's mesh.
  config = property(lambda self: self.run.config)
  cfg = property(lambda self: self.run.cfg)
  tokenizer = property(lambda self: self.run.tokenizer)
  mesh = property(lambda self: self.run.mesh)

  def put(self, rows: dict, sharding=None) -> dict:
    """Host rows -> global arrays (the learner batch's sharding unless given). Every process
    holds the whole batch (the rollout and its scores are the same on all of them, see
    to_host); each takes its own shards of it."""
    return {k: global_array(np.asarray(v), sharding or self.learner.shd)
            for k, v in rows.items()}

  def close(self) -> None:
    """Waits for the rollout under way and the checkpoint being written; closes the run dir."""
    self.run.close()
