"""PPO's programs, abstract: GRPO's (jaxrl/algorithms/grpo/programs.py: the actor's train step, the
log-prob forward, the reward models' forward, prefill, decode, weight sync) with the critic's
state resident beside each, and the critic's own two:

  value forward       the critic's values of the step's whole batch, in a scan over the
                      update's micro-batches (as the log-prob forward)
  critic train step   the critic's update over one minibatch (make_train_step + value_loss)

`jaxrl plan` estimates them and `jaxrl plan --compile` compiles them; the memory plan's roles
gain the critic's params, gradients and optimizer state (Workload.critic).
"""

from __future__ import annotations

import dataclasses

from jaxrl import config as config_lib
from jaxrl.models import RewardModel
from jaxrl.parallel.plan import Program, abstract_bytes
from jaxrl.parallel.sync import make_placement
from jaxrl.algorithms.grpo.programs import programs as grpo_programs
from jaxrl.algorithms.grpo.update import logprob_micro_batches
from jaxrl.algorithms.ppo.critic import (critic_config, critic_optimizer, critic_values,
                                         make_values_fn, value_loss)
from jaxrl.train import programs as pg

ACTOR_ONLY = ("sampler_logp", "ref_logp", "adv", "beta", "old_logp")


def programs(config, *, devices=None, prompt_len: int | None = None):
  """(Workload, [Program]) of this PPO config (see the module docstring)."""
  work, progs = grpo_programs(config, devices=devices, prompt_len=prompt_len)
  # The critic's model (critic.lora): with LoRA its own frozen base copy, adapters and head;
  # its state's bytes below count all three, the base once more than the actor's.
  cfg = critic_config(config, config_lib.model_config(config))
  a = config.algo
  placement = make_placement(config.mesh, config.placement, devices=devices)
  mesh = placement.learner.mesh
  tx, schedule = critic_optimizer(config, config.train.steps * a.num_iterations * a.minibatches)
  graphdef, state, shardings = pg.abstract_state(cfg, mesh, tx, layout="learner",
                                                 model=RewardModel)
  plain = pg.plain_graphdef(cfg, RewardModel)
  critic_bytes = abstract_bytes(state)
  colocated = placement.mode == "colocated"
  for prog in progs:  # the critic stays on the learner's chips the whole step
    if colocated or prog.kind not in ("prefill", "decode"):
      prog.resident["critic params + optimizer state"] = critic_bytes
  train, fwd = progs[0], progs[1]
  actor_bytes = {k: v for k, v in fwd.resident.items() if k.startswith("actor")}

  # The critic's minibatch: the actor's model inputs and mask, with returns and old values.
  mb = {k: v for k, v in train.args[-1].items() if k not in ACTOR_ONLY}
  mb.update({"returns": mb["mask"], "old_values": mb["mask"]})  # [n, T] float32, same sharding
  loss_fn = value_loss(graphdef, value_clip=config.critic.value_clip)
  others = {k: v for k, v in train.resident.items() if k != "critic params + optimizer state"}
  critic_train = pg.train_program(
      loss_fn, tx, schedule, state, shardings, mb, mesh=mesh,
      accum_steps=config.optim.accum_steps,
      resident={**actor_bytes, **others},
      # A forward and backward of the decoder, as the actor's (its LM head, which the critic
      # does not run, counted: an upper bound).
      flops=train.flops, tokens=train.tokens, seq_len=train.seq_len, vocab=0, cfg=cfg,
      plain_loss=value_loss(plain, value_clip=config.critic.value_clip),
      name="critic train step")
  micro = logprob_micro_batches(config)
  fwd_batch = fwd.args[1]
  values = Program(
      "value forward", make_values_fn(graphdef, mesh=mesh, micro_batches=micro),
      (state.params, fwd_batch), "forward",
      resident={**fwd.resident, "critic optimizer state": abstract_bytes(state.opt_state)},
      flops=fwd.flops, tokens=fwd.tokens, rows=fwd.rows, seq_len=fwd.seq_len, vocab=0,
      layer_bytes=pg.layer_bytes(lambda p, b: critic_values(plain, p, b), state.params,
                                 pg.micro_batch(fwd_batch, micro), layers=cfg.num_layers,
                                 mesh=mesh),
      attention_bytes=fwd.attention_bytes)
  del values.resident["critic params + optimizer state"]
  return (dataclasses.replace(work, critic=True, critic_full=config.critic.lora == "off"),
          [train, critic_train, fwd, values, *progs[2:]])
