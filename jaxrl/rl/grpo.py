"""GRPO-family RL: generate -> score -> update, with the policy and a frozen reference on one mesh.

    jaxrl grpo --config configs/grpo_tiny.py --workdir DIR

Reads top to bottom. Each step:
  1. sync the policy's weights into the sampler layout (timed: sync/ms);
  2. sample B prompts x G completions with the engine (continuous batching, one prefill per
     group); with dynamic sampling, groups whose G rewards are all equal are dropped and more
     prompts are sampled to refill the batch;
  3. score the completions with the configured reward functions (host Python) and, when
     reward_model.checkpoints names any, with frozen reward models on the learner mesh (one
     jitted forward; combined by an ensemble rule, optionally normalised, mixed by weight);
  4. compute the reference's and the pre-update policy's log-probs of the sampled tokens in
     jitted forwards (the "old" log-probs are the policy's own before this step's updates,
     never a copy of the current ones). With one update per step (num_iterations =
     minibatches = 1, KL in the loss) the old log-probs are those of the update's own forward,
     under stop_gradient: the same values, one forward fewer (TRL does the same). Every
     learner forward runs each group's prompt once, its G completions attending to it
     (grouped_learner_batch; algo.shared_prompt_forward);
  5. compute advantages with the named estimator (grpo, dr_grpo, rloo, reinforce_pp, ...);
  6. run num_iterations x minibatches updates of the clipped surrogate (+ beta * KL, - entropy
     bonus), through the shared jitted train step.

Departures from the GRPO paper (Shao et al. 2024), all configurable: the loss aggregation
defaults to token-mean (DAPO) rather than the paper's per-sequence mean; the KL is the k3
estimator in the loss, clamped at 10 (as verl); advantages are clipped to +-5. The sampler's
log-probs differ from the learner's only by numerics (and staleness when overlapped); their
ratio is logged as is_ratio/mean and can correct the loss by truncated importance sampling.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl import config as config_lib
from jaxrl.data import read_jsonl
from jaxrl.errors import ConfigError
from jaxrl.models import apply, token_logprobs
from jaxrl.models.flops import rollout_flops
from jaxrl.parallel import batch_sharding, shard_activations
from jaxrl.parallel.cpu_kernels import learner_compiler_options
from jaxrl.parallel.distributed import global_array, to_host
from jaxrl.parallel.sync import Overlap, SamplerCopy, WeightSync, make_placement
from jaxrl.rewards import RewardSpec, parse_specs, register, score
from jaxrl.rewards import model as rm_lib
from jaxrl.rl import advantages as adv_lib
from jaxrl.rl import losses
from jaxrl.sampler import Engine, SamplingParams, bucket, generate
from jaxrl.sampler import metrics as rollout_metrics
from jaxrl.train.checkpoint import Checkpointer, restore_params
from jaxrl.train.evaluation import ExactMatch
from jaxrl.train.loop import resume, start_run, train_loop
from jaxrl.train.optim import CHOICES as OPTIM_CHOICES, make_optimizer
from jaxrl.train.state import init_train_state, make_train_step, start_from_hf

# This trainer's keys with fixed choices, checked when a run starts (config.validate).
CHOICES = {
    **OPTIM_CHOICES,
    "algo.advantage": adv_lib.ESTIMATORS,
    "algo.aggregation": losses.AGGREGATIONS,
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.kl_in": ("loss", "reward"),
    "algo.ratio_level": ("token", "sequence"),
    "reward_model.ensemble": rm_lib.ENSEMBLES,
}


def algo_section(**overrides) -> ml_collections.ConfigDict:
  """The algorithm's knobs. Defaults are GRPO with DAPO's token-mean and no clip-higher."""
  c = ml_collections.ConfigDict(dict(
      advantage="grpo",          # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline
      adv_clip=5.0,
      eps_low=0.2,
      eps_high=0.2,              # > eps_low is DAPO's clip-higher
      dual_clip_c=0.0,           # > 1 enables dual-clip; 0 = off
      ratio_level="token",       # "sequence" = GSPO
      aggregation="token-mean",
      beta=0.04,                 # KL coefficient in the loss; 0 still measures KL (alarms)
      kl_estimator="k3",
      kl_clamp=10.0,
      kl_in="loss",              # or "reward"
      kl_target=0.0,             # > 0: adaptive KL controller toward this target
      kl_horizon=10_000,
      entropy_coef=0.0,
      num_iterations=1,          # passes over each step's rollouts (mu in the GRPO paper)
      minibatches=1,             # optimizer updates per pass
      filter_zero_std=False,     # dynamic sampling: drop all-equal groups, refill the batch
      max_refill_rounds=3,
      mask_truncated=False,      # completions cut at max_new_tokens carry no loss
      tis_cap=0.0,               # > 0: truncated IS correction of sampler/learner mismatch
      # With one update per step and KL in the loss, take the old log-probs from the update's
      # own forward (stop_gradient) instead of a separate forward; False always runs one.
      old_logp_from_update=True,
      # The learner's forwards run each group's prompt once and its G completions against it
      # (instead of G joined copies), when prompts_per_step divides by minibatches x replicas;
      # minibatches then hold whole groups.
      shared_prompt_forward=True,
  ))
  c.update(overrides)
  return c


def default_config():
  """Every field a GRPO run reads, with the defaults configs/grpo_tiny.py starts from."""
  from jaxrl.parallel.distributed import distributed_section
  from jaxrl.parallel.sync import placement_config
  from jaxrl.train.optim import optim_section
  c = config_lib.base_config()
  c.model.preset = "tiny"
  c.init = ml_collections.ConfigDict(dict(checkpoint=""))  # an SFT run dir to start from
  c.data = ml_collections.ConfigDict(dict(
      task="addition", train_file="", eval_file="", train_examples=20_000, on_bad_row="error"))
  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=16, group_size=8, max_new_tokens=8, temperature=1.0, top_k=0,
      top_p=1.0, slots=64, steps_per_call=8,
      ignore_eos=False,  # True: every completion runs to max_new_tokens (benchmarks)
      # True: the KV cache's window grows with the longest live sequence (fewer reads per
      # decode step, up to two decode compiles per doubling); False: allocated whole, one
      # compile (where compiles are slow, e.g. large models on TPU).
      grow_cache=True,
      # True: generation for step k+1 runs on the sampler devices while step k updates on the
      # learner's (one-step off-policy: staleness 1, corrected by algo.tis_cap when > 0).
      # Needs placement.mode="disaggregated".
      async_generation=False))
  c.algo = algo_section()
  c.rewards = "task"  # "task" = the task's checker; else e.g. "exact_match:1.0,format:0.1";
                      # "none" (or "task:0", which still logs `accuracy`) with a reward model
  c.reward_model = rm_lib.reward_model_section()
  c.reward_kwargs = {}  # per reward, e.g. {"format": {"pattern": r"^\d+$"}}
  c.normalize_rewards = False
  # Measured on the tiny preset after 600 SFT steps: lr 5e-5 raised held-out accuracy
  # 0.711 -> 0.781 in 80 steps at KL <= 0.04; 2e-4 and above drifted (KL > 0.1) and lost accuracy.
  c.optim = optim_section(lr=5e-5, schedule="constant", warmup_steps=0, weight_decay=0.0,
                          clip_norm=1.0)
  c.train = ml_collections.ConfigDict(dict(
      steps=80, log_every=5, save_every=20, keep_checkpoints=2, async_checkpoints=True))
  c.eval = ml_collections.ConfigDict(dict(every=20, examples=256, batch_size=128))
  # Alarms: KL above kl_threshold; reward (mean over the last `window` steps; the raw reward-model
  # score when there is one) rising between an eval and the latest one at least `window` steps
  # before it, while held-out accuracy falls by more than min_accuracy_drop.
  c.alarm = ml_collections.ConfigDict(dict(kl_threshold=0.1, window=20, min_accuracy_drop=0.03))
  c.placement = placement_config()
  c.distributed = distributed_section()
  return c


# ----------------------------------------------------------------------------- prompts


class PromptStream:
  """B prompt records per step from a list, reshuffled each epoch from (seed, epoch); its
  position is checkpointed beside the train state, so a resumed run sees the same prompts."""

  def __init__(self, records: list[dict], batch: int, seed: int, extras: dict | None = None,
               learner_state: dict | None = None):
    if not records:
      raise ConfigError("the RL prompt set is empty: set data.task or data.train_file.")
    self.records, self.batch, self.seed = records, batch, seed
    self.epoch, self.pos = 0, 0
    # Host-side state that must resume with the prompts: objects with get_state()/set_state(),
    # checkpointed under their names. `extras` are what scoring updates (the reward models'
    # running normaliser), which async generation does in the background: saved as of the last
    # mark(). `learner_state` is what only the learner's own step changes (the KL coefficient,
    # the alarms' history): saved as it is when the checkpoint is written.
    self.extras = dict(extras or {})
    self.learner_state = dict(learner_state or {})
    self._marked: dict | None = None  # the extras' state at the last mark()

  def _order(self):
    return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.records))

  def __iter__(self):
    return self

  def __next__(self) -> list[dict]:
    out = []
    while len(out) < self.batch:
      order = self._order()
      take = order[self.pos:self.pos + self.batch - len(out)]
      out += [self.records[i] for i in take]
      self.pos += len(take)
      if self.pos >= len(self.records):
        self.epoch, self.pos = self.epoch + 1, 0
    return out

  def peek(self) -> list[dict]:
    """The batch the next `next()` returns, without advancing (async generation starts on it
    one step early). Only the position is rewound; the extras are not touched."""
    epoch, pos = self.epoch, self.pos
    try:
      return next(self)
    finally:
      self.epoch, self.pos = epoch, pos

  def mark(self) -> None:
    """Records the extras' state now; get_state() returns it until the next mark. With async
    generation, step k+1's rollout is scored (updating e.g. the RM normaliser) in the
    background while step k is checkpointed. Marking before it starts keeps that checkpoint to
    what steps <= k put in: a resumed run, which scores step k+1 again, counts it once, and a
    save never reads a half-updated state."""
    self._marked = {k: copy.deepcopy(v.get_state()) for k, v in self.extras.items()}

  def get_state(self) -> dict:
    extras = (self._marked if self._marked is not None
              else {k: v.get_state() for k, v in self.extras.items()})
    return {"epoch": self.epoch, "pos": self.pos, **extras,
            **{k: v.get_state() for k, v in self.learner_state.items()}}

  def set_state(self, state: dict) -> None:
    self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
    # A key missing from an older checkpoint leaves that state as configured.
    for k, v in {**self.extras, **self.learner_state}.items():
      if k in state:
        v.set_state(state[k])
    self.mark()


# ----------------------------------------------------------------------------- the batch


def learner_batch(rollout, *, length: int, pad_id: int) -> dict[str, np.ndarray]:
  """Rollout -> next-token arrays over prompt + completion, right-padded to `length` + 1.

  Row s is prompt s's tokens then its completion's. Target index t predicts token t+1, so the
  completion's first token is the target at index len(prompt) - 1. `mask` marks completion
  targets; `sampler_logp` is the sampler's log-prob of each such target.
  """
  N = rollout.completion_ids.shape[0]
  seq = np.full((N, length + 1), pad_id, np.int32)
  mask = np.zeros((N, length), np.float32)
  sampler_logp = np.zeros((N, length), np.float32)
  for s in range(N):
    p = int(rollout.prompt_lengths[s])
    c = int(rollout.lengths[s])
    seq[s, :p] = rollout.prompt_ids[s, :p]
    seq[s, p:p + c] = rollout.completion_ids[s, :c]
    mask[s, p - 1:p - 1 + c] = 1.0
    sampler_logp[s, p - 1:p - 1 + c] = rollout.logprobs[s, :c]
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (N, length))
  return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "positions": np.array(positions),
          "mask": mask, "sampler_logp": sampler_logp}


def grouped_learner_batch(rollout, *, prompt_len: int, group: int, pad_id: int,
                          width: int | None = None) -> dict[str, np.ndarray]:
  """Rollout -> the shared-prompt form: each group's prompt once, its G completions after it.

  prompt [P, prompt_len] right-padded, prompt_len [P, 1], completion [N, Tc] (the targets:
  index t holds completion token t), and mask / sampler_logp [N, Tc] on the completion's own
  index (see Transformer.grouped_hidden). Rows p*G .. p*G+G-1 must share prompt p. Tc is
  `width` (completions right-padded to it, masked out; see completion_width), or the
  rollout's longest completion.
  """
  N, Tc = rollout.completion_ids.shape
  if width is not None:
    if width < Tc:
      raise ValueError(f"grouped_learner_batch: width={width} is shorter than the rollout's "
                       f"longest completion ({Tc} tokens)")
    pad = ((0, 0), (0, width - Tc))
    rollout = dataclasses.replace(
        rollout, completion_ids=np.pad(rollout.completion_ids, pad, constant_values=pad_id),
        logprobs=np.pad(rollout.logprobs, pad))
    Tc = width
  P = N // group
  first = np.arange(P) * group
  if not all((rollout.prompt_index[first[p]:first[p] + group] ==
              rollout.prompt_index[first[p]]).all() for p in range(P)):
    raise ValueError("grouped_learner_batch: each group's rows must share one prompt")
  prompt = np.full((P, prompt_len), pad_id, np.int32)
  lengths = rollout.prompt_lengths[first].astype(np.int32)
  for p in range(P):
    prompt[p, :lengths[p]] = rollout.prompt_ids[first[p], :lengths[p]]
  mask = (np.arange(Tc)[None, :] < rollout.lengths[:, None]).astype(np.float32)
  completion = np.where(mask > 0, rollout.completion_ids, pad_id).astype(np.int32)
  return {"prompt": prompt, "prompt_len": lengths[:, None], "completion": completion,
          "mask": mask, "sampler_logp": (rollout.logprobs * mask).astype(np.float32)}


def completion_width(longest: int, max_new_tokens: int) -> int:
  """The completion width of a shared-prompt learner batch: the power of two >= the rollout's
  longest completion (at least 16), capped at rollout.max_new_tokens. The learner's jits
  compile once per width, so a run compiles them at most log2(max_new_tokens / 16) + 1 times
  instead of once per new longest length (each ~10 s for the demo's reference forward and
  update on 8 CPU devices), at the cost of computing up to twice the completion positions."""
  return max(min(bucket(longest, minimum=16), max_new_tokens), longest)


def batch_logprobs(graphdef, params, batch, temperature: float):
  """(log-probs, entropy) of a learner batch's targets, in either form: grouped_learner_batch's
  (each prompt once; [N, Tc] on the completion's own index) or learner_batch's joined rows."""
  if "prompt" in batch:
    model = nnx.merge(graphdef, params)
    h = model.grouped_hidden(batch["prompt"], batch["prompt_len"][:, 0], batch["completion"])
    return token_logprobs(model.logits(h), batch["completion"], temperature=temperature)
  logits, _ = apply(graphdef, params, batch["inputs"], batch["positions"])
  return token_logprobs(logits, batch["targets"], temperature=temperature)


def make_batch_logprobs_fn(graphdef, temperature: float, *, mesh: Mesh | None = None,
                           entropy: bool = True):
  """Jitted (params, learner batch of either form) -> (log-probs, entropy), compiled with the
  learner's CPU dot kernels for `mesh`'s devices (jaxrl.parallel.cpu_kernels). entropy=False
  returns (log-probs, None) and skips the entropy's pass over the vocabulary (the reference
  forward's case: nothing reads the reference's entropy)."""
  def logprobs(params, batch):
    logp, ent = batch_logprobs(graphdef, params, batch, temperature)
    return logp, ent if entropy else None

  if mesh is None:
    return jax.jit(logprobs, compiler_options=learner_compiler_options(jax.devices()))
  return jax.jit(shard_activations(logprobs, mesh),
                 compiler_options=learner_compiler_options(mesh.devices.flat))


def make_logprobs_fn(graphdef, temperature: float):
  """Jitted (params, inputs, targets, positions) -> (log-probs, entropy) of the targets."""
  fn = make_batch_logprobs_fn(graphdef, temperature)
  return lambda params, inputs, targets, positions: fn(
      params, {"inputs": inputs, "targets": targets, "positions": positions})


def grpo_loss(graphdef, a, *, temperature: float, norm_len: int):
  """loss_fn for the shared train step: (sum, (weight, metric sums)) of the per-token loss
  pg + beta * KL - entropy_coef * entropy, aggregated by `a.aggregation`. Metrics (KL,
  entropy, clip fractions) are aggregated the same way as the loss.

  The truncated-IS weights come from the old and the sampler's log-probs
  (batch["sampler_logp"]). Without batch["old_logp"] (one update per step), the old log-probs
  are this forward's own under stop_gradient; the sums "is_ratio_tokens" and
  "entropy_tokens" over "tokens" then give is_ratio/mean and the entropy as token means
  whatever the aggregation."""
  def loss_fn(params, batch, key):
    del key
    logp, entropy = batch_logprobs(graphdef, params, batch, temperature)
    mask = batch["mask"]
    old_logp = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
    log_ratio = jnp.where(mask > 0, old_logp - batch["sampler_logp"], 0.0)
    tis = (jnp.minimum(jnp.exp(log_ratio), a.tis_cap) if a.tis_cap > 0
           else jnp.ones_like(log_ratio))
    extra = {} if "old_logp" in batch else {
        "is_ratio_tokens": jnp.sum(jnp.exp(log_ratio) * mask),
        "entropy_tokens": jnp.sum(jax.lax.stop_gradient(entropy) * mask),
        "tokens": jnp.sum(mask)}
    pg, low, high = losses.clipped_pg_loss(
        logp=logp, old_logp=old_logp, adv=batch["adv"], mask=mask,
        eps_low=a.eps_low, eps_high=a.eps_high,
        dual_clip_c=a.dual_clip_c if a.dual_clip_c > 1 else None, ratio_level=a.ratio_level)
    per_token = pg * tis
    kl = losses.kl_penalty(logp=logp, ref_logp=batch["ref_logp"], estimator=a.kl_estimator,
                           clamp=a.kl_clamp or None)
    if a.kl_in == "loss":
      per_token = per_token + batch["beta"] * kl
    per_token = per_token - a.entropy_coef * entropy

    def agg(x):
      return losses.aggregate_sums(x, mask, mode=a.aggregation, norm_len=norm_len)

    loss_sum, weight = agg(per_token)
    sums = {"kl": agg(kl)[0], "entropy": agg(entropy)[0],
            "clipfrac/low": agg(low.astype(jnp.float32))[0],
            "clipfrac/high": agg(high.astype(jnp.float32))[0], **extra}
    return loss_sum, (weight, sums)
  return loss_fn


# ----------------------------------------------------------------------------- rewards


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
    return []  # a reward model alone (run() checks that one is configured)
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


# ----------------------------------------------------------------------------- KL coefficient


class KLCoefficient:
  """beta, the KL penalty's weight: fixed (algo.beta), or moved after every step toward
  algo.kl_target by the adaptive controller (losses.adaptive_kl_beta). Host state, checkpointed
  with the prompts' position, so a resumed run continues from the beta it had reached."""

  def __init__(self, value: float):
    self.value = float(value)

  def get_state(self) -> dict:
    return {"value": self.value}

  def set_state(self, state: dict) -> None:
    self.value = float(state["value"])


# ----------------------------------------------------------------------------- alarms


class Alarms:
  """KL past a threshold, and reward rising while held-out accuracy falls (reward hacking)."""

  def __init__(self, *, kl_threshold: float, window: int, out, min_drop: float = 0.03,
               reward_key: str = "reward/mean"):
    self.kl_threshold, self.window, self.out = kl_threshold, window, out
    # The proxy being optimised: reward/mean, or the raw reward-model score (reward/rm_mean),
    # which a running normalisation would otherwise hide.
    self.reward_key = reward_key
    # Held-out accuracy on a few hundred prompts moves by a point or two between evals by chance;
    # only a larger fall while the reward rises counts as hacking.
    self.min_drop = min_drop
    self.rewards: collections.deque = collections.deque(maxlen=window)
    self.evals: list[tuple[int, float, float]] = []  # (step, mean reward since last, accuracy)
    self.raised = {"kl": 0, "reward_hacking": 0}
    self.kl_max: float | None = None  # over every step of the run, logged or not

  def get_state(self) -> dict:
    """What a resumed run needs to raise the same alarms and report the same kl/max."""
    return {"rewards": list(self.rewards), "evals": [list(e) for e in self.evals],
            "raised": dict(self.raised), "kl_max": self.kl_max}

  def set_state(self, state: dict) -> None:
    self.rewards = collections.deque(state["rewards"], maxlen=self.window)
    self.evals = [tuple(e) for e in state["evals"]]
    self.raised = {**self.raised, **state["raised"]}
    self.kl_max = state["kl_max"]

  def on_step(self, step: int, metrics: dict) -> dict:
    self.rewards.append(metrics[self.reward_key])
    if "kl" in metrics:
      kl = float(metrics["kl"])
      self.kl_max = kl if self.kl_max is None else max(self.kl_max, kl)
    if self.evals and self.evals[-1][1] is None:
      # The baseline eval came before any step; step 1's rollouts come from that same starting
      # policy, so its reward is the baseline's.
      self.evals[-1] = (self.evals[-1][0], metrics[self.reward_key], self.evals[-1][2])
    if metrics.get("kl", 0.0) > self.kl_threshold:
      self.raised["kl"] += 1
      self.out(f"ALARM step {step}: kl={metrics['kl']:.4f} > {self.kl_threshold} (the policy is "
               "drifting from the reference: raise algo.beta or lower optim.lr)")
      return {"alarm/kl": 1.0}
    return {"alarm/kl": 0.0}

  def on_eval(self, step: int, accuracy: float) -> dict:
    # Before any step (the baseline eval) the reward is not known yet: the next on_step fills
    # it in (never 0.0, which a negative reward-model score would "rise" from by construction).
    reward = float(np.mean(self.rewards)) if self.rewards else None
    self.evals.append((step, reward, accuracy))
    # Compare with the latest eval at least `window` steps back (the first one until then), not
    # just the previous one: evals every 10 steps of a slow slide (0.766 -> 0.762 -> 0.742 ->
    # 0.723 -> 0.699 against a biased reward model) never fell 0.03 between neighbours.
    earlier = [e for e in self.evals[:-1] if e[0] <= step - self.window] or self.evals[:1]
    if len(self.evals) >= 2 and earlier[-1][1] is not None:
      (_, r0, a0), (_, r1, a1) = earlier[-1], self.evals[-1]
      if r1 > r0 and a1 < a0 - self.min_drop:
        self.raised["reward_hacking"] += 1
        self.out(f"ALARM step {step}: reward rose {r0:.3f} -> {r1:.3f} while held-out accuracy "
                 f"fell {a0:.3f} -> {a1:.3f} (reward hacking?)")
        return {"alarm/reward_hacking": 1.0}
    return {"alarm/reward_hacking": 0.0}


# ----------------------------------------------------------------------------- the trainer


def _records(config, task):
  d = config.data
  if d.train_file:
    train, _ = read_jsonl(d.train_file, "rl", on_bad_row=d.on_bad_row)
  elif task is not None:
    train = task.records("train", d.train_examples, config.seed)
  else:
    raise ConfigError("data.task and data.train_file are both empty: set data.task to a "
                      "built-in task or data.train_file to a JSONL of {prompt, answer}.")
  if d.eval_file:
    held_out, _ = read_jsonl(d.eval_file, "rl", on_bad_row=d.on_bad_row)
  elif task is not None:
    held_out = task.records("test", config.eval.examples, config.seed + 1)
  else:
    held_out = []
  return train, held_out


def run(config, workdir: str, *, out=print) -> dict:
  """Trains (or resumes) the GRPO run in `workdir`; returns the summary."""
  main, cfg, run_dir, tokenizer = start_run(config, workdir, out=out, choices=CHOICES)
  placement = make_placement(config.mesh, config.placement)
  mesh = placement.learner.mesh
  a, r = config.algo, config.rollout

  task = None
  if config.data.task:
    from jaxrl.tasks import get_task
    task = get_task(config.data.task)
  if r.async_generation and config.placement.mode != "disaggregated":
    raise ConfigError("rollout.async_generation=True needs placement.mode=disaggregated (the "
                      "sampler overlaps the update on its own devices): set both, or turn "
                      "async_generation off.")
  if r.async_generation and a.filter_zero_std:
    raise ConfigError("rollout.async_generation=True cannot refill groups "
                      "(algo.filter_zero_std=True) yet: turn one of them off.")
  train_records, held_out = _records(config, task)
  specs = reward_specs(config.rewards, task, config.get("reward_kwargs"))
  rm_cfg = config.reward_model
  rm_paths = rm_lib.checkpoint_list(rm_cfg)
  if not specs and not rm_paths:
    raise ConfigError(f"rewards={config.rewards!r} and reward_model.checkpoints is empty: "
                      "nothing rewards the policy; name a reward (e.g. task) or a `jaxrl rm` "
                      "run dir.")
  if rm_cfg.k < 0:
    raise ConfigError(f"reward_model.k={rm_cfg.k} is negative: mean_minus_std subtracts k "
                      "standard deviations; use k >= 0.")

  # Models: the policy (trained) and its frozen reference, both in the learner layout.
  tx, schedule = make_optimizer(config.optim, config.train.steps * a.num_iterations *
                                a.minibatches)
  graphdef, state, shardings = init_train_state(cfg, mesh, tx, seed=config.seed)
  state = start_from_hf(config, state, mesh)  # an SFT checkpoint, if given, comes next
  if config.init.checkpoint:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), state.params)
    state = state.replace(params=restore_params(config.init.checkpoint, abstract))
  # The reference is the starting policy, rebuilt from the same source on resume (never saved).
  reference = jax.tree.map(jnp.copy, state.params)
  # Reward models: frozen `jaxrl rm` runs in the learner layout, beside the reference.
  rms = rm_lib.RewardModels.load(rm_paths, mesh, tokenizer) if rm_paths else None
  rm_norm = (rm_lib.RunningNorm(len(rm_paths)) if rms is not None and rm_cfg.normalize
             else None)

  # Sampler: the engine on the sampler mesh, fed by a timed weight sync every step.
  sampling = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                            max_new_tokens=r.max_new_tokens,
                            eos_id=None if r.ignore_eos else tokenizer.eos_id)
  engine = Engine(graphdef, cfg, placement.sampler.mesh, sampling=sampling)
  weight_sync = WeightSync(cfg, placement, dtype=config.placement.sync_dtype or None)
  sampler_copy = SamplerCopy(weight_sync)

  prompt_len = bucket(max(len(tokenizer.encode(x["prompt"], bos=True))
                          for x in train_records + held_out))
  length = prompt_len + r.max_new_tokens  # fixed, so the learner's jits compile once
  N = r.prompts_per_step * r.group_size
  replicas = mesh.shape["data"] * mesh.shape["fsdp"]
  accum = config.optim.accum_steps
  split = a.minibatches * replicas * accum  # rows of one micro-batch on one device: N / split
  if accum < 1 or N % split:
    raise ConfigError(
        f"rollout.prompts_per_step x rollout.group_size = {N} is not divisible by "
        f"algo.minibatches x replicas x optim.accum_steps = {a.minibatches} x {replicas} x "
        f"{accum}: adjust them.")
  # Micro-batches of the shared-prompt form hold whole groups (make_train_step's units).
  grouped = bool(a.shared_prompt_forward) and r.prompts_per_step % split == 0
  if a.shared_prompt_forward and not grouped:
    out(f"shared-prompt forward off: rollout.prompts_per_step={r.prompts_per_step} is not "
        f"divisible by algo.minibatches x replicas x optim.accum_steps = {split}, so each "
        f"completion runs with its own copy of its prompt")
  shd = batch_sharding(mesh, 2, "learner")
  loss_fn = grpo_loss(graphdef, a, temperature=r.temperature, norm_len=r.max_new_tokens)
  # One update per step with KL in the loss: the update's forward gives the old log-probs.
  fused_old = (a.old_logp_from_update and a.num_iterations * a.minibatches == 1
               and a.kl_in == "loss")
  # The reference's forward and, without fused_old, the policy's (whose entropy is logged).
  logprobs_fn = make_batch_logprobs_fn(graphdef, r.temperature, mesh=mesh,
                                       entropy=not fused_old)
  update = make_train_step(loss_fn, tx, schedule, shardings, shd, mesh=mesh, accum_steps=accum)
  beta = KLCoefficient(a.beta)
  alarms = Alarms(kl_threshold=config.alarm.kl_threshold, window=config.alarm.window, out=out,
                  min_drop=config.alarm.min_accuracy_drop,
                  reward_key="reward/rm_mean" if rms is not None else "reward/mean")
  stream = PromptStream(train_records, r.prompts_per_step, config.seed,
                        extras={"rm_norm": rm_norm} if rm_norm is not None else None,
                        learner_state={"kl_coef": beta, "alarms": alarms})
  ckpt = Checkpointer(run_dir.checkpoints, keep=config.train.keep_checkpoints,
                      async_save=config.train.async_checkpoints)
  state, start = resume(ckpt, state, shardings, stream, run_dir, out=out,
                        updates_per_step=a.num_iterations * a.minibatches)
  exact = (ExactMatch(graphdef, cfg, mesh, tokenizer, held_out, task.check,
                      batch=config.eval.batch_size, max_new=r.max_new_tokens)
           if held_out and task is not None else None)

  def put(rows, sharding=shd):
    # Every process holds the whole batch (the rollout and its scores are the same on all of
    # them, see to_host); each takes its own shards of it.
    return {k: global_array(np.asarray(v), sharding) for k, v in rows.items()}

  def rm_rewards(rollout):
    """weight x the reward models' combined score [N] (each RM normalised first, when asked),
    and stats; the combined raw score is logged as reward/rm_mean, the proxy the alarm
    watches."""
    tokens, positions, last, logp_mask = rm_lib.completion_inputs(
        rollout, length=length, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
    dev = put({"tokens": tokens, "positions": positions, "logp_mask": logp_mask})
    scores_mn = rms.score(dev["tokens"], dev["positions"],
                          put({"last": last}, batch_sharding(mesh, 1, "learner"))["last"],
                          dev["logp_mask"])
    scores_mn = to_host(scores_mn)  # every process scores every row (see to_host)
    raw = np.asarray(rm_lib.ensemble(scores_mn, mode=rm_cfg.ensemble, k=rm_cfg.k))
    value = raw if rm_norm is None else np.asarray(rm_lib.ensemble(
        rm_norm.normalize(scores_mn), mode=rm_cfg.ensemble, k=rm_cfg.k))
    stats = {"reward/rm_mean": float(raw.mean()), "reward/rm_std": float(raw.std())}
    if len(scores_mn) > 1:
      stats.update({f"reward/rm_{i}": float(x.mean()) for i, x in enumerate(scores_mn)})
    return float(rm_cfg.weight) * value, stats

  def sample(params, prompts, step, round_):
    ids = [tokenizer.encode(x["prompt"], bos=True) for x in prompts]
    seed = int(jax.random.randint(jax.random.fold_in(jax.random.key(config.seed),
                                                     step * 16 + round_), (), 0, 2**31 - 1))
    rollout = generate(engine, params, ids, n=r.group_size, seed=seed, slots=r.slots,
                       steps_per_call=r.steps_per_call, max_prompt_len=prompt_len,
                       grow_cache=r.grow_cache,
                       pad_id=tokenizer.pad_id)
    texts = [tokenizer.decode(row[:n]) for row, n in zip(rollout.completion_ids,
                                                           rollout.lengths)]
    fields = {k: [prompts[i // r.group_size].get(k) for i in range(len(texts))]
              for k in prompts[0]}
    fields["completion_length"] = [int(n) for n in rollout.lengths]
    t0 = time.perf_counter()
    rewards, reward_stats = score(specs, texts, fields, normalize=config.normalize_rewards)
    if task is not None and f"reward/task_{task.name}" not in reward_stats:
      # The task's checker is not a reward here, but train accuracy is still worth logging.
      reward_stats["accuracy"] = float(np.mean([task.check(c, a) for c, a in
                                                zip(texts, fields["answer"])]))
    if rms is not None:
      t1 = time.perf_counter()
      rm_values, rm_stats = rm_rewards(rollout)
      rewards = rewards + rm_values
      reward_stats.update(rm_stats, **{"timing_s/reward_model": time.perf_counter() - t1})
    reward_stats["timing_s/reward"] = time.perf_counter() - t0
    return rollout, rewards, reward_stats

  def generate_and_score(params_s, prompts, step):
    """Steps 2-3: sample and score, refilling zero-variance groups when asked."""
    t0 = time.perf_counter()
    flops = []  # the model FLOPs of every rollout sampled, refills included

    def sample_counted(batch_prompts, round_):
      ro, rw, st = sample(params_s, batch_prompts, step, round_)
      flops.append(rollout_flops(cfg, ro))
      return ro, rw, st

    rollout, rewards, reward_stats = sample_counted(prompts, 0)
    rewards_bg = rewards.reshape(-1, r.group_size)
    zero = np.asarray(adv_lib.zero_std_groups(rewards_bg=rewards_bg))
    frac_zero = float(zero.mean())
    gen_stats = rollout_metrics(rollout)
    if a.filter_zero_std and zero.any():
      rollout, rewards_bg = _refill(rollout, rewards_bg, zero, sample_counted, stream,
                                    a.max_refill_rounds, r.group_size)
    t_gen = time.perf_counter() - t0 - reward_stats["timing_s/reward"]
    gen_stats["perf/tflops/gen"] = sum(flops) / max(t_gen, 1e-9) / 1e12
    return rollout, rewards_bg, reward_stats, gen_stats, frac_zero, t_gen

  # Async generation: the rollout for the next step's prompts, started during this step's
  # update on the sampler's own devices with this step's pre-update weights.
  overlap = Overlap() if r.async_generation else None
  pending = {}  # {"prompts", "future"}

  def step_fn(state, prompts):
    t_step = time.perf_counter()
    step = int(jax.device_get(state.step)) // (a.num_iterations * a.minibatches)
    params_s = None
    if pending and pending["prompts"] == prompts:
      # 1-3 ran in the background during the previous step's update (params one step old).
      t0 = time.perf_counter()
      version, generated = pending.pop("future").result()
      t_wait = time.perf_counter() - t0
    else:  # synchronous, or the first step of an async run (or after a resume)
      pending.clear()
      params_s = sampler_copy.refresh(state.params)  # 1
      generated = generate_and_score(params_s, prompts, step)  # 2-3
      version, t_wait = step, generated[-1]
    rollout, rewards_bg, reward_stats, gen_stats, frac_zero, t_gen = generated
    stream.mark()  # the host state as of this step's scoring, before step k+1's starts
    if overlap is not None:
      # Start the next step's generation now, so that it overlaps this step's update.
      next_prompts = stream.peek()
      if params_s is None:
        params_s = sampler_copy.refresh(state.params)
      pending.update(prompts=next_prompts, future=overlap.submit(
          generate_and_score, params_s, next_prompts, step + 1, version=step))
    else:
      sampler_copy.before_update()  # colocated: its memory goes to the update
    # 4. reference and old log-probs
    if grouped:
      batch = grouped_learner_batch(
          rollout, prompt_len=prompt_len, group=r.group_size, pad_id=tokenizer.pad_id,
          width=completion_width(rollout.completion_ids.shape[1], r.max_new_tokens))
      inputs = ("prompt", "prompt_len", "completion")
    else:
      batch = learner_batch(rollout, length=length, pad_id=tokenizer.pad_id)
      inputs = ("inputs", "targets", "positions")
    if a.mask_truncated:
      truncated = np.array([x == "length" for x in rollout.finish_reasons])
      batch["mask"][truncated] = 0.0
    dev = put({k: batch[k] for k in inputs})

    def forward(params):
      return logprobs_fn(params, dev)

    t_score, old = 0.0, {}
    if not fused_old:
      t0 = time.perf_counter()
      old_logp, entropy = jax.block_until_ready(forward(state.params))
      t_score = time.perf_counter() - t0
      old_np, entropy = to_host((old_logp, entropy))
    t0 = time.perf_counter()
    ref_logp, _ = jax.block_until_ready(forward(reference))
    t_ref = time.perf_counter() - t0
    ref_np = to_host(ref_logp)
    mask = batch["mask"]
    # 5. advantages (KL in the reward shapes them when kl_in == "reward")
    seq_rewards = rewards_bg.reshape(-1)
    if a.kl_in == "reward":
      kl_tok = np.asarray(losses.kl_penalty(logp=old_np, ref_logp=ref_np,
                                            estimator=a.kl_estimator,
                                            clamp=a.kl_clamp or None))
      seq_rewards = np.asarray(losses.kl_in_reward(rewards_b=seq_rewards, kl_bt=kl_tok,
                                                   mask_bt=mask, beta=beta.value))
    adv = np.asarray(adv_lib.compute(a.advantage, rewards_bg=seq_rewards.reshape(
        -1, r.group_size), clip=a.adv_clip or None)).reshape(-1)
    # Truncated-IS weights are computed in the loss (grpo_loss); with fused_old the update's
    # own forward also gives the old log-probs.
    old = {} if fused_old else {"old_logp": old_np.astype(np.float32)}
    full = {**{k: batch[k] for k in inputs + ("mask", "sampler_logp")}, **old,
            "ref_logp": ref_np.astype(np.float32),
            "adv": np.broadcast_to(adv[:, None], mask.shape).astype(np.float32),
            "beta": np.full(mask.shape, beta.value, np.float32)}
    # 6. num_iterations x minibatches updates
    t0 = time.perf_counter()
    rng = np.random.default_rng([config.seed, step])
    upd = []
    for _ in range(a.num_iterations):
      if grouped:  # minibatches of whole groups: their prompt rows and their G rows each
        G = r.group_size
        for groups in np.array_split(rng.permutation(N // G), a.minibatches):
          rows = (groups[:, None] * G + np.arange(G)).reshape(-1)
          mb = {k: v[groups] if k in ("prompt", "prompt_len") else v[rows]
                for k, v in full.items()}
          state, m = update(state, put(mb))
          upd.append(m)
      else:
        for mb in np.array_split(rng.permutation(N), a.minibatches):
          state, m = update(state, put({k: v[mb] for k, v in full.items()}))
          upd.append(m)
    upd = to_host(upd)
    t_update = time.perf_counter() - t0
    if a.kl_target > 0:
      beta.value = losses.adaptive_kl_beta(beta.value,
                                           kl=float(np.mean([u["kl"] for u in upd])),
                                           target=a.kl_target, horizon=a.kl_horizon,
                                           n_steps=N)
    n_tok = max(mask.sum(), 1.0)
    # Model FLOPs of one learner forward over this batch (jaxrl.models.flops); a backward
    # costs two forwards.
    fwd_flops = rollout_flops(cfg, rollout, share_prompt=grouped)
    metrics = {
        "loss": float(np.mean([u["loss"] for u in upd])),
        "grad_norm": float(np.mean([u["grad_norm"] for u in upd])),
        "lr": float(upd[-1]["lr"]),
        "kl": float(np.mean([u["kl"] for u in upd])),
        "entropy": (float(upd[0]["entropy_tokens"] / max(upd[0]["tokens"], 1e-9)) if fused_old
                    else float((np.asarray(entropy) * mask).sum() / n_tok)),
        "clipfrac/low": float(np.mean([u["clipfrac/low"] for u in upd])),
        "clipfrac/high": float(np.mean([u["clipfrac/high"] for u in upd])),
        "reward/mean": float(rewards_bg.mean()), "reward/std": float(rewards_bg.std()),
        "accuracy": reward_stats.get(f"reward/task_{task.name}",
                                     reward_stats.get("accuracy", float("nan")))
        if task is not None else float("nan"),
        "frac_zero_std_groups": frac_zero,
        "is_ratio/mean": (float(upd[0]["is_ratio_tokens"] / max(upd[0]["tokens"], 1e-9))
                          if fused_old else float((np.exp(np.where(
                              mask > 0, old_np - batch["sampler_logp"], 0.0)) * mask).sum()
                                                  / n_tok)),
        "staleness/mean": float(step - version),
        "kl/beta": beta.value,
        # gen: the rollout's own wall time; gen_wait: what the learner waited for it (less
        # than gen when generation overlapped the previous update).
        "timing_s/gen": t_gen, "timing_s/gen_wait": t_wait,
        "timing_s/score": t_score + reward_stats["timing_s/reward"],
        "timing_s/ref": t_ref, "timing_s/update": t_update,
        "timing_s/sync": weight_sync.last.ms / 1e3,
        "perf/tflops/ref": fwd_flops / max(t_ref, 1e-9) / 1e12,
        "perf/tflops/update": 3 * a.num_iterations * fwd_flops / max(t_update, 1e-9) / 1e12,
        **weight_sync.last.metrics(), **gen_stats, **reward_stats,
    }
    step_s = time.perf_counter() - t_step
    metrics["timing_s/step_wall"] = step_s
    metrics["perf/gen_fraction"] = t_wait / step_s
    metrics.update(alarms.on_step(step + 1, metrics))
    return state, metrics

  def evaluate(params, step):
    if exact is None:
      return {}
    m = exact(params)
    m.update(alarms.on_eval(step, m["eval/accuracy"]))
    return m

  total = config.train.steps
  if main and start == 0:
    out(f"grpo: {cfg.num_params:,} parameters, {len(train_records)} prompts, "
        f"{r.prompts_per_step} x {r.group_size} samples per step, {config.train.steps} steps; "
        f"placement {placement.mode}")
  try:
    summary = train_loop(
        state=state, step_fn=step_fn, batches=stream, put=lambda b: b, total_steps=total,
        run=run_dir, ckpt=ckpt, log_every=config.train.log_every,
        save_every=config.train.save_every, eval_every=config.eval.every, eval_fn=evaluate,
        out=out, updates_per_step=a.num_iterations * a.minibatches,
        summary_extra=lambda: {"alarms": dict(alarms.raised), "kl/max": alarms.kl_max})
  finally:
    if overlap is not None:
      overlap.close()
    ckpt.close()
    run_dir.close()
  return summary


def _refill(rollout, rewards_bg, zero, sample, stream, rounds: int, G: int):
  """Dynamic sampling (DAPO): replaces all-equal groups with groups sampled for fresh prompts,
  up to `rounds` extra rounds. The group count stays fixed (a group that cannot be replaced
  stays, with zero advantage), so the learner's jits never recompile."""
  B = len(zero)
  parts = [(rollout, rewards_bg, g) for g in np.flatnonzero(~zero)]
  for i in range(1, rounds + 1):
    if len(parts) >= B:
      break
    ro, rw, _ = sample(next(stream), i)
    rw_bg = rw.reshape(-1, G)
    z = np.asarray(adv_lib.zero_std_groups(rewards_bg=rw_bg))
    parts += [(ro, rw_bg, g) for g in np.flatnonzero(~z)]
  parts += [(rollout, rewards_bg, g) for g in np.flatnonzero(zero)]  # fill up, zero advantage
  parts = parts[:B]
  return _concat_groups(parts, G), np.stack([rw[g] for _, rw, g in parts])


def _concat_groups(parts, G: int):
  """A Rollout made of the given (rollout, rewards, group) groups, padded to common widths."""
  rows = [(ro, g * G + j) for ro, _, g in parts for j in range(G)]
  lp = max(ro.prompt_ids.shape[1] for ro, _ in rows)
  lc = max(ro.completion_ids.shape[1] for ro, _ in rows)

  def stack(name, width):
    arrs = [getattr(ro, name)[s] for ro, s in rows]
    out = np.zeros((len(rows), width), arrs[0].dtype)
    for i, a in enumerate(arrs):
      out[i, :len(a)] = a
    return out

  first = rows[0][0]
  return dataclasses.replace(
      first, prompt_ids=stack("prompt_ids", lp), completion_ids=stack("completion_ids", lc),
      completion_mask=stack("completion_mask", lc), logprobs=stack("logprobs", lc),
      prompt_lengths=np.array([ro.prompt_lengths[s] for ro, s in rows]),
      lengths=np.array([ro.lengths[s] for ro, s in rows]),
      finish_reasons=[ro.finish_reasons[s] for ro, s in rows],
      prompt_index=np.arange(len(rows)) // G)
