"""GRPO-family RL: generate -> score -> update, with the policy and a frozen reference on one mesh.

    jaxrl grpo --config configs/grpo_tiny.py --workdir DIR

Reads top to bottom: step() is the algorithm, one call per role (parts.py), each a function a
notebook can call on the parts setup() builds:
  scored = scored_rollouts(parts, state, prompts, n)          # rollouts, scorer: steps 1-3
  f = learner_forwards(parts, state, scored)                  # learner: step 4
  experience = f.experience(parts, group_advantages(parts, f))  # step 5 (experience.py)
  state, upd = update(parts, state, experience)               # learner: step 6 (update.py)
  metrics = step_metrics(parts, experience, upd)              # and the monitors (monitors.py)
Each step:
  1. sync the policy's weights into the sampler layout (timed: sync/ms);
  2. sample B prompts x G completions with the engine (continuous batching, one prefill per
     group); with dynamic sampling, groups whose G rewards are all equal are dropped and more
     prompts are sampled to refill the batch. With rollout.async_generation, a producer thread
     (producer.py) runs steps 2-3 ahead on the sampler's devices into a bounded queue, up to
     rollout.max_staleness versions stale, and the step takes B groups from it;
  3. score the completions with the configured reward functions (host Python) and, when
     reward_model.checkpoints names any, with frozen reward models on the learner mesh
     (rewards.py);
  4. compute the reference's and the pre-update policy's log-probs of the sampled tokens in
     jitted forwards (the "old" log-probs are the policy's own before this step's updates,
     never a copy of the current ones). With one update per step (num_iterations =
     minibatches = 1, KL in the loss) the old log-probs are those of the update's own forward,
     under stop_gradient: the same values, one forward fewer (TRL does the same;
     update.old_logp_from_update decides). Every learner forward runs each group's prompt
     once, its G completions attending to it (grouped_learner_batch;
     algo.shared_prompt_forward);
  5. compute advantages with the named estimator (grpo, dr_grpo, rloo, reinforce_pp, ...);
  6. run num_iterations x minibatches updates of the clipped surrogate (+ beta * KL, - entropy
     bonus), through the shared jitted train step.

Departures from the GRPO paper (Shao et al. 2024), all configurable: the loss aggregation
defaults to token-mean (DAPO) rather than the paper's per-sequence mean; the KL is the k3
estimator in the loss, as in the paper, but clamped at 10 (as verl); the advantage divides by
the group's unbiased std plus eps = 1e-6 (as TRL) and is clipped to +-5; the clip range is
eps_low = eps_high = 0.2 (eps_high > eps_low is DAPO's clip-higher). The sampler's log-probs
differ from the learner's only by numerics (and staleness when async); their ratio is
logged as is_ratio/mean and can correct the loss by truncated importance sampling (tis_cap).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.data import prefs
from jaxrl.data.hf_tokenizer import eos_ids
from jaxrl.envs import env_factory
from jaxrl.errors import ConfigError
from jaxrl.evals.evaluator import EnvEvaluator, Evaluator, checker_for
from jaxrl.models import ModelConfig, abstract_model, lora
from jaxrl.models.flops import rollout_flops, train_flops
from jaxrl.parallel import batch_sharding
from jaxrl.parallel.sync import SamplerCopy, WeightSync, cast_floats
from jaxrl.rewards import model as rm_lib
from jaxrl.algorithms.grpo.config import (CHOICES, conversation_tokens, default_config,
                                          grouped_forward, prompt_length, ref_dtype)
from jaxrl.data.prompts import PromptStream
from jaxrl.algorithms.grpo.batch import Experience
from jaxrl.algorithms.grpo.experience import group_advantages, learner_forwards, scored_rollouts
from jaxrl.algorithms.grpo.parts import Learner, Parts, Rollouts, Scorer
from jaxrl.algorithms.grpo.monitors import Alarms, KLCoefficient
from jaxrl.algorithms.grpo.programs import programs
from jaxrl.algorithms.grpo.rewards import reward_specs
from jaxrl.algorithms.grpo.update import (grpo_loss, logprob_micro_batches, make_batch_logprobs_fn,
                                          old_logp_from_update, update)
from jaxrl.sampler import Engine, SamplingParams
from jaxrl.sampler.scheduler import check_multi_turn
from jaxrl.train.data import load_task, records
from jaxrl.train.optim import make_optimizer
from jaxrl.train.run import Run
from jaxrl.train.state import make_train_step


def run(config, workdir: str, *, out=print) -> dict:
  """Trains (or resumes) the GRPO run in `workdir`; returns the summary."""
  p, state = setup(config, workdir, out=out)
  r = config.rollout
  return train(p, state, step, banner=(
      f"grpo: {p.cfg.num_params:,} parameters{lora.describe(p.cfg)}, "
      f"{len(p.rollouts.stream.records)} prompts, {r.prompts_per_step} x {r.group_size} "
      f"samples per step, {config.train.steps} steps; placement {p.run.placement.mode}"))


def train(p: Parts, state, step_fn, *, banner: str) -> dict:
  """Resumes the run's latest checkpoint (if any) and trains to train.steps, each step
  step_fn(p, state, prompts) (GRPO's step, or PPO's); returns the summary."""
  state = p.run.resume(state, p.learner.shardings, p.rollouts.stream,
                       updates_per_step=p.learner.updates_per_step)
  if p.cfg.lora_rank:  # share the resumed base, or the starting one would stay live beside it
    p.learner.reference = lora.adapters_off(state.params)
  return p.run.train(
      state, functools.partial(step_fn, p), p.rollouts.stream, put=lambda b: b,
      eval_fn=functools.partial(evaluate, p), updates_per_step=p.learner.updates_per_step,
      summary_extra=lambda: {"alarms": dict(p.alarms.raised), "kl/max": p.alarms.kl_max,
                             "reward_hacking_alarm": p.alarms.watching or "off"},
      banner=banner)


def step(p: Parts, state, prompts: list[dict]):
  """One GRPO step: (state, metrics) after this step's prompts."""
  t_step = time.perf_counter()
  n = int(jax.device_get(state.step)) // p.learner.updates_per_step  # GRPO steps done
  scored = scored_rollouts(p, state, prompts, n)  # 1-3: rollouts, scorer
  f = learner_forwards(p, state, scored)  # 4: the learner's log-probs
  experience = f.experience(p, group_advantages(p, f))  # 5
  state, upd = update(p, state, experience)  # 6
  p.learner.beta.after_step(p.config.algo, kl=upd["kl"], n_steps=len(experience.batch["mask"]))
  metrics = step_metrics(p, experience, upd)
  step_s = time.perf_counter() - t_step
  metrics["timing_s/step_wall"] = step_s
  metrics["perf/gen_fraction"] = experience.times["gen_wait"] / step_s
  metrics.update(p.alarms.on_step(n + 1, metrics))
  return state, metrics


def step_metrics(p: Parts, e: Experience, upd: dict) -> dict:
  """The step's logged metrics, from its experience and its updates' metrics."""
  a, task, t = p.config.algo, p.task, e.times
  # Model FLOPs of one learner forward over this batch (jaxrl.models.flops); a backward
  # costs two forwards, one with LoRA (train_flops).
  fwd_flops = rollout_flops(p.cfg, e.rollout, share_prompt=p.learner.grouped)
  return {
      # (PPO's critic warm-up steps make no policy update: its metrics are absent then.)
      **{k: upd[k] for k in ("loss", "grad_norm", "lr", "kl", "entropy", "clipfrac/low",
                             "clipfrac/high") if k in upd},
      "reward/mean": float(e.rewards_bg.mean()), "reward/std": float(e.rewards_bg.std()),
      # Train accuracy only where a task checks answers: a metric that does not apply is
      # absent from metrics.jsonl, not "nan".
      # (The task's reward when it is one, else the accuracy score_rollout adds; not
      # .get(key, stats["accuracy"]), whose default is looked up, and missing, either way.)
      **({"accuracy": e.reward_stats[f"reward/task_{task.name}"]
          if f"reward/task_{task.name}" in e.reward_stats else e.reward_stats["accuracy"]}
         if task is not None else {}),
      "frac_zero_std_groups": e.frac_zero,
      **{k: upd[k] for k in ("is_ratio/mean",) if k in upd},
      "staleness/mean": float(e.step - e.version),
      "kl/beta": p.learner.beta.value,
      # gen: the rollout's own wall time; gen_wait: what the learner waited for it (less
      # than gen when generation overlapped the previous update).
      "timing_s/gen": t["gen"], "timing_s/gen_wait": t["gen_wait"],
      "timing_s/score": t["old"] + e.reward_stats["timing_s/reward"],
      "timing_s/ref": t["ref"], "timing_s/update": upd["timing_s/update"],
      "timing_s/sync": p.rollouts.weight_sync.last.ms / 1e3,
      "perf/tflops/ref": fwd_flops / max(t["ref"], 1e-9) / 1e12,
      "perf/tflops/update": (a.num_iterations * train_flops(p.cfg, fwd_flops)
                             / max(upd["timing_s/update"], 1e-9) / 1e12),
      **p.rollouts.weight_sync.last.metrics(), **e.gen_stats, **e.reward_stats,
  }


def evaluate(p: Parts, params, step: int) -> dict:
  """The held-out eval (jaxrl.evals: greedy eval/accuracy, and eval/pass@k, mean@k, maj@k when
  eval.n > 0) on data.eval_file or the task's test split, scored by the eval's checker; the
  reward-hacking alarm's verdict on eval/accuracy; a few completions written to
  DIR/samples/step_N.jsonl for a person to read."""
  if p.evaluator is None:
    return {}
  m = p.evaluator(params)
  m.update(p.alarms.on_eval(step, m["eval/accuracy"]))
  keep = p.config.eval.spot_check
  if keep and p.run.main:
    folder = os.path.join(p.run.run_dir.workdir, "samples")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"step_{step}.jsonl"), "w", encoding="utf-8") as f:
      for row in p.evaluator.samples(keep):
        f.write(json.dumps({"step": step, **row}) + "\n")
  return m


def reference_copy(params, dtype: str):
  """The frozen reference: a copy of the starting params (the same shardings), its floating
  leaves cast to `dtype` ("": kept as they are)."""
  if dtype:
    return cast_floats(params, jnp.dtype(dtype))
  return jax.tree.map(jnp.copy, params)


def setup(config, workdir: str, *, out=print, command: str = "grpo", choices=None,
          sections=None, plan=None) -> tuple[Parts, Any]:
  """(the run's parts, the starting train state: the policy from init.checkpoint or
  model.hf_path, fresh optimizer state). Checks the config first. A sibling trainer built on
  these parts (PPO) passes its own command, CHOICES, config sections and memory plan."""
  run = Run(config, workdir, out=out, choices=CHOICES if choices is None else choices,
            placement=True, command=command,
            sections=default_config().keys() if sections is None else sections,
            programs=programs if plan is None else plan)
  cfg, tokenizer = run.cfg, run.tokenizer
  a, r = config.algo, config.rollout
  task = load_task(config)
  _check(config)
  train_records, held_out, _ = records(
      config, task, "rl", build=lambda split, n, seed: task.records(split, n, seed),
      what="{prompt, answer}")
  run.record_data(prefs.fingerprint(train_records))
  env = env_factory(config)
  specs, rm_paths = _rewards(config, task, env)

  # Models: the policy (trained) and its frozen reference, both in the learner layout.
  updates_per_step = a.num_iterations * a.minibatches
  tx, schedule = make_optimizer(config.optim, config.train.steps * updates_per_step)
  graphdef, state, shardings = run.init_state(tx, layout="learner")
  # The reference is the starting policy, rebuilt from the same source on resume (never saved).
  # With LoRA it is the base with adapters off: the policy's own frozen base, not a copy.
  # Otherwise a copy, in placement.ref_dtype when set (reference_copy).
  reference = (lora.adapters_off(state.params) if cfg.lora_rank else
               reference_copy(state.params, ref_dtype(config)))
  # The reward models beside the reference; the sampler fed by a timed weight sync.
  scorer = _scorer(run, specs=specs, rm_paths=rm_paths)
  engine, weight_sync = _sampler(run, graphdef)

  renderer = None
  if env is not None:  # the prompts are the environment's first messages, tools included
    from jaxrl.envs import Timed
    from jaxrl.data.chat import ChatRenderer
    from jaxrl.envs.rollout import prompt_ids
    renderer = ChatRenderer(tokenizer, config.data)
    longest = max(len(prompt_ids(renderer, Timed(*env), x)[0])
                  for x in train_records + held_out)
  else:
    longest = max(len(run.prompts.ids(x)) for x in train_records + held_out)
  prompt_len = prompt_length(config, longest)
  completion = conversation_tokens(config) if env is not None else r.max_new_tokens
  learner = _learner(run, graphdef, shardings, tx, schedule, reference=reference,
                     completion=completion, updates_per_step=updates_per_step)
  alarms = Alarms(kl_threshold=config.alarm.kl_threshold, window=config.alarm.window, out=out,
                  min_drop=config.alarm.min_accuracy_drop,
                  reward_key="reward/rm_mean" if scorer.rms is not None else "reward/mean")
  stream = PromptStream(train_records, r.prompts_per_step, config.seed,
                        extras={"rm_norm": scorer.rm_norm} if scorer.rm_norm is not None
                        else None,
                        learner_state={"kl_coef": learner.beta, "alarms": alarms})
  run.checkpointer()
  if env is not None:
    evaluator = _env_evaluator(run, graphdef, held_out, task, weight_sync, alarms, env=env,
                               renderer=renderer, prompt_len=prompt_len, budget=completion)
  else:
    evaluator = _evaluator(run, graphdef, held_out, task, weight_sync, alarms)
  parts = Parts(
      run=run, task=task,
      rollouts=Rollouts(engine=engine, weight_sync=weight_sync,
                        sampler_copy=SamplerCopy(weight_sync),
                        stream=stream, prompt_len=prompt_len,
                        length=prompt_len + completion,  # fixed: jits compile once
                        env=env, renderer=renderer),
      scorer=scorer,
      learner=learner,
      alarms=alarms, evaluator=evaluator)
  run.closers.append(
      lambda: parts.rollouts.queue is not None and parts.rollouts.queue.close())
  return parts, state


def _learner(run: Run, graphdef, shardings, tx, schedule, *, reference, completion: int,
             updates_per_step: int) -> Learner:
  """Steps 4-6's role: the log-prob forward (the reference's and, without
  old_logp_from_update, the policy's, whose entropy is logged), the train step of the clipped
  surrogate over a batch whose completions are `completion` tokens, the frozen reference and
  the KL coefficient."""
  config, mesh = run.config, run.mesh
  a, r = config.algo, config.rollout
  shd = batch_sharding(mesh, 2, "learner")
  old_from_update = old_logp_from_update(a)
  logprobs_fn = make_batch_logprobs_fn(graphdef, r.temperature, mesh=mesh,
                                       entropy=not old_from_update,
                                       micro_batches=logprob_micro_batches(config))
  loss_fn = grpo_loss(graphdef, a, temperature=r.temperature, norm_len=completion)
  train_step = make_train_step(loss_fn, tx, schedule, shardings, shd, mesh=mesh,
                               accum_steps=config.optim.accum_steps)
  return Learner(shardings=shardings, shd=shd,
                 updates_per_step=updates_per_step,
                 grouped=grouped_forward(config, run.replicas, run.say),
                 old_from_update=old_from_update, logprobs_fn=logprobs_fn,
                 train_step=train_step, reference=reference, beta=KLCoefficient(a.beta))


def _rewards(config, task, env) -> tuple[list, list[str]]:
  """(the reward functions, the reward model run dirs reward_model.checkpoints names), after
  checking that something rewards the policy and that an environment, which scores its
  conversations itself, comes alone."""
  if (env is not None) != (config.rewards == "env"):
    raise ConfigError(
        f"rewards=env scores by the environment, and this run has none: set data.env or "
        f"env_module, or name a reward (e.g. task)." if env is None else
        f"environment {env[0]!r} scores the conversations, but rewards={config.rewards!r}: "
        "set --config.rewards=env.")
  specs = [] if env is not None else reward_specs(config.rewards, task,
                                                  config.get("reward_kwargs"))
  rm_cfg = config.reward_model
  rm_paths = rm_lib.checkpoint_list(rm_cfg)
  if env is not None and rm_paths:
    raise ConfigError("reward_model.checkpoints is set with an environment, which scores the "
                      "conversations itself: clear reward_model.checkpoints.")
  if not specs and not rm_paths and env is None:
    raise ConfigError(f"rewards={config.rewards!r} and reward_model.checkpoints is empty: "
                      "nothing rewards the policy; name a reward (e.g. task) or a `jaxrl rm` "
                      "run dir.")
  if rm_cfg.k < 0:
    raise ConfigError(f"reward_model.k={rm_cfg.k} is negative: mean_minus_std subtracts k "
                      "standard deviations; use k >= 0.")
  return specs, rm_paths


def _scorer(run: Run, *, specs: list, rm_paths: list[str]) -> Scorer:
  """Step 3's role: the reward functions, and the frozen `jaxrl rm` runs in the learner
  layout (beside the reference) with their running normaliser when reward_model.normalize."""
  rms = rm_lib.RewardModels.load(rm_paths, run.mesh, run.tokenizer) if rm_paths else None
  norm = rms is not None and run.config.reward_model.normalize
  return Scorer(specs=specs, rms=rms, rm_norm=rm_lib.RunningNorm(len(rm_paths)) if norm else None)


def _sampler(run: Run, graphdef) -> tuple[Engine, WeightSync]:
  """The sampler: the engine on the sampler mesh, fed by a timed weight sync every step. With
  LoRA only the adapters move each step, merged on the sampler into its own copy of the
  frozen base: the engine then runs the plain model (WeightSync.sampler_cfg)."""
  r, cfg, tokenizer = run.config.rollout, run.cfg, run.tokenizer
  sampling = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                            max_new_tokens=r.max_new_tokens,
                            eos_id=None if r.ignore_eos else tokenizer.eos_id,
                            # generation_config.json's other eos ids (none for the bytes)
                            stop_ids=() if r.ignore_eos else eos_ids(tokenizer)[1:])
  weight_sync = WeightSync(cfg, run.placement, dtype=run.config.placement.sync_dtype or None)
  scfg = weight_sync.sampler_cfg
  engine = Engine(graphdef if scfg == cfg else abstract_model(scfg)[0], scfg,
                  run.placement.sampler.mesh, sampling=sampling)
  # Each synced tree in the engine's decode form (on TPU the q, k and v weights heads-major).
  weight_sync.prepare = engine.decode_params
  return engine, weight_sync


def _sampler_model(graphdef, cfg: ModelConfig):
  """(graphdef, cfg) of the model the evaluator's engine runs on WeightSync.to_sampler's
  params: the learner's, with a scanned model's layers one by one (as the sync gives them)."""
  if not cfg.scan_layers:
    return graphdef, cfg
  cfg = cfg.replace(scan_layers=False)
  return abstract_model(cfg)[0], cfg


def _evaluator(run: Run, graphdef, held_out: list[dict], task, weight_sync: WeightSync,
               alarms: Alarms) -> Evaluator | None:
  """The held-out evaluator of data.eval_file (or the task's test split), scored by the eval's
  checker (jaxrl.evals.checker_for: eval.reward, data.task's checker, or the first of
  `rewards`), and the reward-hacking alarm armed on its eval/accuracy. Says in one line what is
  evaluated, or why nothing is and the alarm is off."""
  config = run.config
  e, r, d = config.eval, config.rollout, config.data
  checker = checker_for(config, task)
  where = d.eval_file or (f"{task.name}'s test split" if task is not None else "")
  off = None
  if not held_out:
    off = "no held-out prompts (set data.eval_file to a JSONL of {prompt, answer})"
  elif checker is None:
    off = (f"no checker for {where} (rewards={config.rewards!r}: set "
           "--config.eval.reward=exact_match or another reward)")
  elif e.every == 0:
    off = "eval.every=0"
  if off is not None:
    run.say(f"held-out eval off: {off}; the reward-hacking alarm is off")
    return None
  ev = Evaluator(graphdef, run.cfg, run.mesh, run.tokenizer, held_out, checker,
                 sampler_model=_sampler_model(graphdef, run.cfg),
                 batch=e.batch_size, max_new=e.max_new_tokens or r.max_new_tokens, n=e.n,
                 ks=e.k, temperature=e.temperature, seed=config.seed,
                 sampler_mesh=run.placement.sampler.mesh,
                 to_sampler=weight_sync.to_sampler,
                 slots=r.slots, steps_per_call=r.steps_per_call, grow_cache=r.grow_cache,
                 data_cfg=config.data)
  sampled = ""
  if e.n:
    sampled = f"; {e.n} samples per prompt at temperature {e.temperature}"
    sampled += f" (pass@k, mean@k, maj@k for k in {tuple(e.k)})" if e.k else ""
  alarms.watching = f"eval/accuracy ({checker.name} on {len(held_out)} prompts of {where})"
  run.say(f"held-out eval every {e.every} steps: {len(held_out)} prompts of {where}, checker "
          f"{checker.name}; greedy eval/accuracy{sampled}; reward-hacking alarm armed")
  return ev


def _env_evaluator(run: Run, graphdef, held_out: list[dict], task, weight_sync: WeightSync,
                   alarms: Alarms, *, env, renderer, prompt_len: int, budget: int
                   ) -> EnvEvaluator | None:
  """The multi-turn held-out eval: each held-out record's conversation with the run's
  environment, greedy, through the rollouts' own driver (jaxrl.evals.EnvEvaluator), and the
  reward-hacking alarm armed on its eval/accuracy. Says in one line what is evaluated, or why
  nothing is."""
  config = run.config
  e, r, d = config.eval, config.rollout, config.data
  where = d.eval_file or (f"{task.name}'s test split" if task is not None else "")
  off = None
  if not held_out:
    off = "no held-out prompts (set data.eval_file to a JSONL of {prompt, answer})"
  elif e.every == 0:
    off = "eval.every=0"
  if off is not None:
    run.say(f"held-out eval off: {off}; the reward-hacking alarm is off")
    return None
  if e.n:
    raise ConfigError(f"eval.n={e.n}: the multi-turn held-out eval (environment {env[0]!r}) "
                      "is greedy only for now; set --config.eval.n=0.")
  ev = EnvEvaluator(*_sampler_model(graphdef, run.cfg), run.placement.sampler.mesh,
                    run.tokenizer, held_out, env=env, renderer=renderer,
                    max_new=e.max_new_tokens or r.max_new_tokens, max_turns=r.max_turns,
                    budget=budget, prompt_len=prompt_len, slots=r.slots,
                    steps_per_call=r.steps_per_call, grow_cache=r.grow_cache,
                    to_sampler=weight_sync.to_sampler)
  alarms.watching = (f"eval/accuracy (environment {env[0]!r} on {len(held_out)} prompts of "
                     f"{where})")
  run.say(f"held-out eval every {e.every} steps: {len(held_out)} prompts of {where}, "
          f"conversations with environment {env[0]!r} (greedy, up to {r.max_turns} turns): "
          "eval/accuracy (reward >= 1), eval/tool_calls/mean; reward-hacking alarm armed")
  return ev


def _check(config) -> None:
  """One sentence for rollout settings that cannot go together."""
  lora_section = config.model.get("lora") or {}
  if lora_section.get("rank") and lora_section.get("dropout"):
    raise ConfigError(f"model.lora.dropout={lora_section['dropout']} is not supported by "
                      "GRPO (dropout in the update would bias its ratio to the sampler's "
                      "log-probs, which run without it): set model.lora.dropout=0.")
  if config.rollout.async_generation and config.placement.mode != "disaggregated":
    raise ConfigError("rollout.async_generation=True needs placement.mode=disaggregated (the "
                      "sampler overlaps the update on its own devices): set both, or turn "
                      "async_generation off.")
  r = config.rollout
  has_env = bool(config.data.get("env") or config.get("env_module"))
  if r.get("max_turns", 1) > 1 and not has_env:
    raise ConfigError(f"rollout.max_turns={r.max_turns} needs an environment to answer the "
                      "turns: set data.env (or env_module), or leave max_turns at 1.")
  if has_env:  # at start-up, not at the first rollout
    check_multi_turn(r.get("kv_cache", "dense"), r.get("kv_admission", "optimistic"))
  if has_env and r.get("streaming"):
    raise ConfigError("multi-turn rollouts (data.env / env_module) take whole units, not a "
                      "stream of them, for now: turn rollout.streaming off.")
  k = r.get("max_staleness", 1)
  if k != 1 and not r.async_generation:
    raise ConfigError(f"rollout.max_staleness={k} bounds async generation, which "
                      "is off: set rollout.async_generation=True too, or leave max_staleness "
                      "at 1.")
  if r.get("partial_rollouts") and not r.async_generation:
    raise ConfigError("rollout.partial_rollouts=True changes weights under sequences the "
                      "async producer has in flight, and async generation is off: set "
                      "rollout.async_generation=True too, or turn partial_rollouts off.")
  if r.get("streaming") and not (r.async_generation and r.get("partial_rollouts")):
    raise ConfigError("rollout.streaming=True admits the next unit's groups into slots the "
                      "current unit frees, which needs every slot on the newest weights: set "
                      "rollout.async_generation=True and rollout.partial_rollouts=True too, or "
                      "turn streaming off.")
