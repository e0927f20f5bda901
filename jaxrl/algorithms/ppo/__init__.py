"""PPO with a learned critic and GAE, on GRPO's parts. trainer.py reads top to bottom; `from
jaxrl.algorithms import ppo` gives the names a run, a test or a notebook needs."""

from jaxrl.algorithms.ppo.config import CHOICES, algo_section, critic_section, default_config
from jaxrl.algorithms.ppo.critic import (critic_values, init_critic, make_values_fn, value_loss)
from jaxrl.algorithms.ppo.programs import programs
from jaxrl.algorithms.ppo.trainer import (PPOState, Parts, critic_advantages, run, setup, step,
                                          step_metrics, update)

__all__ = [
    "CHOICES", "PPOState", "Parts", "algo_section", "critic_advantages", "critic_section",
    "critic_values", "default_config", "init_critic", "make_values_fn", "programs", "run",
    "setup", "step", "step_metrics", "update", "value_loss",
]
