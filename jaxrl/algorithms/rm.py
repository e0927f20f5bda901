"""Reward-model training on preference pairs: the Bradley-Terry loss over a scalar head.

    jaxrl rm --config configs/rm_tiny.py --config.init.checkpoint=runs/sft_tiny --workdir DIR

Reads top to bottom, like jaxrl/algorithms/sft.py: config -> mesh -> data -> state -> loss ->
eval -> loop (the same loop, checkpoints, resume and metrics). A batch is [B, 2, S] (axis 1:
chosen, rejected); the two rows of a pair sit on one device, and one forward of [2B, S] scores both.

The loss per pair is -log sigmoid(r_c - r_r - margin) (Bradley & Terry 1952; InstructGPT's
reward loss), averaged over the global batch's pairs. Departures, both optional and off by
default: a constant `loss.margin` (Llama 2 uses a per-pair margin from the labeller's rating
gap; the records here carry no rating, so it is one number), and TRL's reward centering,
`loss.center_coef * mean((r_c + r_r)^2)` (Eisenstein et al. 2023), which pins the scores'
mean near zero without changing which response wins.

Eval reports held-out pairwise accuracy (`eval/accuracy`: the share of pairs with r_c > r_r)
and the mean and std of the chosen and rejected rewards and of their margin.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import config as config_lib
from jaxrl.data import ON_BAD_ROW, prefs
from jaxrl.data.prompts import prompt_section
from jaxrl.errors import ConfigError
from jaxrl.models import RewardModel, last_index, lora, reward_apply
from jaxrl.models.flops import packed_flops, train_flops
from jaxrl.parallel import batch_sharding, shard_activations
from jaxrl.parallel.distributed import distributed_section, global_array
from jaxrl.parallel.plan import plan_config
from jaxrl.train import optim
from jaxrl.train.data import check_section as check_data
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.train.run import Run, count_tokens, starting_state
from jaxrl.train.state import make_train_step, put_batch

# This trainer's keys with fixed choices, checked when a run starts (config.validate).
# Sections mapped to a function have their ranges checked there.
CHOICES = {**optim.CHOICES, "data.on_bad_row": ON_BAD_ROW, "data.bias": prefs.BIASES,
           "data": check_data}
PAIR_KEYS = ("inputs", "positions", "segment_ids", "loss_mask")


def default_config():
  """Every field a reward-model run reads, with the defaults configs/rm_tiny.py starts from."""
  c = config_lib.base_config()
  # An SFT run dir (its latest checkpoint's params start the backbone; the head is new). Empty:
  # the preset's random init, or model.hf_path's weights.
  c.init = ml_collections.ConfigDict(dict(checkpoint=""))
  c.data = ml_collections.ConfigDict(dict(
      task="addition",     # built-in task: pairs from jaxrl.data.prefs.task_prefs (chosen: the
                           # correct answer, rejected: a wrong one)
      bias="none",         # task pairs: "longer" = a labeller preferring the longer answer
                           # regardless of correctness (the reward-hacking demonstration)
      bias_rate=1.0,       # the fraction of task pairs the biased labeller decides
      train_file="",       # JSONL of {"prompt","chosen","rejected"} (or chat-message variants):
                           # replaces the task's pairs
      eval_file="",        # JSONL of held-out pairs (default: the task's test split, same bias)
      fields=None,         # source column -> record field, e.g. {"question": "prompt"}:
                           # files may be .jsonl, .parquet, .arrow or a save_to_disk directory
      train_examples=4000,  # task pairs drawn for training (before de-duplication)
      ngram=8,             # decontamination: drop train pairs sharing a word n-gram with an
                           # eval prompt
      seq_len=16,          # tokens per row (bos + prompt + response + eos must fit)
      batch_size=32,       # pairs per global batch (each pair is two rows)
      shards=0,            # data shards (0 = one per process)
      on_bad_row="error",  # or "skip" (counted and reported)
      # chat (None: chat-templated when the tokenizer has a template), chat_template_kwargs,
      # system_prompt: how prompts are rendered, as in SFT, GRPO and sampling
      **prompt_section(),
  ))
  c.head = ml_collections.ConfigDict(dict(
      # Add w * the response's mean log-prob under the backbone's LM head (w learned, from 0)
      # to the last-token score: see jaxrl.models.reward.RewardModel.
      logprob_feature=False,
  ))
  c.loss = ml_collections.ConfigDict(dict(
      margin=0.0,          # -log sigmoid(r_c - r_r - margin): demand a gap of at least this
      center_coef=0.0,     # + center_coef * mean((r_c + r_r)^2), TRL's center_rewards_coefficient
  ))
  c.optim = optim_section(lr=1e-3, warmup_steps=20)
  c.train = ml_collections.ConfigDict(dict(
      steps=300, log_every=25, save_every=100, keep_checkpoints=2, async_checkpoints=True))
  c.eval = ml_collections.ConfigDict(dict(every=100, examples=512, batch_size=64))
  c.distributed = distributed_section()
  c.plan = plan_config()  # the device the trainer's memory plan is checked against
  return c


# ----------------------------------------------------------------------------- the loss


def bradley_terry_loss(*, chosen_b, rejected_b, margin=0.0):
  """-log sigmoid(r_c - r_r - margin) per pair [B]; ln 2 when the scores are equal and the
  margin is zero."""
  return -jax.nn.log_sigmoid(chosen_b - rejected_b - margin)


def center_penalty(*, chosen_b, rejected_b):
  """(r_c + r_r)^2 per pair [B]: zero when a pair's scores are centred on zero. The caller
  averages it and multiplies by the coefficient (TRL: center_rewards_coefficient)."""
  return (chosen_b + rejected_b) ** 2


def pair_scores(graphdef, params, batch):
  """Scores [B, 2] (chosen, rejected) of a [B, 2, S] pair batch, in one forward of [2B, S]."""
  B, _, S = batch["inputs"].shape
  # [B, 2, S] -> [2B, S]: pair b's chosen row is 2b, its rejected row 2b + 1, so a device's
  # pairs stay on it.
  flat = {k: batch[k].reshape(2 * B, S) for k in PAIR_KEYS}
  scores = reward_apply(graphdef, params, flat["inputs"], flat["positions"],
                        last_index(flat["segment_ids"]), segment_ids_bt=flat["segment_ids"],
                        logp_mask_bt=flat["loss_mask"])
  return scores.reshape(B, 2)


def rm_loss(graphdef, *, margin: float = 0.0, center_coef: float = 0.0):
  """loss_fn(params, batch, key) -> (sum over pairs, (pair count, metric sums)); the train step
  divides by the pair count over the whole batch."""
  def loss_fn(params, batch, key):
    del key  # no dropout in these models
    s = pair_scores(graphdef, params, batch)
    c, r = s[:, 0], s[:, 1]
    bt = bradley_terry_loss(chosen_b=c, rejected_b=r, margin=margin)
    center = center_penalty(chosen_b=c, rejected_b=r)
    per_pair = bt + center_coef * center
    sums = {"loss/bt": bt.sum(), "loss/center": center.sum(),
            "accuracy": (c > r).astype(jnp.float32).sum(), "reward_chosen": c.sum(),
            "reward_rejected": r.sum(), "margin": (c - r).sum()}
    return per_pair.sum(), (jnp.asarray(c.shape[0], jnp.float32), sums)
  return loss_fn


# ----------------------------------------------------------------------------- evaluation


def pair_stats(scores_b2: np.ndarray) -> dict[str, float]:
  """Held-out accuracy and reward statistics of scores [B, 2] (chosen, rejected)."""
  c, r = scores_b2[:, 0].astype(np.float64), scores_b2[:, 1].astype(np.float64)
  m = c - r
  return {"eval/accuracy": float(np.mean(c > r)),
          "eval/reward_chosen": float(c.mean()), "eval/reward_chosen_std": float(c.std()),
          "eval/reward_rejected": float(r.mean()), "eval/reward_rejected_std": float(r.std()),
          "eval/margin": float(m.mean()), "eval/margin_std": float(m.std())}


class PairEval:
  """Scores fixed held-out pair batches with one jitted forward: pair_stats, and eval/loss
  (the training objective on the held-out pairs)."""

  def __init__(self, graphdef, mesh, batches, n_pairs: int, *, margin: float,
               center_coef: float):
    self.batches, self.n = batches, n_pairs
    self.margin, self.center_coef = margin, center_coef
    replicated = NamedSharding(mesh, P())
    self.scores = jax.jit(shard_activations(lambda p, b: pair_scores(graphdef, p, b), mesh),
                          out_shardings=replicated)

  def __call__(self, params) -> dict[str, float]:
    if not self.batches:
      return {}
    # The last batch repeats leading pairs to fill it; [:n] drops the repeats.
    s = np.concatenate([np.asarray(self.scores(params, b)) for b in self.batches])[:self.n]
    c, r = s[:, 0], s[:, 1]
    loss = (bradley_terry_loss(chosen_b=c, rejected_b=r, margin=self.margin) +
            self.center_coef * center_penalty(chosen_b=c, rejected_b=r))
    return {**pair_stats(s), "eval/loss": float(np.mean(np.asarray(loss)))}


# ----------------------------------------------------------------------------- data


def _pairs(config):
  """(train records, held-out records, data info for the run dir): read or built, then
  de-duplicated and decontaminated against the held-out prompts, and fingerprinted."""
  d, seed = config.data, config.seed
  if d.bias != "none" and d.train_file:
    raise ConfigError(f"data.bias={d.bias!r} shapes the task's pairs, but data.train_file is "
                      "set: drop one of them.")
  if not 0.0 <= float(d.bias_rate) <= 1.0:
    raise ConfigError(f"data.bias_rate={d.bias_rate!r} is not a fraction: give a value in "
                      "[0, 1].")
  info = {}
  if d.eval_file:
    held_out, skipped = prefs.read_prefs(d.eval_file, on_bad_row=d.on_bad_row,
                                         fields=d.get("fields"))
    info["eval"] = {"source": d.eval_file, "skipped": skipped}
  elif d.task:
    held_out = prefs.task_prefs(d.task, "test", config.eval.examples, seed + 1, bias=d.bias,
                                bias_rate=d.bias_rate)
    info["eval"] = {"source": f"task {d.task} test (bias {d.bias}, rate {d.bias_rate})"}
  else:
    held_out = []
    info["eval"] = {"source": "none"}
  if d.train_file:
    train, skipped = prefs.read_prefs(d.train_file, on_bad_row=d.on_bad_row,
                                      fields=d.get("fields"))
    info["train"] = {"source": d.train_file, "skipped": skipped}
  elif d.task:
    train = prefs.task_prefs(d.task, "train", d.train_examples, seed, bias=d.bias,
                             bias_rate=d.bias_rate)
    info["train"] = {"source": f"task {d.task} train (bias {d.bias}, rate {d.bias_rate})"}
  else:
    raise ConfigError("data.task and data.train_file are both empty: set data.task to a "
                      "built-in task (e.g. addition) or data.train_file to a JSONL of "
                      "{prompt, chosen, rejected}.")
  train, report = prefs.clean_prefs(train, eval_prompts=[x["prompt"] for x in held_out],
                                    ngram=d.ngram)
  if not train:
    raise ConfigError(f"no training pairs are left after cleaning ({report}): give more data.")
  info["train"].update(report=report, fingerprint=prefs.fingerprint(train), pairs=len(train))
  info["eval"].update(fingerprint=prefs.fingerprint(held_out), pairs=len(held_out))
  return train, held_out, info


# ----------------------------------------------------------------------------- the trainer


def init_reward_state(config, mesh, tx, *, layout: str = "learner"):
  """(graphdef, state, shardings) of a reward model, born sharded: the backbone from
  init.checkpoint (an SFT run) or model.hf_path when given, else the preset's init; the head
  always new."""
  model = functools.partial(RewardModel, logprob_feature=bool(config.head.logprob_feature))
  return starting_state(config, config_lib.model_config(config), mesh, tx, layout=layout,
                        model=model, into="backbone")


def run(config, workdir: str, *, out=print) -> dict:
  """Trains (or resumes) the reward-model run in `workdir`; returns the summary. With LoRA
  (model.lora.rank > 0) the backbone's base is frozen: its adapters and the head train."""
  cfg = config_lib.model_config(config)
  if cfg.lora_rank and cfg.lora_dropout:
    raise ConfigError(f"model.lora.dropout={cfg.lora_dropout} is not supported by `jaxrl rm` "
                      "(the reward model's forward takes no dropout key): set "
                      "model.lora.dropout=0.")
  r = Run(config, workdir, out=out, choices=CHOICES, command="rm",
          sections=default_config().keys(), programs=programs)
  d, mesh = config.data, r.mesh

  # Data: pairs, cleaned and fingerprinted; the fingerprint and cleaning report go to
  # DIR/data.json now (beside config.json) and to summary.json at the end.
  train, held_out, info = _pairs(config)
  r.record_data(info["train"]["fingerprint"])
  if r.main:
    with open(r.run_dir.path("data.json"), "w") as f:
      json.dump(info, f, indent=2, sort_keys=True)
    rep = info["train"]["report"]
    out(f"rm data: {info['train']['source']}: read {rep['read']}, duplicates "
        f"{rep['duplicates_exact']} exact + {rep['duplicates_normalized']} normalised, ties "
        f"{rep['ties']}, contaminated {rep['contaminated']}, kept {rep['kept']} "
        f"({info['train']['fingerprint'][:19]}...); held out {len(held_out)} pairs")
  batches = r.batches(prefs.prefs_batches, train)
  shd = batch_sharding(mesh, 3, config.layout)

  # State: the backbone from the SFT run (or preset), a new head; then DIR's latest checkpoint.
  tx, schedule = make_optimizer(config.optim, config.train.steps)
  graphdef, state, shardings = init_reward_state(config, mesh, tx, layout=config.layout)
  margin, center_coef = float(config.loss.margin), float(config.loss.center_coef)
  loss_fn = rm_loss(graphdef, margin=margin, center_coef=center_coef)
  step_fn = make_train_step(loss_fn, tx, schedule, shardings, shd, mesh=mesh,
                            accum_steps=config.optim.accum_steps)
  state = r.resume(state, shardings, batches)

  # Eval: fixed held-out pair batches, every process holding them in full (see sft.py).
  eval_batches = []
  if held_out:
    eval_bs = -(-min(config.eval.batch_size, len(held_out)) // r.replicas) * r.replicas
    rows = list(held_out) + list(held_out[:(-len(held_out)) % eval_bs])  # whole batches
    eval_batches = [{k: global_array(v, shd) for k, v in b.items() if k in PAIR_KEYS}
                    for b in prefs.prefs_batches(
                        rows, r.tokenizer, seq_len=d.seq_len, batch_size=eval_bs, seed=0,
                        shuffle=False, num_epochs=1, on_bad_row=d.on_bad_row, data_cfg=d)]
  evaluate_pairs = PairEval(graphdef, mesh, eval_batches, len(held_out), margin=margin,
                            center_coef=center_coef)

  return r.train(
      state, step_fn, batches, put=lambda b: put_batch({k: b[k] for k in PAIR_KEYS}, shd),
      eval_fn=lambda params, step: evaluate_pairs(params), tokens_fn=count_tokens,
      # The backbone's (the scalar head is D per row); its LM head only for the log-prob
      # feature.
      flops_fn=lambda b: train_flops(r.cfg, packed_flops(
          r.cfg, b, lm_head=bool(config.head.logprob_feature))),
      summary_extra=lambda: {"data": info},
      banner=f"rm: the {r.cfg.num_params:,}-parameter decoder{lora.describe(r.cfg)} + a "
             f"{r.cfg.embed_dim}-wide head, "
             f"{len(train)} train pairs, global batch {d.batch_size} pairs x 2 x {d.seq_len}, "
             f"{config.train.steps} steps; backbone from "
             f"{config.init.checkpoint or 'the preset init'}")


def programs(config, *, devices=None):
  """(Workload, [Program]) of this config's run, abstract (jaxrl.train.programs): the train
  step over one global batch of data.batch_size pairs x 2 x data.seq_len, as run() builds it."""
  from jaxrl.models.flops import forward_flops
  from jaxrl.parallel.plan import Workload
  from jaxrl.train import programs as pg
  cfg, d = config_lib.model_config(config), config.data
  mesh = pg.learner_mesh(config, devices)
  tx, schedule = make_optimizer(config.optim, config.train.steps)
  model = functools.partial(RewardModel, logprob_feature=bool(config.head.logprob_feature))
  graphdef, state, shardings = pg.abstract_state(cfg, mesh, tx, layout=config.layout,
                                                 model=model)
  shd = batch_sharding(mesh, 3, config.layout)
  B, T = d.batch_size, d.seq_len
  batch = {k: pg.spec((B, 2, T), "float32" if k == "loss_mask" else "int32", shd)
           for k in PAIR_KEYS}
  knobs = pg.model_knobs(config)
  def loss(g):
    return rm_loss(g, margin=float(config.loss.margin),
                   center_coef=float(config.loss.center_coef))
  step = pg.train_program(
      loss(graphdef),
      tx, schedule, state, shardings, batch, mesh=mesh, accum_steps=config.optim.accum_steps,
      seq_len=T, vocab=cfg.vocab_size if config.head.logprob_feature else 0,
      logits_chunk=knobs["logits_chunk"], cfg=cfg,
      plain_loss=loss(pg.plain_graphdef(cfg, model)),
      flops=train_flops(cfg, forward_flops(cfg, tokens=2 * B * T, pairs=B * T * (T + 1),
                                           lm_head=bool(config.head.logprob_feature))),
      tokens=2 * B * T)
  replicas = mesh.shape["data"] * mesh.shape["fsdp"]
  work = Workload(rows=max(1, 2 * B // (replicas * config.optim.accum_steps)), seq_len=T,
                  **knobs)
  return work, [step]
