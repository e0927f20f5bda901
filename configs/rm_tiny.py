"""A reward model for built-in addition on the tiny model (0.46M), from an SFT policy, on CPU.

    jaxrl sft --config configs/sft_tiny.py --workdir runs/sft_tiny
    jaxrl rm  --config configs/rm_tiny.py --config.init.checkpoint=runs/sft_tiny \
        --workdir runs/rm_honest
    jaxrl rm  --config configs/rm_tiny.py:biased --config.init.checkpoint=runs/sft_tiny \
        --workdir runs/rm_biased
    jaxrl rm  --config configs/rm_tiny.py:runlocal --workdir /tmp/rm        # a pulse: seconds

Your own pairs (no code changes): --config.data.task= --config.data.train_file=prefs.jsonl
--config.data.eval_file=prefs_test.jsonl (rows {"prompt", "chosen", "rejected"}).

Re-running on the same workdir resumes from its latest checkpoint. Every field, with what it
means, is in jaxrl/algorithms/rm.py:default_config().
arg: "" (honest pairs: chosen = the correct sum), "biased" (a labeller that prefers the longer
answer, right or wrong: the reward-hacking demonstration), "logprob" (honest pairs, and the
score adds the response's mean log-prob under the backbone's LM head: held-out pairwise accuracy
0.971 (0.963-0.973) on 1 device and 0.977 (0.961-0.984) on 8, median (min-max) over seeds 0-4
from the sft_tiny policy, against 0.795 (0.777-0.855) and 0.801 (0.783-0.842) for the last-token
head alone: docs/guides/recipes.md), "runlocal" (10 steps).
"""

from jaxrl.algorithms.rm import default_config


def get_config(arg=None):
  c = default_config()
  c.model.preset = "tiny"
  c.data.update(task="addition", train_examples=4000, seq_len=16, batch_size=32)
  # lr 3e-4: 1e-3 and above wrecked the SFT features (held-out accuracy stuck near 0.5).
  c.optim.update(lr=3e-4, warmup_steps=20, schedule="cosine", clip_norm=1.0)
  c.train.update(steps=400, log_every=25, save_every=100)
  c.eval.update(every=100, examples=512, batch_size=64)
  if arg == "biased":
    # The labeller's bias is easy to learn: held-out agreement 1.0 by step 100.
    c.data.update(bias="longer", bias_rate=1.0)
    c.optim.lr = 1e-3
    c.train.steps = 200
  elif arg == "logprob":
    c.head.logprob_feature = True
  elif arg == "runlocal":
    c.data.train_examples = 256
    c.train.update(steps=10, log_every=5, save_every=10)
    c.eval.update(every=10, examples=32, batch_size=32)
    c.optim.warmup_steps = 2
  elif arg not in (None, ""):
    raise ValueError(f"unknown arg {arg!r}: use '', 'biased', 'logprob' or 'runlocal'")
  return c
