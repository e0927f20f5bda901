"""The paged KV cache's bytes against the dense cache's, and what a pool below the worst case
costs in decode steps and preemptions (issue 37's memory target: at most 0.35x dense).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/paged_memory.py [--pages 1075,1024]

The scenario is issue 37's GRPO rollout: 8 prompts x G = 8 samples, 512-token prompts, 256 new
tokens, pages of 16, 64 slots (every sample live at once when the pool allows).

1. Bytes, for Qwen3-0.6B's shape in float32 (28 layers, 8 KV heads of 128): XLA's memory
   analysis of the jitted init of each decode state (compiled on one CPU device, not run): the
   dense cache, 64 slots x 768 positions per layer, against a pool of N pages of 16 for N = the
   worst case (8 x 32 shared prompt pages + 64 x 16 own: what "reserve" admission needs to
   keep all 64 samples live) and each pool of --pages.
2. Cost, end to end on this CPU at the same shape on the tiny preset (2 layers, 2 KV heads of
   32, vocabulary 512, random weights, so the rollout runs in seconds): the dense rollout, then
   the paged one with "reserve" admission at the worst-case pool and with either admission at
   each pool of --pages, each checked against the dense one token for token (log-probs within
   2e-5). Two completion-length regimes: "eos" (stop at the tiny model's eos, about 1 in 512
   tokens at temperature 1, so some completions end early) and "full" (no stop: every
   completion runs to 256 tokens, the worst case for a small pool).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def state_bytes(cfg, *, slots, max_len, pages=None, page_size=16) -> int:
  """XLA's output bytes of the jitted init of a dense (pages None) or paged decode state."""
  from jaxrl.models import abstract_model
  from jaxrl.parallel import make_mesh
  from jaxrl.sampler import Engine, SamplingParams
  mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  engine = Engine(abstract_model(cfg)[0], cfg, mesh, sampling=SamplingParams())
  if pages is None:
    init = engine._init_fn(slots, max_len)
  else:
    init = engine._paged_init_fn(slots, -(-max_len // page_size), pages, page_size)
  compiled = init.lower(jax.ShapeDtypeStruct((), jnp.int32)).compile()
  return compiled.memory_analysis().output_size_in_bytes


def rollouts(args, pools):
  """The tiny preset's dense rollout and its paged ones; a dict per run."""
  from jaxrl.models import get_preset
  from jaxrl.parallel import init_params, make_mesh
  from jaxrl.sampler import Engine, SamplingParams, generate
  mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  cfg = get_preset("tiny")
  graphdef, params = init_params(cfg, mesh, "sampler", seed=0)
  rng = np.random.default_rng(0)
  prompts = [[1] + rng.integers(3, cfg.vocab_size, args.prompt - 1).tolist()
             for _ in range(args.prompts)]
  rows = []
  for regime in ("eos", "full"):
    sp = SamplingParams(max_new_tokens=args.new, eos_id=2 if regime == "eos" else None)
    engine = Engine(graphdef, cfg, mesh, sampling=sp)
    common = dict(n=args.group, slots=args.prompts * args.group, seed=1, steps_per_call=8)
    runs = [("dense", None, None), ("paged", pools[0], "reserve")] + [
        ("paged", p, a) for p in pools[1:] for a in ("optimistic", "reserve")]
    dense = None
    for kv_cache, pages, admission in runs:
      extra = {} if kv_cache == "dense" else dict(kv_cache="paged", kv_pages=pages,
                                                  page_size=args.page, kv_admission=admission)
      generate(engine, params, prompts, **common, **extra)  # compiles
      t0 = time.perf_counter()
      out = generate(engine, params, prompts, **common, **extra)
      wall = time.perf_counter() - t0
      st = out.stats
      row = {"regime": regime, "kv_cache": kv_cache, "pages": pages, "admission": admission,
             "decode_steps": st["decode_steps"], "live_peak": st["live_peak"],
             "preemptions": st.get("kv_preemptions", 0),
             "preempted_tokens": st.get("kv_preempted_tokens", 0),
             "pages_peak": st.get("kv_pages_peak"), "prefill_calls": st["prefill_calls"],
             "tokens": st["tokens_generated"], "wall_s": round(wall, 2),
             "mean_length": float(out.lengths.mean())}
      if dense is None:
        dense = out
      else:
        row["same_as_dense"] = bool(
            np.array_equal(out.completion_ids, dense.completion_ids)
            and np.array_equal(out.lengths, dense.lengths)
            and np.abs(out.logprobs - dense.logprobs).max() <= 2e-5)
      print(json.dumps(row), flush=True)
      rows.append(row)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen3-0.6b", help="the shape the bytes are taken for")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--new", type=int, default=256)
  ap.add_argument("--page", type=int, default=16)
  ap.add_argument("--pages", default="1075,1024", help="the smaller pools, comma-separated")
  ap.add_argument("--skip-rollouts", action="store_true")
  args = ap.parse_args()

  from jaxrl.models import get_preset
  cfg = dataclasses.replace(get_preset(args.preset), dtype="float32", param_dtype="float32")
  slots = args.prompts * args.group
  max_len = args.prompt + args.new
  worst = (args.prompts * (args.prompt // args.page)
           + slots * -(-(max_len - args.prompt // args.page * args.page) // args.page))
  pools = [worst] + [int(p) for p in args.pages.split(",") if p]
  dense = state_bytes(cfg, slots=slots, max_len=max_len)
  out = {"preset": args.preset, "slots": slots, "max_len": max_len, "page_size": args.page,
         "dense_bytes": dense, "pools": []}
  print(f"dense: {slots} x {max_len} positions, {dense / 1e9:.2f} GB", flush=True)
  for pages in pools:
    b = state_bytes(cfg, slots=slots, max_len=max_len, pages=pages, page_size=args.page)
    out["pools"].append({"pages": pages, "bytes": b, "of_dense": b / dense})
    print(f"paged: {pages} pages, {b / 1e9:.2f} GB, {b / dense:.3f}x dense", flush=True)
  if not args.skip_rollouts:
    out["rollouts"] = rollouts(args, pools)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
