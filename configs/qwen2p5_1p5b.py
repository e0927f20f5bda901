"""Qwen2.5-1.5B-Instruct from a local Hugging Face checkpoint: model and 8-chip memory plan.

Fetch the checkpoint once, on a machine with network access (jaxrl itself never downloads):
    huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct \
        --local-dir checkpoints/Qwen2.5-1.5B-Instruct
Then (8 fake CPU devices stand in for a v5e-8 / v6e-8 slice when planning on a laptop):
    export XLA_FLAGS=--xla_force_host_platform_device_count=8
    jaxrl plan --config configs/qwen2p5_1p5b.py                 # GRPO on a v5e-8
    jaxrl plan --config configs/qwen2p5_1p5b.py:sft --config.plan.device=tpu-v6e
    jaxrl model --config configs/qwen2p5_1p5b.py:fixture        # runlocal: the tiny qwen2 fixture

The weights load from model.hf_path (--config.model.hf_path=DIR to move it); until that
directory exists the preset 'qwen2.5-1.5b' supplies the same shapes, so `plan` works first.
Train with it: `jaxrl sft --config configs/qwen2p5_1p5b.py:sft --workdir runs/sft` then
`jaxrl grpo --config configs/qwen2p5_1p5b.py --config.init.checkpoint=runs/sft --workdir runs/grpo`.

arg: "" or "grpo" (actor + reference; sampler 64 slots x 2048 tokens), "sft" (no reference,
no generation), "fixture" (a GRPO pulse on tests/fixtures/hf/qwen2, runs on CPU in seconds).
"""

import os

from jaxrl.config import hf_model_config
from jaxrl.algorithms import grpo
from jaxrl.algorithms import sft

CHECKPOINT = "checkpoints/Qwen2.5-1.5B-Instruct"
FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                       "hf", "qwen2")


def get_config(arg=None):
  return hf_model_config(arg, preset="qwen2.5-1.5b", checkpoint=CHECKPOINT,
                         fixture=os.path.normpath(FIXTURE),
                         sft_config=sft.default_config, grpo_config=grpo.default_config)
