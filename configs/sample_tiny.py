"""Sample completions from the tiny model (random init until checkpoints land) with `jaxrl sample`.

    jaxrl sample --config configs/sample_tiny.py --prompts prompts.jsonl --n 4 --workdir /tmp/s
    jaxrl sample --config configs/sample_tiny.py --prompts prompts.jsonl --n 1 --workdir /tmp/g \
        --config.sampling.mode=greedy --config.sampling.max_new_tokens=16

prompts.jsonl holds one JSON object with a "prompt" string per line. The sampling section sets the mode
(sample or greedy), temperature, top-k / top-p / min-p (0, 1.0 and 0.0 turn them off), extra stop
token ids besides eos, the number of decode slots, how many decode steps run per jitted call,
and continuous or static batching.
"""

import ml_collections

from jaxrl.config import base_config


def get_config(arg=None):
  if arg not in (None, ""):
    raise ValueError(f"unknown arg {arg!r}: this config takes none")
  c = base_config()
  c.model.preset = "tiny"
  c.layout = "sampler"
  c.sampling = ml_collections.ConfigDict(dict(
      mode="sample",  # "sample" or "greedy"
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      min_p=0.0,
      max_new_tokens=64,
      stop_ids=(),  # token ids that end a completion besides the tokenizer's eos
      n=4,  # samples per prompt (--n overrides)
      slots=16,  # decode slots; a multiple of mesh data x fsdp
      steps_per_call=8,  # decode steps per jitted scan: one host sync per this many tokens
      grow_cache=True,  # grow the KV cache's window with the sequences (False: one compile)
      batching="continuous",  # or "static": refill only when every slot is free
  ))
  return c
