"""Llama 3.2 1B / 3B and Llama 3.1 8B (Instruct): SFT and GRPO on an 8-chip TPU slice.

arg: "MODEL[,TRAINER][,CHIP][,lora|qlora]": MODEL 3.2-1b | 3.2-3b | 3.1-8b, TRAINER grpo (default) |
sft, CHIP v5e (default) | v5p | v6e, lora: LoRA rank 16 on every linear weight, the frozen base
in bf16, lr x10; qlora: the same with the base's linear weights in int8 (jaxrl.config.with_lora,
docs/guides/lora.md); or "fixture" (a GRPO pulse on
tests/fixtures/hf/llama, CPU; "fixture,lora" / "fixture,qlora" with LoRA / QLoRA).

Fetch a checkpoint once, on a machine with network access (jaxrl itself never downloads):
    huggingface-cli download meta-llama/Llama-3.2-1B-Instruct \
        --local-dir checkpoints/Llama-3.2-1B-Instruct
Until it is there the preset supplies the same shapes, so the plan and the compile work first:
    jaxrl plan --config configs/llama3.py:3.2-1b,grpo,v5e --compile v5e:2x4
    jaxrl plan --config configs/llama3.py:3.1-8b,sft,v5p --compile v5p:2x2x1
    jaxrl plan --config configs/llama3.py:3.1-8b,grpo,v5e,lora
    jaxrl plan --config configs/llama3.py:3.1-8b,grpo,v5e,qlora
    jaxrl sft  --config configs/llama3.py:3.2-1b,sft --workdir runs/sft
    jaxrl grpo --config configs/llama3.py:3.2-1b --config.init.checkpoint=runs/sft \
        --workdir runs/grpo

The memory knobs (model.remat, optim.accum_steps) are those the compiler's figures chose:
docs/guides/scale.md lists the compiled bytes and roofline times of every variant.
"""

import os

from jaxrl.config import family_config, lora_arg, with_lora
from jaxrl.algorithms import grpo
from jaxrl.algorithms import sft

MODELS = {"3.2-1b": ("llama-3.2-1b", "checkpoints/Llama-3.2-1B-Instruct"),
          "3.2-3b": ("llama-3.2-3b", "checkpoints/Llama-3.2-3B-Instruct"),
          "3.1-8b": ("llama-3.1-8b", "checkpoints/Llama-3.1-8B-Instruct")}
# (model, trainer, chip) -> memory knobs where the family default (full remat; 1, 4 or 8
# micro-batches by size: jaxrl.config.family_config) does not fit. 1B's GRPO on a v5e at one
# micro-batch (16 rows of 2,048 tokens per chip) ran the TPU compiler out of HBM (30.09 GiB of
# temporaries; the plan said 19.58 GiB at the peak, so it refused the run too); at 2
# micro-batches it compiled to 13.42 GiB per chip at the run's peak (plan 12.25), and fits.
# 3B's GRPO on a v5e at the family default (4 micro-batches) compiled to 15.40 GiB per chip at
# the run's peak, but the plan put it at 17.58, over the chip's 16 GiB (the start-up check would
# refuse it); at 8 micro-batches (docs/guides/scale.md has the row).
SIZING = {("3.2-1b", "grpo", "v5e"): {"accum_steps": 2},
          ("3.2-3b", "grpo", "v5e"): {"accum_steps": 8}}
# (model, trainer, chip) -> the QLoRA variant's sampler mesh (data, tensor) where the
# family default (data=auto x tensor=2) does not fit: as configs/qwen3.py's 8B (8 KV heads, one
# per chip at tensor=8; docs/guides/lora.md).
QLORA_SAMPLER = {("3.1-8b", "grpo", "v5e"): (1, 8)}
FIXTURE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "tests", "fixtures", "hf", "llama"))


def get_config(arg=None):
  arg, lora = lora_arg(arg)
  c = family_config(arg, models=MODELS, default="3.2-1b", sft_config=sft.default_config,
                    grpo_config=grpo.default_config, fixture=FIXTURE, sizing=SIZING)
  if not lora:
    return c
  parts = [x.strip() for x in (arg or "3.2-1b").split(",")]
  key = (parts[0], next((x for x in parts[1:] if x in ("sft", "grpo")), "grpo"),
         next((x for x in parts[1:] if x in ("v5e", "v5p", "v6e")), "v5e"))
  if lora == "qlora" and key in QLORA_SAMPLER:
    c.placement.sampler_mesh.data, c.placement.sampler_mesh.tensor = QLORA_SAMPLER[key]
  return with_lora(c, quantize="int8" if lora == "qlora" else "")
