"""Qwen3 0.6B / 1.7B / 4B / 8B: SFT and GRPO on an 8-chip TPU slice (v5e-8, v5p-8, v6e-8).

arg: "MODEL[,TRAINER][,CHIP][,lora|qlora]": MODEL 0.6b | 1.7b | 4b | 8b, TRAINER grpo (default) |
sft, CHIP v5e (default) | v5p | v6e (8-chip slices) | v5e-4 (4 chips, the qlora variant), lora:
LoRA rank 16 on every linear weight, the frozen base in bf16, lr x10; qlora: the same with the
base's linear weights in int8 (jaxrl.config.with_lora, docs/guides/lora.md); or "fixture" (a
GRPO pulse on tests/fixtures/hf/qwen3, CPU; "fixture,lora" / "fixture,qlora" with LoRA / QLoRA).

Fetch a checkpoint once, on a machine with network access (jaxrl itself never downloads):
    huggingface-cli download Qwen/Qwen3-0.6B --local-dir checkpoints/Qwen3-0.6B
Until it is there the preset supplies the same shapes, so the plan and the compile work first:
    jaxrl plan --config configs/qwen3.py:0.6b,grpo,v5e --compile v5e:2x4
    jaxrl plan --config configs/qwen3.py:8b,sft,v5p --compile v5p:2x2x1
    jaxrl plan --config configs/qwen3.py:8b,grpo,v5e,lora --compile v5e:2x4
    jaxrl plan --config configs/qwen3.py:8b,grpo,v5e,qlora --compile v5e:2x4
    jaxrl plan --config configs/qwen3.py:4b,grpo,v5e-4,qlora --compile v5e:2x2
    jaxrl sft  --config configs/qwen3.py:0.6b,sft --workdir runs/sft
    jaxrl grpo --config configs/qwen3.py:0.6b --config.init.checkpoint=runs/sft --workdir runs/grpo

The memory knobs (model.remat, optim.accum_steps) are those the compiler's figures chose:
docs/guides/scale.md lists the compiled bytes and roofline times of every variant.
"""

import os

from jaxrl.config import REAL_CHIPS, family_config, lora_arg, with_lora
from jaxrl.algorithms import grpo
from jaxrl.algorithms import sft

MODELS = {"0.6b": ("qwen3-0.6b", "checkpoints/Qwen3-0.6B"),
          "1.7b": ("qwen3-1.7b", "checkpoints/Qwen3-1.7B"),
          "4b": ("qwen3-4b", "checkpoints/Qwen3-4B"),
          "8b": ("qwen3-8b", "checkpoints/Qwen3-8B")}
# (model, trainer, chip) -> memory knobs where the family default (full remat; 1, 4 or 8
# micro-batches by size: jaxrl.config.family_config) does not fit. 4B's GRPO on a v5e: at 16
# micro-batches (which the log-prob forward also runs in) the train step compiled to 14.6 GiB
# per chip, but the decode loop beside the learner's fp32 state peaked at 18.1 and the train
# step beside the fp32 reference at 16.5. With the reference in bf16 (placement.ref_dtype: exact
# under bf16 compute) and the sampler at data 2 x tensor 4 it compiles to a 15.30 GiB peak per
# chip, the train step 14.36 + the reference 0.94 (plan 15.92), and fits (docs/guides/scale.md).
# On a v5e-4 (QLoRA) the same 16 micro-batches: 2 rows of 2,048 tokens per chip each; at 4 the
# plan put the train step at 13.4 GiB.
# 1.7B's GRPO on a v5e at the family default (one micro-batch: 16 rows of 2,048 tokens per
# chip) plans 18.0 GiB for the train step; at 2 micro-batches it compiles to 13.69 GiB per chip
# at the run's peak (the train step, 12.89 + 0.80; plan 12.17), and fits.
# 4B's SFT on a v5e at the family default (4 micro-batches) compiled to 14.67 GiB per chip, but
# the plan put it at 16.43, over the chip's 16 GiB, so the trainer's start-up check would refuse
# a run that fits; at 8 micro-batches both are lower (docs/guides/scale.md has the row).
SIZING = {("4b", "grpo", "v5e"): {"accum_steps": 16, "ref_dtype": "bfloat16",
                                  "sampler_mesh": (2, 4)},
          ("4b", "grpo", "v5e-4"): {"accum_steps": 16},
          ("1.7b", "grpo", "v5e"): {"accum_steps": 2}, ("4b", "sft", "v5e"): {"accum_steps": 8}}
# (model, trainer, chip) -> the LoRA / QLoRA variants' sampler mesh (data, tensor) where the
# family default (data=auto x tensor=2) does not fit. (The bf16 LoRA train step, once refused by
# the TPU compiler, compiles to 9.06 GiB with the collective matmul off; at tensor=2 its sampler
# side peaked at 24.30 GiB, so it takes the same sampler mesh.) 8B GRPO on a
# v5e-8: at tensor=2 the sampler's bf16 copy is 7.6 GiB per chip (plus the 4.4 GiB int8 base),
# so prefill and the decode loop compiled to 16.4 and 20.3 GiB peaks. Tensor-parallel over all
# 8 chips (Qwen3-8B has 8 KV heads: one per chip) cuts both copies to a quarter and keeps the
# full GRPO batch (16 prompts x G=8 = 128 completions of up to 1536 tokens after 512 prompt
# tokens, 64 decode slots): docs/guides/lora.md has the compiled figures.
# 4B GRPO on a v5e-4 (4 chips): the same step (128 completions, 64 decode slots) with the
# sampler tensor-parallel over the 4 chips; at data=2 x tensor=2 the plan put the decode loop at
# 16.3 GiB per chip (the bf16 sampler copy 3.9 + the 64 slots' KV cache twice).
QLORA_SAMPLER = {("8b", "grpo", "v5e"): (1, 8), ("4b", "grpo", "v5e-4"): (1, 4)}
FIXTURE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "tests", "fixtures", "hf", "qwen3"))


def get_config(arg=None):
  arg, lora = lora_arg(arg)
  c = family_config(arg, models=MODELS, default="0.6b", sft_config=sft.default_config,
                    grpo_config=grpo.default_config, fixture=FIXTURE, sizing=SIZING)
  if not lora:
    return c
  parts = [x.strip() for x in (arg or "0.6b").split(",")]
  key = (parts[0], next((x for x in parts[1:] if x in ("sft", "grpo")), "grpo"),
         next((x for x in parts[1:] if x in REAL_CHIPS), "v5e"))
  if key in QLORA_SAMPLER:  # the bf16 LoRA variant too: its sampler holds the same bf16 copy
    c.placement.sampler_mesh.data, c.placement.sampler_mesh.tensor = QLORA_SAMPLER[key]
  return with_lora(c, quantize="int8" if lora == "qlora" else "")
