"""HF transformers `generate` on the sampler benchmark's shape: the peer side of
`benchmarks/sampler.py --hf-python PY`, which runs this file under PY.

PY is a separate interpreter with PyTorch and transformers (never a jaxrl dependency), e.g.
    python3.11 -m venv /tmp/peer && /tmp/peer/bin/pip install torch==2.13.0 transformers

The model's sizes come as JSON in argv[1] from sampler.py, read from jaxrl's `bench` preset: a
Qwen2 model (fp32, random weights from a seeded config, no download). The process stays up for
the whole benchmark so that sampler.py can alternate its own timed calls with this one's in the
same minutes of a shared machine: it prints one JSON line when the model is built, then answers
each request line on stdin, {"prompts": [[ids], ...], "new": N}, with one JSON line
{"seconds": ..., "tokens": ...}: one `generate` call, timed alone, sampling at temperature 1.0
with top-k and top-p off (as jaxrl's SamplingParams) and no eos, so every row gets exactly N new
tokens. The first request of a batch size is its warm-up; sampler.py discards it.
"""

import json
import sys
import time

import torch
import transformers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

MODEL_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings",
              "max_position_embeddings", "rope_theta", "rms_norm_eps")


def main():
  spec = json.loads(sys.argv[1])
  torch.manual_seed(0)
  model = Qwen2ForCausalLM(Qwen2Config(**{k: spec[k] for k in MODEL_KEYS}, pad_token_id=0,
                                       eos_token_id=None, bos_token_id=None)).eval()
  params = sum(p.numel() for p in model.parameters())
  print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                    "threads": torch.get_num_threads(), "params": params,
                    "attention": model.config._attn_implementation}), flush=True)
  for line in sys.stdin:
    req = json.loads(line)
    ids = torch.tensor(req["prompts"], dtype=torch.long)
    # top_k=0 is "off" in HF as in jaxrl; the model's default generation config would use 50.
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=req["new"], eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
      t = time.perf_counter()
      out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
      seconds = time.perf_counter() - t
    new = out.shape[1] - ids.shape[1]
    print(json.dumps({"seconds": seconds, "tokens": int(new * ids.shape[0])}), flush=True)


if __name__ == "__main__":
  main()
