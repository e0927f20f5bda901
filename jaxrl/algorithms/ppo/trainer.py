"""PPO with a learned critic and GAE: GRPO's sibling, on GRPO's parts.

    jaxrl ppo --config configs/ppo_tiny.py --workdir DIR

Reads top to bottom as GRPO's trainer does, GRPO's roles and then the critic's; each part is a
function a notebook can call:
  scored = scored_rollouts(parts, state, prompts, n)        # GRPO's rollouts, scorer: 1-3
  f = learner_forwards(parts, state, scored)                # GRPO's learner: 4
  extra, stats = critic_advantages(parts, state, f)         # the critic: values, rewards, GAE
  experience = f.experience(parts, extra)
  state, upd = update(parts, state, experience, warmup=...)  # actor and critic
  metrics = step_metrics(parts, experience, upd, stats)
Each step:
  1-4. as GRPO (jaxrl/algorithms/grpo/trainer.py): sync the actor into the sampler, sample B
     prompts x G (G = 1 is PPO proper), score them, the old policy's and the reference's
     log-probs;
  5. the critic's values V_t of every completion token (the value head on each token's hidden
     state, jaxrl.models.RewardModel.values);
  6. per-token rewards: the per-token KL penalty -beta * KL_t on every token and the outcome
     reward on the last (algo.kl_in="reward", the RLHF arrangement; kl_in="loss" puts the KL in
     the actor's loss instead), then GAE(gamma, lambda) for advantages and returns R = A + V,
     the advantages whitened over the batch's valid tokens (jaxrl/objectives/gae.py);
  7. num_iterations x minibatches updates of the actor (GRPO's clipped surrogate, minus the
     entropy bonus) and of the critic (PPO2's clipped value loss, its own optimizer at
     critic.lr), over the same minibatches. For the first critic.warmup_steps steps only the
     critic trains.

The state is a PPOState (actor, critic): both TrainStates, both in the learner layout, both
checkpointed (params and optimizer state), so a resumed run continues bitwise. Where the issue
(#38) is silent this follows TRL's PPOTrainer: k1 KL at beta 0.05 in the reward, gamma 1,
lambda 0.95, whitened advantages, value clip 0.2, the value loss 1/2 max(...) as a token mean.
Departure: the critic has its own optimizer (OpenRLHF's and verl's arrangement), not a shared
one over a policy-and-value model, so critic.lr sets its step size alone.
"""

from __future__ import annotations

import dataclasses
import time

import flax.struct
import jax
import numpy as np

from jaxrl.errors import ConfigError
from jaxrl.models import lora
from jaxrl.objectives import gae as gae_lib
from jaxrl.objectives import losses
from jaxrl.parallel.distributed import to_host
from jaxrl.algorithms.grpo import trainer as grpo
from jaxrl.algorithms.grpo.batch import INPUTS, Experience, device_batch
from jaxrl.algorithms.grpo.experience import Forwards, learner_forwards, scored_rollouts
from jaxrl.algorithms.grpo.parts import Parts
from jaxrl.algorithms.grpo.update import logprob_micro_batches, minibatches, old_policy_means
from jaxrl.algorithms.ppo.config import CHOICES, default_config
from jaxrl.algorithms.ppo.critic import (Critic, critic_config, critic_optimizer, critic_source,
                                         init_critic, make_values_fn, value_loss)
from jaxrl.algorithms.ppo.programs import programs
from jaxrl.train.state import TrainState, make_train_step


@flax.struct.dataclass
class PPOState:
  """The actor's and the critic's TrainStates, saved and restored as one tree. `params` (what
  the loop evaluates and the sampler syncs) are the actor's; `step` counts the critic's
  optimizer updates, which every step makes (the actor's wait out critic.warmup_steps)."""
  actor: TrainState
  critic: TrainState

  @property
  def params(self):
    return self.actor.params

  @property
  def step(self):
    return self.critic.step


def run(config, workdir: str, *, out=print) -> dict:
  """Trains (or resumes) the PPO run in `workdir`; returns the summary."""
  p, state = setup(config, workdir, out=out)
  r, c = config.rollout, config.critic
  return grpo.train(p, state, step, banner=(
      f"ppo: actor {p.cfg.num_params:,} parameters{lora.describe(p.cfg)}, critic from "
      f"{c.init}{lora.describe(p.critic.cfg)} (lr {c.lr}, warm-up {c.warmup_steps} "
      f"step{'' if c.warmup_steps == 1 else 's'}), {len(p.rollouts.stream.records)} "
      f"prompts, {r.prompts_per_step} x {r.group_size} samples per step, "
      f"{config.train.steps} steps; placement {p.run.placement.mode}"))


def step(p: Parts, state: PPOState, prompts: list[dict]):
  """One PPO step: (state, metrics) after this step's prompts."""
  t_step = time.perf_counter()
  n = int(jax.device_get(state.step)) // p.learner.updates_per_step  # PPO steps done
  scored = scored_rollouts(p, state, prompts, n)  # 1-3: GRPO's rollouts and scorer
  f = learner_forwards(p, state, scored)  # 4: GRPO's learner
  extra, stats = critic_advantages(p, state, f)  # 5-6: the critic
  experience = f.experience(p, extra)
  state, upd = update(p, state, experience,
                      warmup=n < int(p.config.critic.warmup_steps))  # 7
  kl = upd.get("kl", stats.get("kl"))
  if kl is not None:
    p.learner.beta.after_step(p.config.algo, kl=kl, n_steps=len(experience.batch["mask"]))
  metrics = step_metrics(p, experience, upd, stats)
  step_s = time.perf_counter() - t_step
  metrics["timing_s/step_wall"] = step_s
  metrics["perf/gen_fraction"] = experience.times["gen_wait"] / step_s
  metrics.update(p.alarms.on_step(n + 1, metrics))
  return state, metrics


def critic_advantages(p: Parts, state: PPOState, f: Forwards):
  """Steps 5-6 on GRPO's forwards: ({adv, returns, old_values} [N, T], the batch's additions,
  and the step's critic-side stats: returns/mean, adv/mean (before whitening),
  critic/explained_variance of the values against the returns, and the old policy's KL to
  the reference when it was measured)."""
  a = p.config.algo
  mask = f.batch["mask"]
  # 5. The critic's values of every completion token.
  t0 = time.perf_counter()
  values = to_host(jax.block_until_ready(p.critic.values_fn(state.critic.params, f.dev)))
  values = np.asarray(values, np.float32)
  t_values = time.perf_counter() - t0
  # 6. Per-token rewards (the outcome on the last token, the KL penalty on every one), GAE.
  stats = {}
  kl_bt = np.zeros_like(mask)
  if f.old_np is not None:  # the old policy's KL to the reference, per token
    kl_bt = np.asarray(losses.kl_penalty(logp=f.old_np, ref_logp=f.ref_np,
                                         estimator=a.kl_estimator, clamp=a.kl_clamp or None))
    stats["kl"] = float(gae_lib.masked_mean(kl_bt, mask))
  beta = p.learner.beta.value if a.kl_in == "reward" else 0.0
  rewards_bt = gae_lib.token_rewards(score_b=f.scored.rewards_bg.reshape(-1).astype(np.float32),
                                     kl_bt=kl_bt, mask_bt=mask, beta=beta)
  adv, returns = gae_lib.gae(rewards_bt=rewards_bt, values_bt=values, mask_bt=mask,
                             gamma=float(a.gamma), lam=float(a.lam))
  stats.update({
      "returns/mean": float(gae_lib.masked_mean(returns, mask)),
      "adv/mean": float(gae_lib.masked_mean(adv, mask)),
      "critic/explained_variance": float(gae_lib.explained_variance(
          values_bt=values, returns_bt=returns, mask_bt=mask)),
      "critic/values_mean": float(gae_lib.masked_mean(values, mask)),
      "timing_s/values": t_values})
  if a.whiten_advantages:
    adv = gae_lib.whiten(adv, mask)
  if a.adv_clip:
    adv = np.clip(adv, -a.adv_clip, a.adv_clip)
  return {"adv": np.asarray(adv, np.float32), "returns": np.asarray(returns, np.float32),
          "old_values": values}, stats


CRITIC_ONLY = ("returns", "old_values")


def update(p: Parts, state: PPOState, experience: Experience, *, warmup: bool = False):
  """Step 7: the actor's and the critic's updates over the same num_iterations x minibatches
  (grpo.update.minibatches), the critic alone in warm-up. The actor's run first, then the
  critic's (independent models on the same experience, so the order changes nothing but
  lets each be timed). Returns the state and the metrics on the host: the actor's as GRPO's
  update gives them (absent in warm-up), critic/value_loss, critic/vpred_mean,
  critic/clipfrac, critic/grad_norm, critic/lr, timing_s/update and timing_s/critic_update."""
  mbs = list(minibatches(p, experience))
  inputs = [k for k in INPUTS[True] + INPUTS[False] if k in experience.batch]
  actor, critic = state.actor, state.critic
  out = {}
  t0 = time.perf_counter()
  if not warmup:
    upd = []
    for mb in mbs:
      actor, m = p.learner.train_step(actor, p.put(device_batch(
          p, {k: v for k, v in mb.items() if k not in CRITIC_ONLY}, p.config.optim.accum_steps)))
      upd.append(m)
    upd = to_host(upd)

    def mean(k):
      return float(np.mean([u[k] for u in upd]))
    out.update({"loss": mean("loss"), "grad_norm": mean("grad_norm"),
                "lr": float(upd[-1]["lr"]), "kl": mean("kl"),
                "clipfrac/low": mean("clipfrac/low"), "clipfrac/high": mean("clipfrac/high")})
  t1 = time.perf_counter()
  cupd = []
  for mb in mbs:
    critic, m = p.critic.step(critic, p.put({k: mb[k] for k in (
        *inputs, "mask", *CRITIC_ONLY)}))
    cupd.append(m)
  cupd = to_host(cupd)
  t2 = time.perf_counter()
  old = experience.old_sums if experience.old_sums is not None else (
      None if warmup else upd[0])
  if old is not None:
    out.update(old_policy_means(old))

  def cmean(k):
    return float(np.mean([u[k] for u in cupd]))
  out.update({"critic/value_loss": cmean("loss"), "critic/vpred_mean": cmean("vpred"),
              "critic/clipfrac": cmean("clipfrac"), "critic/grad_norm": cmean("grad_norm"),
              "critic/lr": float(cupd[-1]["lr"]),
              "timing_s/update": t1 - t0, "timing_s/critic_update": t2 - t1})
  return PPOState(actor=actor, critic=critic), out


def step_metrics(p: Parts, e: Experience, upd: dict, stats: dict) -> dict:
  """GRPO's step metrics (grpo.trainer.step_metrics) and the critic's. In warm-up the actor's
  update metrics are absent and `kl` is the old policy's to the reference."""
  m = grpo.step_metrics(p, e, upd)
  if "loss" not in upd:  # warm-up: the actor made no update, so it has no FLOP rate
    m.pop("perf/tflops/update", None)
  if p.config.rollout.group_size == 1:
    m.pop("frac_zero_std_groups", None)  # one sample per prompt: no group to be all-equal
  m.update({k: v for k, v in upd.items() if k.startswith("critic/")})
  m["timing_s/critic_update"] = upd["timing_s/critic_update"]
  m.update({k: v for k, v in stats.items() if k != "kl"})
  if "kl" not in m and "kl" in stats:
    m["kl"] = stats["kl"]
  m["critic/warmup"] = float("loss" not in upd)
  return m


# ----------------------------------------------------------------------------- the parts


def setup(config, workdir: str, *, out=print) -> tuple[Parts, PPOState]:
  """(the run's parts, the starting PPOState: the actor as GRPO starts its policy, the critic
  from critic.init with a fresh optimizer). Checks the config first."""
  _check(config)
  gp, actor = grpo.setup(config, workdir, out=out, command="ppo", choices=CHOICES,
                         sections=default_config().keys(), plan=programs)
  tx, schedule = critic_optimizer(config, config.train.steps * gp.learner.updates_per_step)
  graphdef, critic, shardings = init_critic(gp.run, config, tx)
  values_fn = make_values_fn(graphdef, mesh=gp.mesh, micro_batches=logprob_micro_batches(config))
  critic_step = make_train_step(value_loss(graphdef, value_clip=config.critic.value_clip), tx,
                                schedule, shardings, gp.learner.shd, mesh=gp.mesh,
                                accum_steps=config.optim.accum_steps)
  # GRPO's roles, and the critic's; the learner's shardings are the PPOState's.
  p = dataclasses.replace(gp, critic=Critic(graphdef, critic_config(config, gp.cfg), values_fn,
                                            critic_step))
  p.learner.shardings = PPOState(actor=gp.learner.shardings, critic=shardings)
  return p, PPOState(actor=actor, critic=critic)


def _check(config) -> None:
  """One sentence for what PPO does not support yet, before the run dir is touched."""
  rank = (config.model.get("lora") or {}).get("rank")
  if rank and config.critic.lora == "actor" and config.critic.init != "policy":
    raise ConfigError(f"critic.init={config.critic.init!r} with a LoRA critic (model.lora.rank="
                      f"{rank}, critic.lora='actor'): a LoRA critic starts from the policy's "
                      "base (critic.init=policy); set critic.lora=off to start a full critic "
                      "from that run.")
  if config.algo.filter_zero_std and config.rollout.group_size == 1:
    raise ConfigError("algo.filter_zero_std=True drops groups whose samples all score the "
                      "same, which is every group at rollout.group_size=1: turn it off.")
  critic_source(config)  # critic.init names something a critic can start from
