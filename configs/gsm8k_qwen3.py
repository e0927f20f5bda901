"""GSM8K on a Qwen3 instruct checkpoint: optional SFT, then GRPO with the gsm8k reward.

The data is GSM8K as distributed (Parquet, columns `question` and `answer`, the answer
"rationale\\n#### N"); data.fields maps question -> prompt (and, for SFT, answer -> completion).
Prompts are chat-templated with the checkpoint's template (Qwen3's thinking turned off). The
reward is `gsm8k` (the final number against the record's `#### N`) plus 0.1 x `gsm8k_format`;
every eval.every steps GRPO scores data.eval_file greedily and with eval.n samples (pass@k).
jaxrl never downloads: fetch the checkpoint and the data once, on a machine with network access
(docs/guides/instruct-grpo.md), to checkpoints/Qwen3-0.6B and data/gsm8k/{train,test}.parquet.

    jaxrl sft  --config configs/gsm8k_qwen3.py:sft --workdir runs/gsm8k_sft        # optional
    jaxrl grpo --config configs/gsm8k_qwen3.py --config.init.checkpoint=runs/gsm8k_sft \
        --workdir runs/gsm8k_grpo
    jaxrl eval --config configs/gsm8k_qwen3.py --checkpoint runs/gsm8k_grpo

Move the inputs with --config.model.hf_path=DIR, --config.data.train_file=F and
--config.data.eval_file=F. On CPU, in seconds, on the committed tiny checkpoint
tests/fixtures/hf/qwen3 and a Parquet from jaxrl.data.files.write_gsm8k_fixture:

    python -c "from jaxrl.data.files import write_gsm8k_fixture as w; w('/tmp/gsm8k')"
    jaxrl sft  --config configs/gsm8k_qwen3.py:sft_fixture --workdir /tmp/gsm8k_sft
    jaxrl grpo --config configs/gsm8k_qwen3.py:fixture --config.init.checkpoint=/tmp/gsm8k_sft \
        --workdir /tmp/gsm8k_grpo

arg: "" or "grpo" (GRPO, 8 chips, bf16 compute, full remat, chunked log-probs), "sft" (the SFT
stage), "fixture" / "sft_fixture" (the same on the tiny fixture and /tmp/gsm8k, on CPU; for
data written elsewhere, give both stages --config.data.train_file=DIR/train.parquet
--config.data.eval_file=DIR/test.parquet).
"""

import os
import tempfile

from jaxrl.config import hf_model_config
from jaxrl.algorithms import grpo
from jaxrl.algorithms import sft

CHECKPOINT = "checkpoints/Qwen3-0.6B"
DATA = "data/gsm8k"
# Where the docstring's write_gsm8k_fixture call writes: /tmp/gsm8k (TMPDIR's when it is set).
FIXTURE_DATA = os.path.join(tempfile.gettempdir(), "gsm8k")
FIXTURE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "tests", "fixtures", "hf", "qwen3"))
ARGS = ("", "grpo", "sft", "fixture", "sft_fixture")


def get_config(arg=None):
  arg = arg or ""
  if arg not in ARGS:
    raise ValueError(f"unknown arg {arg!r}: use '', 'grpo', 'sft', 'fixture' or 'sft_fixture'")
  is_sft, fixture = arg.startswith("sft"), arg.endswith("fixture")
  # The model, the 8-chip layout and the memory plan of configs/qwen3_0p6b.py.
  c = hf_model_config("sft" if is_sft else ("fixture" if fixture else "grpo"),
                      preset="qwen3-0.6b", checkpoint=CHECKPOINT, fixture=FIXTURE,
                      sft_config=sft.default_config, grpo_config=grpo.default_config)
  data = FIXTURE_DATA if fixture else DATA
  c.data.update(task="", train_file=f"{data}/train.parquet", eval_file=f"{data}/test.parquet",
                chat=True, chat_template_kwargs={"enable_thinking": False})
  # Memory (docs/guides/memory.md): recompute each decoder block in the backward and apply the
  # LM head to 128 positions at a time (Qwen3's 151,936-word vocabulary).
  c.model.update(remat="full", logits_chunk=128)
  if is_sft:
    # The SFT stage imitates GSM8K's rationales, "... #### N", which the gsm8k reward reads.
    c.data.fields = {"question": "prompt", "answer": "completion"}
    c.data.update(seq_len=512, batch_size=64)
    c.train.update(steps=500, log_every=10, save_every=100)
    c.eval.update(every=100, examples=256, max_new_tokens=256)
    if fixture:
      c.model.hf_path = FIXTURE
      c.model.param_dtype = c.model.dtype = "float32"
      c.model.update(remat="none", logits_chunk=0)
      c.mesh.fsdp, c.mesh.tensor = -1, 1
      c.data.update(seq_len=64, batch_size=16)
      c.optim.update(lr=1e-3, warmup_steps=2)
      c.train.update(steps=10, log_every=5, save_every=10)
      c.eval.update(every=10, examples=16, batch_size=16, max_new_tokens=12)
      c.plan.device = ""
    return c
  # GRPO: the answer column stays `answer`, which the gsm8k reward reads ("#### N").
  c.data.fields = {"question": "prompt"}
  c.rewards = "gsm8k:1.0,gsm8k_format:0.1"
  # GSM8K questions run to ~200 tokens templated; rationales to ~300: 256 + 512 per sequence.
  c.rollout.update(prompts_per_step=32, group_size=8, max_new_tokens=512, slots=64)
  if not fixture:
    c.plan.max_len = c.plan.seq_len = 768
  c.train.update(steps=200, log_every=5, save_every=50)
  # Held-out: greedy accuracy and pass@1/4/8 of 8 samples at temperature 1 on data.eval_file.
  c.eval.update(every=25, examples=256, reward="gsm8k", n=8, k=(1, 4, 8), temperature=1.0,
                spot_check=8)
  if fixture:  # hf_model_config's fixture pulse: float32, any device count, 2 steps
    c.model.update(remat="none", logits_chunk=0)
    c.rollout.update(prompts_per_step=4, group_size=4, max_new_tokens=12, slots=16)
    c.train.update(steps=2, log_every=1, save_every=2)
    c.eval.update(every=2, batch_size=8, n=4, k=(1, 4), spot_check=2)
  return c
