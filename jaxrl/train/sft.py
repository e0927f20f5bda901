"""Supervised fine-tuning: masked token-level cross-entropy over completion tokens.

    jaxrl sft --config configs/sft_tiny.py --workdir DIR

Reads top to bottom: config -> mesh -> data -> state -> loss -> eval -> loop. The loss is the
mean negative log-likelihood of every completion token (and the eos) in the global batch, the
token-level mean TRL's SFTTrainer uses; prompt tokens and padding carry no loss. Eval reports
the held-out loss (`eval/loss`) and, on a built-in task, the exact-match accuracy of greedy
decoding (`eval/accuracy`).
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from jaxrl import config as config_lib
from jaxrl.data import ON_BAD_ROW, read_jsonl, sft_batches
from jaxrl.errors import ConfigError
from jaxrl.models import apply, token_logprobs
from jaxrl.models.flops import packed_flops
from jaxrl.parallel import batch_sharding, mesh_from_config
from jaxrl.parallel.distributed import distributed_section, global_array
from jaxrl.tasks import ERROR_MODES, get_task
from jaxrl.train import optim
from jaxrl.train.checkpoint import Checkpointer
from jaxrl.train.data import ShardedBatches, check_batch_size, data_shards
from jaxrl.train.evaluation import ExactMatch, make_eval_loss
from jaxrl.train.loop import resume, start_run, train_loop
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.train.state import init_train_state, make_train_step, put_batch, start_from_hf

# This trainer's keys with fixed choices, checked when a run starts (config.validate).
CHOICES = {**optim.CHOICES, "data.on_bad_row": ON_BAD_ROW, "data.error_mode": ERROR_MODES}


def default_config():
  """Every field an SFT run reads, with the defaults configs/sft_tiny.py starts from."""
  c = config_lib.base_config()
  c.data = ml_collections.ConfigDict(dict(
      task="addition",     # built-in task (options as "addition:max_digits=3"): train demos,
                           # held-out loss and exact-match accuracy
      train_file="",       # JSONL of {"prompt","completion"} or {"messages"}: replaces the task
      eval_file="",        # JSONL of held-out SFT rows for eval/loss (default: the task's test)
      train_examples=50_000,
      error_rate=0.0,      # how often the task's demonstrations are wrong (headroom for RL)
      error_mode="random", # "random": that fraction of all demos, a random slip each (greedy
                           # decoding mostly hides it); "systematic": the task's one mistake
                           # (addition: a dropped carry) on that fraction of the prompts
                           # where it applies (above 0.5 SFT learns it: see tasks.sft_records)
      seq_len=16,
      batch_size=64,       # global, over all processes
      packing=False,
      shards=0,            # data shards (0 = one per process); fixing it makes the batches
                           # independent of the process count
      on_bad_row="error",  # or "skip" (counted and reported)
  ))
  c.optim = optim_section(lr=3e-3, warmup_steps=100)
  c.train = ml_collections.ConfigDict(dict(
      steps=2000, log_every=50, save_every=500, keep_checkpoints=3, async_checkpoints=True))
  c.eval = ml_collections.ConfigDict(dict(every=500, examples=256, batch_size=128,
                                          max_new_tokens=6))
  c.distributed = distributed_section()
  return c


def sft_loss(graphdef):
  """loss_fn(params, batch, key) -> (sum of -log p(target) over masked tokens, (token count,
  {})); the train step divides by the count over the whole batch."""
  def loss_fn(params, batch, key):
    del key  # no dropout in these models
    logits, _ = apply(graphdef, params, batch["inputs"], batch["positions"],
                      segment_ids_bt=batch["segment_ids"])
    logp, _ = token_logprobs(logits, batch["targets"])
    mask = batch["loss_mask"]
    return -(logp * mask).sum(), (mask.sum(), {})
  return loss_fn


def _records(config):
  """(train SFT records, held-out SFT records, held-out {prompt, answer} records or None,
  the task's checker or None)."""
  d, seed = config.data, config.seed
  task = None
  if d.task:
    task = get_task(d.task)
  if d.train_file:
    train, _ = read_jsonl(d.train_file, "sft", on_bad_row=d.on_bad_row)
  elif task is not None:
    train = task.sft_records("train", d.train_examples, seed, error_rate=d.error_rate,
                             error_mode=d.error_mode)
  else:
    raise ConfigError("data.task and data.train_file are both empty: set data.task to a "
                      "built-in task (e.g. addition) or data.train_file to a JSONL file.")
  if d.eval_file:
    held_out, _ = read_jsonl(d.eval_file, "sft", on_bad_row=d.on_bad_row)
  elif task is not None:
    held_out = task.sft_records("test", config.eval.examples, seed + 1)
  else:
    held_out = []
  answers = task.records("test", config.eval.examples, seed + 1) if task is not None else None
  return train, held_out, answers, (task.check if task is not None else None)


def run(config, workdir: str, *, out=print) -> dict:
  """Trains (or resumes) the SFT run in `workdir`; returns the summary."""
  main, cfg, run_dir, tokenizer = start_run(config, workdir, out=out, choices=CHOICES)
  mesh = mesh_from_config(config.mesh)

  # Data: the global batch is the concatenation of `shards` shard batches, and each process
  # reads only its own shards, so the batches do not depend on the process count.
  d = config.data
  train, held_out, answers, check = _records(config)
  shards, mine = data_shards(d.shards)
  replicas = mesh.shape["data"] * mesh.shape["fsdp"]
  accum = config.optim.accum_steps
  check_batch_size(d.batch_size, shards, replicas, accum)
  batches = ShardedBatches([
      sft_batches(train, tokenizer, seq_len=d.seq_len, batch_size=d.batch_size // shards,
                  seed=config.seed, packing=d.packing, shard_index=i, shard_count=shards,
                  on_bad_row=d.on_bad_row) for i in mine])
  shd = batch_sharding(mesh, 2, config.layout)

  def put(batch):
    return put_batch(batch, shd)

  # State, born sharded; then the latest checkpoint if DIR has one.
  total = config.train.steps
  tx, schedule = make_optimizer(config.optim, total)
  graphdef, state, shardings = init_train_state(cfg, mesh, tx, seed=config.seed,
                                                layout=config.layout)
  state = start_from_hf(config, state, mesh, config.layout)
  loss_fn = sft_loss(graphdef)
  step_fn = make_train_step(loss_fn, tx, schedule, shardings, shd, mesh=mesh,
                            accum_steps=config.optim.accum_steps)
  ckpt = Checkpointer(run_dir.checkpoints, keep=config.train.keep_checkpoints,
                      async_save=config.train.async_checkpoints)
  state, start = resume(ckpt, state, shardings, batches, run_dir, out=out)

  # Eval: fixed held-out batches for the loss; greedy exact match on the task's test split.
  # Every process holds the (small) held-out set in full, so all of them run the same number
  # of eval batches; each device still takes only its own rows.
  eval_batches = []
  if held_out:
    eval_bs = min(d.batch_size, len(held_out) // replicas * replicas)
    if eval_bs > 0:
      eval_batches = [{k: global_array(v, shd) for k, v in b.items()} for b in sft_batches(
          held_out, tokenizer, seq_len=d.seq_len, batch_size=eval_bs, seed=0, shuffle=False,
          num_epochs=1, on_bad_row=d.on_bad_row)]
  eval_loss = make_eval_loss(loss_fn, mesh)
  exact = (ExactMatch(graphdef, cfg, mesh, tokenizer, answers, check,
                      batch=config.eval.batch_size, max_new=config.eval.max_new_tokens)
           if answers else None)

  def evaluate(params, step):
    del step
    metrics = {}
    if eval_batches:
      metrics["eval/loss"] = eval_loss(params, eval_batches)
    if exact is not None:
      metrics.update(exact(params))
    return metrics

  if main and start == 0:
    out(f"sft: {cfg.num_params:,} parameters, {len(train)} train examples, "
        f"global batch {d.batch_size} x {d.seq_len}, {total} steps")
  try:
    summary = train_loop(
        state=state, step_fn=step_fn, batches=batches, put=put, total_steps=total,
        run=run_dir, ckpt=ckpt, log_every=config.train.log_every,
        save_every=config.train.save_every, eval_every=config.eval.every, eval_fn=evaluate,
        tokens_fn=lambda b: int(np.count_nonzero(b["segment_ids"])),
        flops_fn=lambda b: 3 * packed_flops(cfg, b), out=out)
  finally:
    ckpt.close()
    run_dir.close()
  summary["samples"] = exact.samples if exact is not None else []
  return summary
