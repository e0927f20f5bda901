"""GRPO-family RL. trainer.py reads top to bottom (its docstring says how it departs from the
paper); `from jaxrl.algorithms import grpo` gives the names a run, a test or a notebook needs."""

from jaxrl.algorithms.grpo.config import CHOICES, algo_section, default_config
from jaxrl.data.prompts import PromptStream
from jaxrl.algorithms.grpo.batch import (Experience, completion_width, grouped_learner_batch,
                                         learner_batch)
from jaxrl.algorithms.grpo.experience import (_refill, group_advantages, learner_forwards,
                                              scored_rollouts)
from jaxrl.algorithms.grpo.monitors import Alarms, KLCoefficient
from jaxrl.algorithms.grpo.programs import programs
from jaxrl.algorithms.grpo.rewards import reward_specs, task_reward
from jaxrl.algorithms.grpo.parts import Parts
from jaxrl.algorithms.grpo.trainer import evaluate, run, setup, step, step_metrics
from jaxrl.algorithms.grpo.update import (batch_logprobs, grpo_loss, make_batch_logprobs_fn,
                                          make_logprobs_fn, old_logp_from_update, update)

__all__ = [
    "CHOICES", "Alarms", "Experience", "KLCoefficient", "Parts", "PromptStream", "_refill",
    "algo_section", "batch_logprobs", "completion_width", "default_config", "evaluate",
    "group_advantages", "grouped_learner_batch", "grpo_loss", "learner_batch",
    "learner_forwards", "make_batch_logprobs_fn", "make_logprobs_fn", "old_logp_from_update",
    "programs", "reward_specs", "run", "scored_rollouts", "setup", "step", "step_metrics",
    "task_reward", "update",
]
