"""Qwen2.5 1.5B / 7B (Instruct): SFT and GRPO on an 8-chip TPU slice (v5e-8, v5p-8, v6e-8).

arg: "MODEL[,TRAINER][,CHIP][,lora|qlora]": MODEL 1.5b | 7b, TRAINER grpo (default) | sft,
CHIP v5e (default) | v5p | v6e, lora: LoRA rank 16 on every linear weight, the frozen base in
bf16, lr x10; qlora: the same with the base's linear weights in int8 (jaxrl.config.with_lora,
docs/guides/lora.md); or "fixture" (a GRPO pulse on tests/fixtures/hf/qwen2, CPU).

Fetch a checkpoint once, on a machine with network access (jaxrl itself never downloads):
    huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct \
        --local-dir checkpoints/Qwen2.5-1.5B-Instruct
Until it is there the preset supplies the same shapes, so the plan and the compile work first:
    jaxrl plan --config configs/qwen2p5.py:1.5b,grpo,v5e --compile v5e:2x4
    jaxrl plan --config configs/qwen2p5.py:7b,sft,v5p --compile v5p:2x2x1
    jaxrl sft  --config configs/qwen2p5.py:1.5b,sft --workdir runs/sft
    jaxrl grpo --config configs/qwen2p5.py:1.5b --config.init.checkpoint=runs/sft \
        --workdir runs/grpo

The memory knobs (model.remat, optim.accum_steps) are those the compiler's figures chose:
docs/guides/scale.md lists the compiled bytes and roofline times of every variant.
"""

import os

from jaxrl.config import family_config, lora_arg, with_lora
from jaxrl.algorithms import grpo
from jaxrl.algorithms import sft

MODELS = {"1.5b": ("qwen2.5-1.5b", "checkpoints/Qwen2.5-1.5B-Instruct"),
          "7b": ("qwen2.5-7b", "checkpoints/Qwen2.5-7B-Instruct")}
# (model, trainer, chip) -> memory knobs where the family default (full remat; 1, 4 or 8
# micro-batches by size: jaxrl.config.family_config) does not fit. Qwen2.5-1.5B GRPO on v5e-8 at one
# micro-batch plans 15.29 of the chip's 16 GiB (Llama-3.2-1B's compile there came out 35% over
# its plan at one micro-batch), so it runs 2 micro-batches: the plan says 10.43 GiB.
SIZING = {("1.5b", "grpo", "v5e"): {"accum_steps": 2}}
FIXTURE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "tests", "fixtures", "hf", "qwen2"))


def get_config(arg=None):
  arg, lora = lora_arg(arg)
  c = family_config(arg, models=MODELS, default="1.5b", sft_config=sft.default_config,
                    grpo_config=grpo.default_config, fixture=FIXTURE, sizing=SIZING)
  return with_lora(c, quantize="int8" if lora == "qlora" else "") if lora else c
