"""Llama-3.2-1B-Instruct from a local Hugging Face checkpoint: model and 8-chip memory plan.

Fetch the checkpoint once, on a machine with network access (jaxrl itself never downloads):
    huggingface-cli download meta-llama/Llama-3.2-1B-Instruct \
        --local-dir checkpoints/Llama-3.2-1B-Instruct
Then (8 fake CPU devices stand in for a v5e-8 / v6e-8 slice when planning on a laptop):
    export XLA_FLAGS=--xla_force_host_platform_device_count=8
    jaxrl plan --config configs/llama3p2_1b.py                 # GRPO on a v5e-8
    jaxrl plan --config configs/llama3p2_1b.py:sft --config.plan.device=tpu-v6e
    jaxrl model --config configs/llama3p2_1b.py:fixture        # runlocal: the tiny llama fixture

The weights load from model.hf_path (--config.model.hf_path=DIR to move it); until that
directory exists the preset 'llama-3.2-1b' supplies the same shapes, so `plan` works first. The
SFT and GRPO trainers add their own sections to this config when they land.

arg: "" or "grpo" (actor + reference; sampler 64 slots x 2048 tokens), "sft" (no reference,
no generation), "fixture" (tests/fixtures/hf/llama, runs on CPU in seconds).
"""

import os

from jaxrl.config import base_config
from jaxrl.parallel.plan import plan_config
from jaxrl.parallel.sync import placement_config

CHECKPOINT = "checkpoints/Llama-3.2-1B-Instruct"
FIXTURE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                         "fixtures", "hf", "llama"))


def get_config(arg=None):
  c = base_config()
  c.model.preset = "llama-3.2-1b"
  c.model.hf_path = CHECKPOINT
  # fp32 master weights (and Adam state) on the learner; the sampler gets a bf16 copy.
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16"
  c.mesh.fsdp = 8  # learner: FSDP over the 8 chips (heads 32, kv heads 8)
  c.placement = placement_config()
  c.placement.sampler_mesh.data, c.placement.sampler_mesh.tensor = 4, 2
  c.placement.sync_dtype = "bfloat16"
  c.plan = plan_config()
  c.plan.device = "tpu-v5e"
  c.plan.slots, c.plan.max_len = 64, 2048  # 512 prompt + 1536 completion tokens
  # One 2048-token sequence per chip per micro-step: the fp32 logits over a 128k-152k vocabulary
  # dominate activations (2.5 GiB at micro_batch=1, 10 GiB at 4).
  c.plan.micro_batch, c.plan.seq_len = 1, 2048
  c.plan.remat = True  # without recomputation activations alone need ~14 GiB per chip
  if arg == "sft":
    c.plan.reference = False
    c.plan.slots, c.plan.max_len = 8, 8  # SFT does not generate: a minimal sampler side
  elif arg == "fixture":
    c.model.hf_path = FIXTURE
    c.model.param_dtype = c.model.dtype = "float32"
    c.mesh.fsdp, c.mesh.tensor = -1, 1
    c.placement.sampler_mesh.data, c.placement.sampler_mesh.tensor = -1, 1
    c.plan.device = ""
    c.plan.slots, c.plan.max_len, c.plan.micro_batch, c.plan.seq_len = 8, 64, 2, 64
  elif arg not in (None, "", "grpo"):
    raise ValueError(f"unknown arg {arg!r}: use '', 'grpo', 'sft' or 'fixture'")
  return c
