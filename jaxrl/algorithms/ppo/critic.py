"""PPO's critic: the decoder with the reward model's scalar head read at every token
(jaxrl.models.RewardModel.values), its starting point (critic.init), its value forward and its
clipped value loss.

The critic is a RewardModel: params {"backbone": <Transformer params>, "head": [D]}, a
TrainState of its own in the learner layout (sharded as the policy is), with its own optimizer
(optim's keys at critic.lr). So a `jaxrl rm` run is a critic's starting point as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxrl.backends import compiler_options
from jaxrl.errors import ConfigError
from jaxrl.models import RewardModel, lora
from jaxrl.models.config import ModelConfig
from jaxrl.objectives import gae as gae_lib
from jaxrl.objectives import losses
from jaxrl.parallel import shard_activations
from jaxrl.rewards import model as rm_lib
from jaxrl.algorithms.grpo.update import join_micro, split_micro
from jaxrl.train import rundir
from jaxrl.train.optim import make_optimizer
from jaxrl.train.run import starting_state
from jaxrl.train.state import start_from_checkpoint


@dataclasses.dataclass
class Critic:
  """PPO's critic role, beside GRPO's three (jaxrl.algorithms.grpo.parts): its graphdef and
  ModelConfig (critic.lora), its value forward and its train step."""
  graphdef: Any
  cfg: ModelConfig
  values_fn: Any              # jitted (critic params, batch) -> V [N, T]
  step: Any                   # jitted (critic state, batch) -> (state, metrics)


def critic_optimizer(config, total_updates: int):
  """(tx, schedule): optim's optimizer and schedule at critic.lr."""
  section = config.optim.copy_and_resolve_references()
  section.lr = float(config.critic.lr)
  return make_optimizer(section, total_updates)


def critic_config(config, cfg: ModelConfig) -> ModelConfig:
  """The critic's ModelConfig: the actor's (`cfg`, model.lora included) at critic.lora="actor",
  so with LoRA its adapters and value head train over a frozen base (TrainState.train_only =
  ("head",)); the same model with LoRA off (a full critic) at critic.lora="off"."""
  return lora.base_config(cfg) if config.critic.lora == "off" else cfg


def critic_source(config) -> tuple[str, str]:
  """(what, path) the critic starts from: ("policy", "") for the policy's own start (a new
  head); ("rm", DIR) for a `jaxrl rm` run, restored whole; ("decoder", DIR) for the decoder of
  another run (a new head). One sentence when critic.init names nothing usable."""
  init = str(config.critic.init or "")
  if init == "policy":
    return "policy", ""
  if init == "reward_model":
    paths = rm_lib.checkpoint_list(config.reward_model)
    if not paths:
      raise ConfigError("critic.init='reward_model' but reward_model.checkpoints is empty: name "
                        "a `jaxrl rm` run dir there, or set critic.init=policy.")
    path = paths[0]
  else:
    path = init
  run = rundir.read_run(path.rstrip("/").removesuffix("/checkpoints")) or {}
  command = run.get("command")
  if command == "rm":
    rc = rm_lib.read_run_config(path, key="critic.init")
    if (rc.get("head") or {}).get("logprob_feature"):
      raise ConfigError(f"critic.init={path!r} is a reward model with head.logprob_feature, "
                        "whose score is not its head alone: start the critic from the policy "
                        "(critic.init=policy) or from a reward model without the feature.")
    return "rm", path
  if command in ("sft", "grpo"):
    return "decoder", path
  raise ConfigError(f"critic.init={init!r} is none of 'policy', 'reward_model' or a jaxrl rm / "
                    f"sft / grpo run dir ({path!r} records command {command!r}).")


def init_critic(run, config, tx):
  """(graphdef, state, shardings) of the critic, born sharded in the learner layout with a
  fresh optimizer state: from the policy's start (model.hf_path, then init.checkpoint, into the
  backbone; the head new), a reward model's run, or another run's decoder (critic_source)."""
  what, path = critic_source(config)
  cfg = critic_config(config, run.cfg)
  graphdef, state, shardings = starting_state(config, cfg, run.mesh, tx, layout="learner",
                                              model=RewardModel, into="backbone")
  if what == "rm":  # (with LoRA: into the frozen base, a LoRA run's adapters merged)
    state = start_from_checkpoint(cfg, state, path)
  elif what == "decoder":
    state = start_from_checkpoint(cfg, state, path, into="backbone")
  return graphdef, state, shardings


def critic_values(graphdef, params, batch):
  """V [N, T] (float32) of a learner batch in either layout, aligned with its mask: index t is
  the value of the state whose action is the target at t."""
  model = nnx.merge(graphdef, params)
  if "prompt" in batch:
    return model.grouped_values(batch["prompt"], batch["prompt_len"][:, 0], batch["completion"])
  return model.values(batch["inputs"], batch["positions"])


def make_values_fn(graphdef, *, mesh: Mesh, micro_batches: int = 1):
  """Jitted (critic params, learner batch) -> V [N, T], in a lax.scan over `micro_batches` of
  the rows as the log-prob forward runs (grpo.update.make_batch_logprobs_fn)."""
  def values(params, batch):
    if micro_batches == 1:
      return critic_values(graphdef, params, batch)
    micro, units = split_micro(batch, micro_batches)
    _, out = jax.lax.scan(lambda c, mb: (c, critic_values(graphdef, params, mb)), None, micro)
    return join_micro(out, units)
  return jax.jit(shard_activations(values, mesh),
                 compiler_options=compiler_options(mesh.devices.flat))


def value_loss(graphdef, *, value_clip: float):
  """loss_fn for the shared train step: the token-mean over the mask of PPO2's clipped value
  loss (gae.clipped_value_loss), with metric sums for critic/value_loss, critic/vpred_mean and
  critic/clipfrac (each a token mean)."""
  clip = float(value_clip) or None

  def loss_fn(params, batch, key):
    del key
    v = critic_values(graphdef, params, batch)
    loss_bt, clipped = gae_lib.clipped_value_loss(
        values_bt=v, old_values_bt=batch["old_values"], returns_bt=batch["returns"],
        value_clip=clip)
    mask = batch["mask"]

    def agg(x):
      return losses.aggregate_sums(x, mask, mode="token-mean")

    loss_sum, weight = agg(loss_bt)
    return loss_sum, (weight, {"vpred": agg(jax.lax.stop_gradient(v))[0],
                               "clipfrac": agg(clipped.astype(jnp.float32))[0]})
  return loss_fn
