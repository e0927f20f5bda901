"""HF transformers `generate` on a Qwen3-shaped model: the peer side of
`benchmarks/decode_gpu.py --hf-python PY`, which runs this file under PY.

PY is an interpreter with PyTorch and transformers (never a jaxrl dependency; on the GPU image
the plain `python3` holds both). argv[1] is JSON from decode_gpu.py: the model's sizes (read
from the jaxrl preset), "dtype" (bfloat16 or float32), "batches", "prompt", "new" and "seed".
The model is built from a seeded Qwen3Config with random weights (no download), on the GPU
(cuda) if torch sees one, else on the CPU. For each batch size it runs one short warm-up
`generate` and one timed call on the same prompts decode_gpu.py gives jaxrl (uniform ids in
[3, 259) from the seed), sampling at temperature 1.0 with top-k and top-p off and no eos, so
every row gets exactly `new` tokens.
Prints one JSON line when the model is built, then one per batch size:
{"batch": B, "seconds": ..., "tokens": ...}; an out-of-memory batch prints "error" instead.
"""

import json
import sys
import time

import numpy as np
import torch
import transformers
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

MODEL_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings",
              "max_position_embeddings", "rms_norm_eps")


def build(spec, device):
  kw = {k: spec[k] for k in MODEL_KEYS}
  # transformers 5 moved rope_theta into rope_parameters; 4.x takes it as a keyword.
  if int(transformers.__version__.split(".")[0]) >= 5:
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": spec["rope_theta"]}
  else:
    kw["rope_theta"] = spec["rope_theta"]
  config = Qwen3Config(**kw, pad_token_id=0, eos_token_id=None, bos_token_id=None)
  torch.manual_seed(spec["seed"])
  with torch.device(device):  # born on the device: no host copy of the weights
    model = Qwen3ForCausalLM(config)
  return model.to(dtype=getattr(torch, spec["dtype"])).eval()


def main():
  spec = json.loads(sys.argv[1])
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = build(spec, device)
  params = sum(p.numel() for p in model.parameters())
  print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                    "params": params, "attention": model.config._attn_implementation,
                    "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}),
        flush=True)

  def sync():
    if device == "cuda":
      torch.cuda.synchronize()

  for batch in spec["batches"]:
    rng = np.random.default_rng(spec["seed"])
    ids = torch.tensor(rng.integers(3, 259, size=(batch, spec["prompt"])), dtype=torch.long,
                       device=device)
    try:
      with torch.inference_mode():
        for new in (min(8, spec["new"]), spec["new"]):  # warm-up, then the timed call
          # top_k=0 is "off" in HF as in jaxrl; the model's default generation config uses 50.
          gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                                 pad_token_id=0)
          sync()
          t = time.perf_counter()
          out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
          sync()
          seconds = time.perf_counter() - t
    except torch.OutOfMemoryError as e:
      print(json.dumps({"batch": batch, "error": f"out of memory: {str(e)[:200]}"}), flush=True)
      torch.cuda.empty_cache()
      continue
    tokens = int((out.shape[1] - ids.shape[1]) * batch)
    print(json.dumps({"batch": batch, "seconds": seconds, "tokens": tokens}), flush=True)


if __name__ == "__main__":
  main()
