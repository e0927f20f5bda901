"""TRL's GRPOTrainer on the GRPO peer-anchor shape, timed per step and per phase: the peer
side of `benchmarks/grpo_step.py --trl-python PY`, which runs this file under PY.

PY is a separate interpreter with TRL and PyTorch (never a jaxrl dependency), for example:
    python3.11 -m venv /tmp/peer && /tmp/peer/bin/pip install torch==2.13.0 trl==1.16.0

The shape comes as JSON in argv[2] from grpo_step.py's anchor_spec(), read from jaxrl's own
anchor config: on the anchor, a Qwen2-style model of 4,487,424 parameters (vocab 512, width 256,
6 layers, 4 query heads, 2 KV heads, head_dim 64, MLP 688, tied embeddings, created here from a
seeded config with no download), 8 prompts of 16 tokens x 8 generations, exactly 64 completion
tokens (min_new_tokens = max_completion_length), beta 0.04 with a reference model, fp32, one
generation and one optimizer step per step. Prompts are random word-level tokens; the reward is
a cheap function of the text, so scoring costs what TRL's own bookkeeping costs.

Prints one line of JSON: the median step time and the medians of the phases, measured by
wrapping the trainer's own methods: gen (`_generate`), score_ref (the rest of
`_generate_and_score_completions`: rewards, advantages and the reference forward) and update
(the rest of the step: the policy's forward, backward and optimizer step).
"""

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          TrainerCallback)
from trl import GRPOConfig, GRPOTrainer


class TimedGRPOTrainer(GRPOTrainer):
  phases: dict = {"gen": [], "gen_score_ref": []}

  def _generate(self, *a, **k):
    t = time.perf_counter()
    out = super()._generate(*a, **k)
    self.phases["gen"].append(time.perf_counter() - t)
    return out

  def _generate_and_score_completions(self, *a, **k):
    t = time.perf_counter()
    out = super()._generate_and_score_completions(*a, **k)
    self.phases["gen_score_ref"].append(time.perf_counter() - t)
    return out


class StepTimer(TrainerCallback):
  def __init__(self):
    self.start, self.steps = None, []

  def on_step_begin(self, *a, **k):
    self.start = time.perf_counter()

  def on_step_end(self, *a, **k):
    self.steps.append(time.perf_counter() - self.start)


def main():
  steps, spec = int(sys.argv[1]), json.loads(sys.argv[2])
  model_keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings",
                "max_position_embeddings", "rope_theta", "rms_norm_eps")
  words = spec["vocab_size"] - 2
  vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i + 2 for i in range(words)}}
  word_level = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>",
                                      eos_token="<eos>")
  tokenizer.padding_side = "left"
  torch.manual_seed(0)
  config = Qwen2Config(**{k: spec[k] for k in model_keys}, pad_token_id=0, eos_token_id=1,
                       bos_token_id=1)
  model = Qwen2ForCausalLM(config)
  n_params = sum(p.numel() for p in model.parameters())
  g = torch.Generator().manual_seed(1)
  prompts = [" ".join(f"t{int(x)}" for x in torch.randint(0, words, (spec["prompt_tokens"],),
                                                           generator=g))
             for _ in range(spec["prompts"] * (steps + 2))]

  def reward(completions, **_):
    return [float(len(c.split()) % 7) for c in completions]

  timer = StepTimer()
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "model")
    model.save_pretrained(path)  # TRL builds the reference model from the policy's path
    tokenizer.save_pretrained(path)
    n, t = spec["prompts"] * spec["generations"], spec["completion_tokens"]
    args = GRPOConfig(output_dir=os.path.join(d, "out"), per_device_train_batch_size=n,
                      num_generations=spec["generations"], max_completion_length=t,
                      generation_kwargs={"min_new_tokens": t}, beta=spec["beta"],
                      max_steps=steps + 1, learning_rate=1e-5, logging_steps=1,
                      report_to="none", bf16=False, fp16=False, use_cpu=True,
                      save_strategy="no", seed=0, disable_tqdm=True)
    trainer = TimedGRPOTrainer(model=path, reward_funcs=reward, args=args,
                               train_dataset=Dataset.from_dict({"prompt": prompts}),
                               processing_class=tokenizer, callbacks=[timer])
    trainer.train()
  lengths = [h["completions/mean_length"] for h in trainer.state.log_history
             if "completions/mean_length" in h]
  ph = trainer.phases
  # Step 0 (warm-up) is dropped, as in grpo_step.py.
  step = timer.steps[1:]
  gen = ph["gen"][1:]
  score_ref = [a - b for a, b in zip(ph["gen_score_ref"][1:], gen)]
  update = [s - a for s, a in zip(step, ph["gen_score_ref"][1:])]
  med = statistics.median
  print(json.dumps({"trl": trl.__version__, "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "threads": torch.get_num_threads(), "params": n_params,
                    "completion_length": lengths[-1], "steps": len(step),
                    "step": med(step), "gen": med(gen), "score_ref": med(score_ref),
                    "update": med(update)}))


if __name__ == "__main__":
  main()
