"""Offline preference optimisation (DPO, IPO, cDPO, KTO, ORPO, SimPO) on the shared loop.

    jaxrl dpo --config configs/dpo_tiny.py --workdir DIR          # loss=dpo
    jaxrl dpo --config configs/dpo_tiny.py:kto --workdir DIR      # or ipo, orpo, simpo

Reads top to bottom, as jaxrl/algorithms/sft.py (KTO's rows and the reference cache are in
jaxrl/algorithms/dpo_data.py): config -> mesh -> data -> policy and reference ->
loss -> eval -> loop. No rollouts, no reward model, no resharding: each step is one jitted
forward and backward over a batch of preference pairs.

  * Batches are [B, 2, S] (axis 1: chosen, rejected; a pair's two rows sit on one device) and
    are reshaped to [2B, S] so chosen and rejected go through one forward. KTO trains on
    unpaired rows [N, S] with a label each; paired data is unpaired for it (chosen desirable,
    rejected undesirable), as TRL does.
  * The loss sees per-sequence log-probs (sums over the response tokens and the eos, plus
    token counts) and is one of the pure functions of jaxrl/objectives/preference_losses.py.
  * Reference log-probs (dpo, ipo, kto; orpo and simpo have no reference and build none):
      ref.mode=live    the frozen reference lives on the same mesh, in the learner layout, and
                       a jitted forward scores each batch before the update;
      ref.mode=cached  one pass of the reference over the train and held-out rows before
                       training, cached in DIR/ref_logps.npz (keyed by the data fingerprint,
                       the sequence length and the reference's source, and reused on resume);
                       the reference's memory is free during training. Rows are looked up by a
                       hash of their tokens, so the cache needs no cooperation from the
                       shuffling pipeline;
      ref.mode=auto    cached when the memory plan (jaxrl/parallel/plan.py) says the learner's
                       roles plus a reference copy do not fit the device, else live. The device
                       memory comes from plan.device / plan.device_gib, else from the runtime
                       (TPU/GPU report it); where neither says (CPU), live.
  * Eval: held-out preference accuracy (eval/rewards/accuracies: the implied reward of the
    chosen response beats the rejected one's) with eval/loss and eval/rewards/margins, on
    held-out pairs; and, on a built-in task, the exact match of greedy decoding
    (eval/accuracy), as SFT and GRPO report it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import config as config_lib
from jaxrl.backends import compiler_options
from jaxrl.data import ON_BAD_ROW, prefs
from jaxrl.data.prompts import prompt_section
from jaxrl.errors import ConfigError
from jaxrl.models import apply_logprobs, lora
from jaxrl.models.flops import packed_flops, train_flops
from jaxrl.parallel import batch_sharding, shard_activations
from jaxrl.parallel.distributed import global_array
from jaxrl.objectives import preference_losses as pl
from jaxrl.train.data import answers, check_section as check_data, load_task, records
from jaxrl.algorithms.dpo_data import ROW_KEYS, cached_reference, reference_mode, to_rows
from jaxrl.train.optim import CHOICES as OPTIM_CHOICES, make_optimizer
from jaxrl.train.run import Run, count_tokens
from jaxrl.train.state import make_train_step

REF_MODES = ("live", "cached", "auto")

# This trainer's keys with fixed choices, checked when a run starts (config.validate).
CHOICES = {
    **OPTIM_CHOICES,
    "algo.loss": pl.LOSSES,
    "algo.kto_z0": ("mismatched", "batch"),
    "ref.mode": REF_MODES,
    "data.on_bad_row": ON_BAD_ROW,
    "data.format": ("prefs", "kto"),
    "data.bias": ("none", "longer"),
    "data": check_data,  # the data section's ranges
    "ref": lambda config: config_lib.check_at_least(config, 1, "ref.batch_size"),  # its range
}


def algo_section(**overrides) -> ml_collections.ConfigDict:
  """The loss and its knobs (names as TRL's where TRL has one)."""
  c = ml_collections.ConfigDict(dict(
      loss="dpo",             # dpo | ipo | kto | orpo | simpo
      beta=0.1,               # dpo/ipo/kto: the KL strength (IPO: tau); simpo: reward scale
      label_smoothing=0.0,    # dpo, simpo: > 0 is cDPO (labels flipped with this probability)
      ipo_per_token=True,     # ipo: per-token-averaged log-probs (TRL); False = the paper's sums
      simpo_gamma=0.5,        # simpo: the target reward margin gamma
      orpo_lambda=0.1,        # orpo: weight of the odds-ratio term beside the NLL (TRL's beta)
      kto_desirable_weight=1.0,
      kto_undesirable_weight=1.0,
      kto_z0="mismatched",    # kto reference point: "mismatched" pairs (paper; live ref only)
                              # or "batch" (the batch's own log-ratios; no extra forward)
      nll_coef=0.0,           # dpo, ipo, simpo: + coef * per-token NLL of chosen (RPO)
  ))
  c.update(overrides)
  return c


def default_config():
  """Every field a preference run reads, with the defaults configs/dpo_tiny.py starts from."""
  from jaxrl.parallel.distributed import distributed_section
  from jaxrl.parallel.plan import plan_config
  from jaxrl.train.optim import optim_section
  c = config_lib.base_config()
  c.init = ml_collections.ConfigDict(dict(checkpoint=""))  # an SFT run dir to start from
  c.data = ml_collections.ConfigDict(dict(
      task="addition",     # built-in task: preference pairs (chosen right, rejected wrong),
                           # held-out pairs and greedy exact match
      train_file="",       # JSONL of {"prompt","chosen","rejected"} (or the chat variant);
                           # with format=kto, of {"prompt","completion","label"}
      eval_file="",        # held-out pairs (default: the task's test split)
      fields=None,         # source column -> record field, e.g. {"question": "prompt"}:
                           # files may be .jsonl, .parquet, .arrow or a save_to_disk directory
      format="prefs",      # prefs | kto: what train_file holds (kto needs algo.loss=kto)
      train_examples=4096,  # task pairs to draw
      bias="none",         # task pairs: "longer" = a labeller preferring longer wrong answers
      bias_rate=1.0,       # fraction of pairs the biased labeller decides
      decontaminate=True,  # drop train rows sharing an 8-gram with a held-out prompt
      seq_len=16,
      batch_size=32,       # pairs per global batch (KTO from a kto file: rows)
      shards=0,            # data shards (0 = one per process)
      on_bad_row="error",  # or "skip" (counted and reported)
      # chat (None: chat-templated when the tokenizer has a template), chat_template_kwargs,
      # system_prompt: how prompts are rendered, as in SFT, GRPO and sampling
      **prompt_section(),
  ))
  c.algo = algo_section()
  c.ref = ml_collections.ConfigDict(dict(
      mode="auto",         # live | cached | auto (see the module docstring)
      batch_size=128,      # pairs per forward when filling the cache
  ))
  # Measured on the tiny preset from the 600-step SFT policy (docs/algorithms/dpo.md): at lr
  # 5e-5 every loss raised held-out accuracy within 100 steps; past ~150 steps the likelihood
  # of the chosen answers keeps falling and greedy accuracy drops back while preference
  # accuracy still rises.
  c.optim = optim_section(lr=5e-5, schedule="constant", warmup_steps=0, weight_decay=0.0,
                          clip_norm=1.0)
  c.train = ml_collections.ConfigDict(dict(
      steps=100, log_every=10, save_every=50, keep_checkpoints=2, async_checkpoints=True))
  c.eval = ml_collections.ConfigDict(dict(every=25, examples=256, batch_size=128,
                                          max_new_tokens=6))
  c.plan = plan_config()  # the device the memory plan checks (and ref.mode=auto reads)
  c.distributed = distributed_section()
  return c


# ----------------------------------------------------------------------------- log-probs


def make_seq_logps(graphdef):
  """seq_logps(params, rows) -> (log-prob sums, token counts), each of shape rows' leading
  dims: rows hold ROW_KEYS arrays of shape [..., S], flattened to [N, S] for one forward."""
  def seq_logps(params, rows, key=None):
    # key: LoRA's dropout key (model.lora.dropout), the policy's in a train step only.
    lead, S = rows["inputs"].shape[:-1], rows["inputs"].shape[-1]
    flat = {k: rows[k].reshape(-1, S) for k in ROW_KEYS}  # [B, 2, S] -> [2B, S]
    logp, _ = apply_logprobs(graphdef, params, flat["inputs"], flat["targets"],
                             flat["positions"], segment_ids_bt=flat["segment_ids"],
                             entropy=False, dropout_key=key)
    mask = flat["loss_mask"]
    return (logp * mask).sum(-1).reshape(lead), mask.sum(-1).reshape(lead)
  return seq_logps


def pair_objective(a):
  """objective(logps [B,2], counts [B,2], ref [B,2] | None) -> (loss_b, metrics_b) for the
  paired losses; KTO's held-out pairs are scored with DPO's implied reward, beta log pi/pi_ref,
  which is KTO's own, so eval/rewards/* compare across losses (its eval/loss is DPO's)."""
  def objective(lp, n, ref):
    c, r, nc, nr = lp[:, 0], lp[:, 1], n[:, 0], n[:, 1]
    if a.loss in ("dpo", "kto"):
      loss, m = pl.dpo_loss(chosen_logps=c, rejected_logps=r, ref_chosen_logps=ref[:, 0],
                            ref_rejected_logps=ref[:, 1], beta=a.beta,
                            label_smoothing=a.label_smoothing if a.loss == "dpo" else 0.0)
    elif a.loss == "ipo":
      loss, m = pl.ipo_loss(chosen_logps=c, rejected_logps=r, ref_chosen_logps=ref[:, 0],
                            ref_rejected_logps=ref[:, 1], chosen_len=nc, rejected_len=nr,
                            beta=a.beta, per_token=a.ipo_per_token)
    elif a.loss == "orpo":
      loss, m = pl.orpo_loss(chosen_logps=c, rejected_logps=r, chosen_len=nc, rejected_len=nr,
                             lam=a.orpo_lambda)
    elif a.loss == "simpo":
      loss, m = pl.simpo_loss(chosen_logps=c, rejected_logps=r, chosen_len=nc, rejected_len=nr,
                              beta=a.beta, gamma=a.simpo_gamma,
                              label_smoothing=a.label_smoothing)
    else:
      raise ValueError(a.loss)
    if a.nll_coef and a.loss in ("dpo", "ipo", "simpo"):
      nll = pl.nll_term(chosen_logps=c, chosen_len=nc)
      loss = loss + a.nll_coef * nll
      m["nll_loss"] = jax.lax.stop_gradient(nll)
    return loss, m
  return objective


def pair_loss(graphdef, a):
  """loss_fn for the shared train step over a batch of pairs [B, 2, S] (+ ref_logps [B, 2]):
  (sum of per-pair losses, (pair count, metric sums))."""
  seq_logps, objective = make_seq_logps(graphdef), pair_objective(a)

  def loss_fn(params, batch, key):
    lp, n = seq_logps(params, batch, key)
    loss, m = objective(lp, n, batch.get("ref_logps"))
    return loss.sum(), (jnp.float32(loss.shape[0]), {k: v.sum() for k, v in m.items()})
  return loss_fn


def kto_loss(graphdef, a):
  """loss_fn over unpaired rows [N, S] with label [N] and ref_logps [N]; with kto_z0=mismatched
  also kl_* rows (prompt i with another row's completion) and kl_ref_logps. z0 is estimated
  over the whole (micro-)batch. Subset metrics (rewards/chosen over desirable rows, ...) are
  masked means, scaled so the train step's division by the row count leaves the mean."""
  seq_logps = make_seq_logps(graphdef)

  def loss_fn(params, batch, key):
    lp, _ = seq_logps(params, batch, key)
    if a.kto_z0 == "mismatched":
      # No gradient flows through z0: score the mismatched rows with frozen params.
      kl_lp, _ = seq_logps(jax.lax.stop_gradient(params),
                           {k: batch["kl_" + k] for k in ROW_KEYS})
      z0 = pl.kto_reference_point(logps=kl_lp, ref_logps=batch["kl_ref_logps"])
    else:
      z0 = pl.kto_reference_point(logps=lp, ref_logps=batch["ref_logps"])
    loss, m = pl.kto_loss(logps=lp, ref_logps=batch["ref_logps"], label=batch["label"], z0=z0,
                          beta=a.beta, desirable_weight=a.kto_desirable_weight,
                          undesirable_weight=a.kto_undesirable_weight)
    N = jnp.float32(loss.shape[0])
    nd, nu = m.pop("count/chosen").sum(), m.pop("count/rejected").sum()
    sums = {"rewards/accuracies": m["rewards/accuracies"].sum(), "kl": z0 * N,
            "kto/frac_desirable": nd}
    for k, cnt in (("rewards/chosen", nd), ("logps/chosen", nd), ("rewards/rejected", nu),
                   ("logps/rejected", nu)):
      sums[k] = m[k].sum() / jnp.maximum(cnt, 1.0) * N
    sums["rewards/margins"] = sums["rewards/chosen"] - sums["rewards/rejected"]
    return loss.sum(), (N, sums)
  return loss_fn


# ----------------------------------------------------------------------------- set-up


def _records(config, task):
  """(train records, held-out pairs, held-out {prompt, answer} or None, data report)."""
  d = config.data
  if d.format == "kto" and config.algo.loss != "kto":
    raise ConfigError(f"data.format='kto' holds unpaired rows, which only algo.loss=kto trains "
                      f"on, but algo.loss={config.algo.loss!r}: set algo.loss=kto, or give a "
                      "file of preference pairs with data.format=prefs.")

  def build(split, n, seed):  # held-out pairs are labelled by the truth, never by a bias
    bias = dict(bias=d.bias, bias_rate=d.bias_rate) if split == "train" else {}
    return prefs.task_prefs(d.task, split, n, seed, **bias)
  train, held_out, skipped = records(config, task, d.format, eval_kind="prefs", build=build,
                                     what="{prompt, chosen, rejected}")
  report: dict = {"skipped": skipped} if d.train_file else {}
  held_answers = answers(config, task)
  if d.format == "prefs":
    eval_prompts = [r["prompt"] for r in held_out] + [r["prompt"] for r in held_answers or []]
    train, clean = prefs.clean_prefs(train, eval_prompts=eval_prompts if d.decontaminate
                                     else ())
    report.update(clean)
  report["fingerprint"] = prefs.fingerprint(train)
  report["eval_fingerprint"] = prefs.fingerprint(held_out) if held_out else ""
  if not train:
    raise ConfigError("no training rows are left after cleaning: see the data report "
                      f"{report}.")
  return train, held_out, held_answers, report


def check_algo(a) -> None:
  """One sentence for a knob the chosen loss does not take."""
  if a.nll_coef and a.loss not in ("dpo", "ipo", "simpo"):
    raise ConfigError(f"algo.nll_coef={a.nll_coef} applies to dpo, ipo and simpo; "
                      f"algo.loss={a.loss!r} " + ("has its own NLL term" if a.loss == "orpo"
                                                  else "takes none") + ": set it to 0.")
  if a.label_smoothing and a.loss not in ("dpo", "simpo"):
    raise ConfigError(f"algo.label_smoothing={a.label_smoothing} applies to dpo (cDPO) and "
                      f"simpo; algo.loss={a.loss!r} takes none: set it to 0.")
  if not 0.0 <= a.label_smoothing < 0.5:
    raise ConfigError(f"algo.label_smoothing={a.label_smoothing} is not valid: give the "
                      "probability that a label is flipped, in [0, 0.5).")


def batch_shardings(config, mesh, *, needs_ref: bool) -> dict:
  """The sharding of every batch key: rows over the batch axes, a pair's two rows on one
  device."""
  a, kto = config.algo, config.algo.loss == "kto"

  def shd(ndim):
    return batch_sharding(mesh, ndim, config.layout)
  rank = 3 if config.data.format == "prefs" and not kto else 2
  out = {k: shd(rank) for k in ROW_KEYS}
  if needs_ref:
    out["ref_logps"] = shd(rank - 1)
  if kto:
    out["label"] = shd(1)
    if a.kto_z0 == "mismatched":
      out.update({"kl_" + k: shd(2) for k in ROW_KEYS})
      out["kl_ref_logps"] = shd(1)
  return out


def held_out_rows(r, held_out) -> list[dict]:
  """The held-out pairs in whole fixed batches (a remainder under one batch is dropped)."""
  d = r.config.data
  eval_bs = min(d.batch_size, len(held_out) // r.replicas * r.replicas)
  if not held_out or eval_bs <= 0:
    return []
  return list(prefs.prefs_batches(held_out, r.tokenizer, seq_len=d.seq_len,
                                     batch_size=eval_bs, seed=0, shuffle=False, num_epochs=1,
                                     on_bad_row=d.on_bad_row, data_cfg=d))


class PrefEval:
  """Held-out preference accuracy on pairs (eval/rewards/*, eval/loss), and greedy exact match
  on the task (eval/accuracy)."""

  def __init__(self, seq_logps, a, mesh, compiler_options, batches, exact):
    objective = pair_objective(a)
    replicated = NamedSharding(mesh, P())

    # The learner's kernels, as the reference's forwards: at step 0 the policy's and the
    # reference's log-probs then agree to the bit (margins exactly 0).
    @functools.partial(jax.jit, compiler_options=compiler_options)
    @functools.partial(shard_activations, mesh=mesh)
    def eval_sums(params, rows, ref):
      lp, n = seq_logps(params, rows)
      loss, m = objective(lp, n, ref)
      keep = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")
      out = {"loss": loss.sum(), "count": jnp.float32(loss.shape[0]),
             **{k: m[k].sum() for k in keep}}
      return jax.lax.with_sharding_constraint(out, replicated)
    self.sums, self.batches, self.exact = eval_sums, batches, exact

  def __call__(self, params, step) -> dict:
    del step
    metrics = {}
    if self.batches:
      tot = None
      for rows, ref in self.batches:
        s = jax.device_get(self.sums(params, rows, ref))
        tot = s if tot is None else {k: tot[k] + s[k] for k in s}
      n = max(float(tot.pop("count")), 1.0)
      metrics.update({f"eval/{k}": float(v) / n for k, v in tot.items()})
    if self.exact is not None:
      metrics.update(self.exact(params))
    return metrics


# ----------------------------------------------------------------------------- the trainer


def _global_rows(mesh, layout, rows):
  """Every process holds the rows in full; each device takes its own."""
  shd = batch_sharding(mesh, rows["inputs"].ndim, layout)
  return {k: global_array(v, shd) for k, v in rows.items() if k in ROW_KEYS}


def _reference(r, mode, state, ref_score, global_rows, report, train, eval_rows):
  """The frozen reference's role by its mode (reference_mode): (cache, reference, eval_ref).
  "cached" scores every row once before training (ref_score is replicated, so every process
  can read the scores of rows it holds in full); "live" keeps its weights, frozen and rebuilt
  from init on resume: with LoRA the base with adapters off, which shares the policy's frozen
  base (no second copy of the weights). eval_ref: the reference's scores of eval_rows."""
  base = lambda: lora.adapters_off(state.params) if r.cfg.lora_rank else state.params
  cache = reference = None
  if mode == "cached":
    cache = cached_reference(r, report, train, eval_rows,
                             lambda rows: ref_score(base(), global_rows(rows)))
  elif mode == "live":
    reference = base() if r.cfg.lora_rank else jax.tree.map(jnp.copy, state.params)
  eval_ref = [cache.lookup(rows) if cache is not None else
              np.asarray(ref_score(reference, global_rows(rows))) for rows in eval_rows]
  return cache, reference, eval_ref


def run(config, workdir: str, *, out=print) -> dict:
  """Trains (or resumes) the preference run in `workdir`; returns the summary."""
  r = Run(config, workdir, out=out, choices=CHOICES, command="dpo",
          sections=default_config().keys(), programs=programs)
  a, d, mesh, cfg = config.algo, config.data, r.mesh, r.cfg
  kto, paired = a.loss == "kto", d.format == "prefs"
  check_algo(a)

  # Data.
  task = load_task(config)
  train, held_out, held_answers, report = _records(config, task)
  r.record_data(report["fingerprint"])
  r.say(f"data: {report}")
  batches = r.batches(prefs.prefs_batches if paired else prefs.kto_batches, train)

  # Policy, then the reference.
  tx, schedule = make_optimizer(config.optim, config.train.steps)
  graphdef, state, shardings = r.init_state(tx)
  seq_logps = make_seq_logps(graphdef)
  needs_ref = pl.NEEDS_REFERENCE[a.loss]
  mode = reference_mode(config, cfg, mesh, r.say)
  batch_shd = batch_shardings(config, mesh, needs_ref=needs_ref)

  # The reference's forwards compile with the learner's options (on CPU, its dot kernels).
  ref_options = compiler_options(mesh.devices.flat)
  ref_forward = shard_activations(lambda p, rows: seq_logps(p, rows)[0], mesh)
  eval_rows = held_out_rows(r, held_out)
  global_rows = functools.partial(_global_rows, mesh, config.layout)
  cache, reference, eval_ref = _reference(
      r, mode, state, jax.jit(ref_forward, out_shardings=NamedSharding(mesh, P()),
                              compiler_options=ref_options),
      global_rows, report, train, eval_rows if needs_ref else [])

  # The loop counts a batch's FLOPs (step_flops) just before it puts it: both read the rows
  # of one to_rows call, whose KTO mismatched rows are a Python loop over the batch.
  last = {}

  def rows_of(batch):
    if last.get("batch") is not batch:
      last.update(batch=batch, rows=to_rows(batch, a, paired=paired))
    return last["rows"]

  def put(batch):
    rows = dict(rows_of(batch))
    if cache is not None:
      rows["ref_logps"] = cache.lookup({k: rows[k] for k in ROW_KEYS})
    return {k: jax.make_array_from_process_local_data(batch_shd[k], v)
            for k, v in rows.items()}

  loss_fn = kto_loss(graphdef, a) if kto else pair_loss(graphdef, a)
  update = make_train_step(loss_fn, tx, schedule, shardings, batch_shd, mesh=mesh,
                           accum_steps=config.optim.accum_steps)
  rank = 3 if paired and not kto else 2
  ref_rows = jax.jit(ref_forward, out_shardings=batch_sharding(mesh, rank - 1, config.layout),
                     compiler_options=ref_options)

  def step_fn(state, batch):
    if reference is not None:  # live: score the batch with the frozen reference first
      batch = dict(batch)
      batch["ref_logps"] = ref_rows(reference, {k: batch[k] for k in ROW_KEYS})
      if kto and a.kto_z0 == "mismatched":
        batch["kl_ref_logps"] = ref_rows(reference, {k: batch["kl_" + k] for k in ROW_KEYS})
    return update(state, batch)

  def step_flops(batch):
    """Model FLOPs of one step (jaxrl.models.flops): the policy's forward and backward over
    the rows, its forward over KTO's mismatched rows (no gradient), and the live reference's
    forwards over both."""
    rows = rows_of(batch)
    live = int(reference is not None)
    fwd = packed_flops(cfg, rows)
    total = train_flops(cfg, fwd) + live * fwd
    if "kl_segment_ids" in rows:
      total += (1 + live) * packed_flops(cfg, rows, "kl_")
    return total

  state = r.resume(state, shardings, batches)
  if reference is not None and cfg.lora_rank:  # share the resumed base, not the starting one
    reference = lora.adapters_off(state.params)

  eval_dev = [(global_rows(rows), global_array(ref, batch_sharding(mesh, 2, config.layout))
               if needs_ref else None)
              for rows, ref in zip(eval_rows, eval_ref or [None] * len(eval_rows))]
  exact = r.exact_match(graphdef, held_answers, task and task.check,
                        max_new=config.eval.max_new_tokens)
  evaluate = PrefEval(seq_logps, a, mesh, ref_options, eval_dev, exact)

  summary = r.train(
      state, step_fn, batches, put=put, eval_fn=evaluate, tokens_fn=count_tokens,
      flops_fn=step_flops, summary_extra=lambda: {"data": report, "ref_mode": mode},
      banner=f"{a.loss}: {cfg.num_params:,} parameters{lora.describe(cfg)}, {len(train)} "
             f"train {'pairs' if paired else 'rows'}, global batch {d.batch_size} x {d.seq_len}, "
             f"{config.train.steps} steps")
  summary["samples"] = exact.samples if exact is not None else []
  return summary


def programs(config, *, devices=None):
  """(Workload, [Program]) of this config's run, abstract (jaxrl.train.programs): the train
  step over one global batch (pairs [B, 2, S], or KTO rows), and the live reference's forward
  over it (ref.mode resolved as run() resolves it), as run() builds them."""
  from jaxrl.models.flops import forward_flops
  from jaxrl.parallel.plan import Workload, abstract_bytes
  from jaxrl.train import programs as pg
  a, d = config.algo, config.data
  cfg = config_lib.model_config(config)
  mesh = pg.learner_mesh(config, devices)
  kto, paired = a.loss == "kto", d.format == "prefs"
  tx, schedule = make_optimizer(config.optim, config.train.steps)
  graphdef, state, shardings = pg.abstract_state(cfg, mesh, tx, layout=config.layout)
  needs_ref = pl.NEEDS_REFERENCE[a.loss]
  mode = reference_mode(config, cfg, mesh, lambda *_: None) if needs_ref else "none"
  shd = batch_shardings(config, mesh, needs_ref=needs_ref)
  B, T = d.batch_size, d.seq_len
  lead = (B, 2) if paired and not kto else (B * (2 if paired else 1),)
  batch = {k: pg.spec((*lead, T), "float32" if k == "loss_mask" else "int32", shd[k])
           for k in ROW_KEYS}
  if needs_ref:
    batch["ref_logps"] = pg.spec(lead, "float32", shd["ref_logps"])
  if kto:
    batch["label"] = pg.spec(lead, "float32", shd["label"])
    if a.kto_z0 == "mismatched":
      batch.update({"kl_" + k: pg.spec((*lead, T), "float32" if k == "loss_mask" else "int32",
                                       shd["kl_" + k]) for k in ROW_KEYS})
      batch["kl_ref_logps"] = pg.spec(lead, "float32", shd["kl_ref_logps"])
  rows = int(np.prod(lead))
  fwd = forward_flops(cfg, tokens=rows * T, pairs=rows * T * (T + 1) / 2)
  knobs = pg.model_knobs(config)
  # The live reference: a copy of the policy's params, or with LoRA the policy's own frozen
  # base (shared) and zero adapters.
  ref_own = lora.split_lora(state.params)[1] if cfg.lora_rank else state.params
  resident = {"reference params": abstract_bytes(ref_own)} if mode == "live" else {}
  plain = pg.plain_graphdef(cfg)
  make_loss = kto_loss if kto else pair_loss
  out = [pg.train_program(
      make_loss(graphdef, a), tx, schedule, state, shardings, batch, mesh=mesh,
      accum_steps=config.optim.accum_steps, resident=resident, flops=train_flops(cfg, fwd),
      tokens=rows * T, seq_len=T, vocab=cfg.vocab_size, logits_chunk=knobs["logits_chunk"],
      cfg=cfg, plain_loss=make_loss(plain, a))]
  if mode == "live":
    seq_logps = make_seq_logps(graphdef)
    ref_fn = jax.jit(shard_activations(lambda p, r: seq_logps(p, r)[0], mesh),
                     out_shardings=batch_sharding(mesh, len(lead), config.layout),
                     compiler_options=compiler_options(mesh.devices.flat))
    replicas = mesh.shape["data"] * mesh.shape["fsdp"]
    out.append(pg.forward_program(
        "reference forward", ref_fn, (state.params, {k: batch[k] for k in ROW_KEYS}),
        resident={"actor params + optimizer state": abstract_bytes(state) - abstract_bytes(
            state.params) + abstract_bytes(ref_own)}, flops=fwd,
        tokens=rows * T, rows=max(1, rows // replicas), seq_len=T, vocab=cfg.vocab_size,
        logits_chunk=knobs["logits_chunk"], cfg=cfg, mesh=mesh,
        plain_fn=lambda p, r: make_seq_logps(plain)(p, r)[0]))
  replicas = mesh.shape["data"] * mesh.shape["fsdp"]
  work = Workload(rows=max(1, rows // (replicas * config.optim.accum_steps)), seq_len=T,
                  reference=mode == "live", **knobs)
  return work, out
