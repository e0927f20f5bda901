"""Sample completions with `jaxrl sample` from a run directory, a Hugging Face checkpoint, or
the tiny preset's random init (a plumbing check).

    jaxrl sample --config configs/sample_tiny.py --checkpoint runs/sft_tiny \
        --prompts prompts.jsonl --n 4 --workdir /tmp/s
    jaxrl sample --config configs/sample_tiny.py --config.model.hf_path=/ckpt/Qwen3-0.6B \
        --prompts prompts.jsonl --n 1 --workdir /tmp/g \
        --config.sampling.mode=greedy --config.sampling.max_new_tokens=256

prompts.jsonl holds one JSON object a line with a "prompt" string, a "messages" list or
"prompt_ids" (see docs/concepts/sampler.md). The data section says how prompts are rendered, as
in GRPO (chat, None meaning the checkpoint's chat template when it has one; chat_template_kwargs;
system_prompt). The sampling section sets the mode (sample or greedy), temperature, top-k /
top-p / min-p (0, 1.0 and 0.0 turn them off), extra stop token ids besides eos (and
generation_config.json's), the number of decode slots, how many decode steps run per jitted
call, and continuous or static batching.
"""

import ml_collections

from jaxrl.config import base_config
from jaxrl.data.prompts import prompt_section


def get_config(arg=None):
  if arg not in (None, ""):
    raise ValueError(f"unknown arg {arg!r}: this config takes none")
  c = base_config()
  c.model.preset = "tiny"
  c.layout = "sampler"
  # fields renames a prompts file's columns, e.g. {"question": "prompt"}
  c.data = ml_collections.ConfigDict(dict(on_bad_row="error", fields=None, **prompt_section()))
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
