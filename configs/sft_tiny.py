"""SFT of a tiny model on the built-in addition task; learns on a 2-core CPU in minutes.

    jaxrl sft --config configs/sft_tiny.py --workdir runs/sft_tiny
    jaxrl sft --config configs/sft_tiny.py:runlocal --workdir /tmp/sft   # seconds: a pulse
    jaxrl sft --config configs/sft_tiny.py --config.data.task=sort --workdir runs/sft_sort

Re-running on the same workdir resumes from its latest checkpoint.
arg: "" (the measured run), "runlocal" (a few steps, a few seconds).
"""

import ml_collections

from jaxrl.config import base_config
from jaxrl.parallel.distributed import distributed_section
from jaxrl.train.optim import optim_section


def get_config(arg=None):
  c = base_config()
  c.model.preset = "tiny"
  c.data = ml_collections.ConfigDict(dict(
      task="addition",     # built-in task: train demos, held-out loss and exact-match accuracy
      max_digits=0,        # addition operands up to this many digits (0 = the task's default)
      train_file="",       # JSONL of {"prompt","completion"} or {"messages"}: replaces the task
      eval_file="",        # JSONL of held-out SFT rows for eval/loss (default: the task's test)
      train_examples=50_000,
      error_rate=0.0,      # fraction of wrong demonstrations (headroom for RL later)
      seq_len=16,
      batch_size=64,       # global, over all processes
      packing=False,
      shards=0,            # data shards (0 = one per process); fix it to make batches
                           # independent of the process count
      on_bad_row="error",  # or "skip" (counted and reported)
  ))
  c.optim = optim_section(lr=3e-3, warmup_steps=100, weight_decay=0.01, clip_norm=1.0)
  c.train = ml_collections.ConfigDict(dict(
      steps=2000, log_every=50, save_every=500, keep_checkpoints=3, async_checkpoints=True))
  c.eval = ml_collections.ConfigDict(dict(every=500, examples=256, batch_size=128,
                                          max_new_tokens=6))
  c.distributed = distributed_section()
  if arg == "runlocal":
    c.data.train_examples = 512
    c.train.update(steps=20, log_every=5, save_every=10)
    c.eval.update(every=10, examples=16, batch_size=16)
    c.optim.warmup_steps = 5
  elif arg not in (None, ""):
    raise ValueError(f"unknown arg {arg!r}: use '' or 'runlocal'")
  return c
