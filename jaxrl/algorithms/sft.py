"""Supervised fine-tuning: masked token-level cross-entropy over completion tokens.

    jaxrl sft --config configs/sft_tiny.py --workdir DIR

Reads top to bottom: config -> mesh -> data -> state -> loss -> eval -> loop. The loss is the
mean negative log-likelihood of every completion token (and the eos) in the global batch, the
token-level mean TRL's SFTTrainer uses; prompt tokens and padding carry no loss. Eval reports
the held-out loss (`eval/loss`) and, on a built-in task, the exact-match accuracy of greedy
decoding (`eval/accuracy`).
"""

from __future__ import annotations

import ml_collections

from jaxrl import config as config_lib
from jaxrl.data import ON_BAD_ROW, prefs, sft_batches
from jaxrl.data.pipeline import FEATURES, TRAIN_ON
from jaxrl.data.prompts import prompt_section
from jaxrl.errors import ConfigError
from jaxrl.models import apply_logprobs, lora
from jaxrl.models.flops import packed_flops, train_flops
from jaxrl.parallel import batch_sharding
from jaxrl.parallel.distributed import distributed_section, global_array
from jaxrl.parallel.plan import plan_config
from jaxrl.tasks import ERROR_MODES
from jaxrl.train import optim
from jaxrl.train.data import answers, check_section as check_data, load_task, records
from jaxrl.train.evaluation import make_eval_loss
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.train.run import Run, count_tokens
from jaxrl.train.state import make_train_step, put_batch

# This trainer's keys with fixed choices, checked when a run starts (config.validate).
# Sections mapped to a function have their ranges checked there.
CHOICES = {**optim.CHOICES, "data.on_bad_row": ON_BAD_ROW, "data.error_mode": ERROR_MODES,
           "data.train_on": TRAIN_ON, "data": check_data}


def default_config():
  """Every field an SFT run reads, with the defaults configs/sft_tiny.py starts from."""
  c = config_lib.base_config()
  c.data = ml_collections.ConfigDict(dict(
      task="addition",     # built-in task (options as "addition:max_digits=3"): train demos,
                           # held-out loss and exact-match accuracy
      train_file="",       # JSONL of {"prompt","completion"} or {"messages"}: replaces the task
      eval_file="",        # JSONL of held-out SFT rows for eval/loss (default: the task's test)
      fields=None,         # source column -> record field, e.g. {"question": "prompt"}:
                           # files may be .jsonl, .parquet, .arrow or a save_to_disk directory
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
      train_on="last",     # {"messages"} rows: "last" assistant turn, or "all_assistant" turns
      tool_rate=0.0,       # > 0: the task's demonstrations are calculator conversations, this
                           # share calling the tool (jaxrl.envs.calculator.demonstrations; a
                           # warm start for GRPO with data.env=calculator); needs train_on=
                           # all_assistant
      # chat (None: chat-templated when the tokenizer has a template), chat_template_kwargs,
      # system_prompt: how prompts are rendered, as in GRPO and sampling (jaxrl.data.prompts)
      **prompt_section(),
  ))
  c.optim = optim_section(lr=3e-3, warmup_steps=100)
  c.train = ml_collections.ConfigDict(dict(
      steps=2000, log_every=50, save_every=500, keep_checkpoints=3, async_checkpoints=True))
  c.eval = ml_collections.ConfigDict(dict(every=500, examples=256, batch_size=128,
                                          max_new_tokens=6))
  c.distributed = distributed_section()
  c.plan = plan_config()  # the device the trainer's memory plan is checked against
  return c


def sft_loss(graphdef):
  """loss_fn(params, batch, key) -> (sum of -log p(target) over masked tokens, (token count,
  {})); the train step divides by the count over the whole batch. `key` drives LoRA's
  dropout (model.lora.dropout; None at eval drops nothing)."""
  def loss_fn(params, batch, key):
    logp, _ = apply_logprobs(graphdef, params, batch["inputs"], batch["targets"],
                             batch["positions"], segment_ids_bt=batch["segment_ids"],
                             entropy=False, dropout_key=key)
    mask = batch["loss_mask"]
    return -(logp * mask).sum(), (mask.sum(), {})
  return loss_fn


def _records(config, task):
  """(train SFT records, held-out SFT records): data.train_file or the task's demonstrations
  (data.error_rate of them wrong), data.eval_file or the task's test split."""
  d = config.data

  def build(split, n, seed):
    if d.get("tool_rate"):
      if d.train_on != "all_assistant":
        raise ConfigError(f"data.tool_rate={d.tool_rate} makes the demonstrations calculator "
                          "conversations, whose tool-calling turns are trained only with "
                          "data.train_on=all_assistant: set it.")
      from jaxrl.envs.calculator import demonstrations
      return demonstrations(task, split, n, seed, d.tool_rate)
    wrong = dict(error_rate=d.error_rate, error_mode=d.error_mode) if split == "train" else {}
    return task.sft_records(split, n, seed, **wrong)
  train, held_out, _ = records(config, task, "sft", build=build,
                               what="{prompt, completion} or {messages}")
  return train, held_out


def run(config, workdir: str, *, out=print) -> dict:
  """Trains (or resumes) the SFT run in `workdir`; returns the summary."""
  r = Run(config, workdir, out=out, choices=CHOICES, command="sft",
          sections=default_config().keys(), programs=programs)
  d, mesh = config.data, r.mesh
  task = load_task(config)
  train, held_out = _records(config, task)
  r.record_data(prefs.fingerprint(train))
  batches = r.batches(sft_batches, train, packing=d.packing, data_cfg=d)
  shd = batch_sharding(mesh, 2, config.layout)

  # State, born sharded; then the latest checkpoint if DIR has one.
  tx, schedule = make_optimizer(config.optim, config.train.steps)
  graphdef, state, shardings = r.init_state(tx)
  loss_fn = sft_loss(graphdef)
  step_fn = make_train_step(loss_fn, tx, schedule, shardings, shd, mesh=mesh,
                            accum_steps=config.optim.accum_steps)
  state = r.resume(state, shardings, batches)

  # Eval: fixed held-out batches for the loss; greedy exact match on the task's test split.
  # Every process holds the (small) held-out set in full, so all of them run the same number
  # of eval batches; each device still takes only its own rows.
  eval_batches = []
  if held_out:
    eval_bs = min(d.batch_size, len(held_out) // r.replicas * r.replicas)
    if eval_bs > 0:
      eval_batches = [{k: global_array(v, shd) for k, v in b.items()} for b in sft_batches(
          held_out, r.tokenizer, seq_len=d.seq_len, batch_size=eval_bs, seed=0, shuffle=False,
          num_epochs=1, on_bad_row=d.on_bad_row, data_cfg=d)]
  eval_loss = make_eval_loss(loss_fn, mesh)
  exact = r.exact_match(graphdef, answers(config, task), task and task.check,
                        max_new=config.eval.max_new_tokens)

  def evaluate(params, step):
    del step
    metrics = {}
    if eval_batches:
      metrics["eval/loss"] = eval_loss(params, eval_batches)
    if exact is not None:
      metrics.update(exact(params))
    return metrics

  summary = r.train(
      state, step_fn, batches, put=lambda b: put_batch(b, shd), eval_fn=evaluate,
      tokens_fn=count_tokens, flops_fn=lambda b: train_flops(r.cfg, packed_flops(r.cfg, b)),
      banner=f"sft: {r.cfg.num_params:,} parameters{lora.describe(r.cfg)}, {len(train)} train "
             f"examples, global batch {d.batch_size} x {d.seq_len}, {config.train.steps} steps")
  summary["samples"] = exact.samples if exact is not None else []
  return summary


def programs(config, *, devices=None):
  """(Workload, [Program]) of this config's run, abstract (jaxrl.train.programs): the train
  step over one global batch of data.batch_size x data.seq_len rows, as run() builds it."""
  from jaxrl.models.flops import forward_flops
  from jaxrl.parallel.plan import Workload
  from jaxrl.train import programs as pg
  cfg, d = config_lib.model_config(config), config.data
  mesh = pg.learner_mesh(config, devices)
  tx, schedule = make_optimizer(config.optim, config.train.steps)
  graphdef, state, shardings = pg.abstract_state(cfg, mesh, tx, layout=config.layout)
  shd = batch_sharding(mesh, 2, config.layout)
  B, T = d.batch_size, d.seq_len
  batch = {k: pg.spec((B, T), "float32" if k == "loss_mask" else "int32", shd)
           for k in FEATURES}
  knobs = pg.model_knobs(config)
  step = pg.train_program(
      sft_loss(graphdef), tx, schedule, state, shardings, batch, mesh=mesh,
      accum_steps=config.optim.accum_steps, seq_len=T, vocab=cfg.vocab_size,
      logits_chunk=knobs["logits_chunk"], cfg=cfg, plain_loss=sft_loss(pg.plain_graphdef(cfg)),
      flops=train_flops(cfg, forward_flops(cfg, tokens=B * T, pairs=B * T * (T + 1) / 2)),
      tokens=B * T)
  replicas = mesh.shape["data"] * mesh.shape["fsdp"]
  work = Workload(rows=max(1, B // (replicas * config.optim.accum_steps)), seq_len=T, **knobs)
  return work, [step]
