"""jaxrl's rollout engine decoding on one accelerator, against the HBM roofline and HF
`generate` on the same chip, in one run (issue 37 item 5; tools/gpu_check.sh runs it).

    python3 benchmarks/decode_gpu.py --out /tmp/decode --hf-python python3   # on a GPU
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/decode_gpu.py --shape tiny --batches 1,4 \
        --prompt 16 --new 8 --hbm-gbps 50 --out /tmp/decode                  # CPU smoke run

Model: the Qwen3-0.6B shape (jaxrl preset qwen3-0.6b; `--shape tiny`: tiny-qwen3) with random
weights, bfloat16 weights and compute, on one device. For each cache (dense, paged) and batch
size B, `jaxrl.sampler.generate` (Engine: prefill, insert, `--steps-per-call` decode steps per
jitted scan) makes exactly `--new` tokens for each of B prompts of `--prompt` tokens, sampling
at temperature 1.0 with no eos; the whole cache is allocated up front (grow_cache=False, one
decode compile). The decode attention is the one the backend picks for the platform (on GPU:
XLA over the dense cache, the Pallas paged kernel over pages unless JAXRL_GPU_PAGED=xla); the
JSON records jaxrl.backends.describe(). `--caches` also takes `paged:P` (pages of P positions;
16 by default) and `paged-xla[:P]` (XLA's gather path over the pages), for tuning the paged
cache on a GPU (tools/gpu_check.sh's `tune` stage). One warm-up call compiles; the figure is the best of
`--repeats` timed calls.

Columns per row:
  - tok/s: B x new over the whole call (prefill included);
  - decode tok/s: B x decode steps over the decode calls' seconds (Rollout.stats);
  - roofline tok/s: B over the roofline step, bytes / HBM bandwidth, where bytes are what one
    decode step must read: every weight once, plus the live keys and values of B sequences at
    the mean position of the decode (prompt + new / 2) over all layers;
  - of roofline: decode tok/s over roofline tok/s;
  - HF tok/s: HF transformers `generate` on the same shape, dtype, lengths and chip
    (benchmarks/peers/hf_generate_gpu.py under --hf-python, in its own process, run to its end
    before jax touches the chip, so the two never share its memory; XLA takes 75% of it at
    start), B x new over one timed call after a short warm-up;
  - vs HF: tok/s over HF tok/s.
The bandwidth comes from the device name (HBM_GBPS: vendors' datasheet figures) or
--hbm-gbps. A datasheet figure is a ceiling no copy reaches: on the device tool's H200 a
device-to-device copy moved about 4.3 TB/s of the 4.8 (its KINDS.md), so 90% of this roofline
is about as fast as reading the bytes can go. Results go to OUT/decode_gpu.json (rewritten after every row, so a run stopped
by a timeout keeps what it measured) and OUT/decode_gpu.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time
from unittest import mock

import jax
import numpy as np

# Datasheet HBM bandwidth in GB/s by a substring of jax's device_kind, first match wins.
HBM_GBPS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
            ("A100-SXM4-80GB", 2039.0), ("A100 80GB", 1935.0), ("A100", 1555.0))
SHAPES = {"qwen3-0.6b": "qwen3-0.6b", "tiny": "tiny-qwen3"}
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "hf_generate_gpu.py")
COLUMNS = ("cache", "batch", "tok_s", "decode_tok_s", "roofline_tok_s", "of_roofline",
           "hf_tok_s", "vs_hf")


def hbm_gbps(device_kind: str, override: float | None) -> float:
  if override:
    return override
  for name, gbps in HBM_GBPS:
    if name in device_kind:
      return gbps
  raise SystemExit(f"no HBM bandwidth is known for device {device_kind!r}: pass --hbm-gbps "
                   "(the chip's memory bandwidth in GB/s).")


def step_bytes(cfg, *, weight_bytes: int, batch: int, prompt: int, new: int) -> dict:
  """What one decode step reads: every weight, and the keys and values of `batch` sequences
  at the decode's mean position (prompt + new / 2), all layers, in the cache's dtype."""
  position = prompt + new / 2
  per_position = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim *
                  np.dtype(cfg.dtype).itemsize)  # keys and values
  kv = int(batch * position * per_position)
  return {"weight_bytes": weight_bytes, "kv_bytes": kv, "step_bytes": weight_bytes + kv,
          "mean_position": position}


def prompts_of(batch: int, length: int, seed: int) -> list[list[int]]:
  # The HF peer draws the same ids from the same seed.
  return np.random.default_rng(seed).integers(3, 259, size=(batch, length)).tolist()


def parse_cache(spec: str) -> tuple[str, int, bool]:
  """A --caches entry: "dense", "paged", "paged:P" (pages of P positions, default 16) or
  "paged-xla[:P]" (XLA's gather path instead of the backend's paged kernel,
  JAXRL_GPU_PAGED=xla) -> (kv_cache, page_size, xla)."""
  kind, _, size = spec.partition(":")
  if kind not in ("dense", "paged", "paged-xla") or (size and not size.isdigit()) or (
      size and kind == "dense"):
    raise SystemExit(f"--caches names {spec!r}: use dense, paged, paged:P or paged-xla[:P] "
                     "(P: positions per page), comma-separated.")
  return ("dense" if kind == "dense" else "paged"), int(size or 16), kind == "paged-xla"


def run_jaxrl(cfg, *, batches, caches, prompt, new, steps_per_call, repeats, seed, on_row):
  from jaxrl.backends import gpu as gpu_backend
  from jaxrl.parallel import init_params, make_mesh
  from jaxrl.sampler import Engine, SamplingParams, generate
  mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, params = init_params(cfg, mesh, "sampler", seed=seed)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  for B in batches:  # batch by batch, so a run stopped by a timeout has both caches' rows
    for cache in caches:
      prompts = prompts_of(B, prompt, seed)
      kv_cache, page_size, xla = parse_cache(cache)
      # An engine per row: the decode kernel is picked when its program is traced, and the
      # paged-xla rows trace with JAXRL_GPU_PAGED=xla set.
      engine = Engine(graphdef, cfg, mesh,
                      sampling=SamplingParams(temperature=1.0, max_new_tokens=new, eos_id=None))

      def call():
        with mock.patch.dict(os.environ, {gpu_backend.PAGED_ENV: "xla"} if xla else {}):
          return generate(engine, params, prompts, n=1, seed=seed, slots=B,
                          steps_per_call=steps_per_call, max_prompt_len=prompt,
                          grow_cache=False, kv_cache=kv_cache, page_size=page_size)

      t0 = time.perf_counter()
      call()  # compiles
      compile_s = time.perf_counter() - t0
      best = None
      for _ in range(repeats):
        t0 = time.perf_counter()
        r = call()
        dt = time.perf_counter() - t0
        if int(r.lengths.sum()) != B * new:
          raise SystemExit(f"{cache} batch {B}: {int(r.lengths.sum())} tokens, not {B * new}")
        if best is None or dt < best[0]:
          best = (dt, r.stats)
      dt, st = best
      on_row({"cache": cache, "batch": B, "seconds": dt, "tok_s": B * new / dt,
              "decode_steps": st["decode_steps"], "decode_s": st["decode_s"],
              "prefill_s": st["prefill_s"], "first_call_s": compile_s,
              "decode_tok_s": B * st["decode_steps"] / st["decode_s"],
              **step_bytes(cfg, weight_bytes=weight_bytes, batch=B, prompt=prompt, new=new)})
  return weight_bytes


def run_hf(python, cfg, *, batches, prompt, new, seed, timeout):
  """HF generate in its own interpreter: the peer's info line and {batch: row}."""
  spec = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "intermediate_size": cfg.mlp_dim, "tie_word_embeddings": cfg.tie_embeddings,
          "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
          "rms_norm_eps": cfg.norm_eps, "dtype": cfg.dtype,
          "batches": list(batches), "prompt": prompt, "new": new, "seed": seed}
  env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
  try:
    proc = subprocess.run([python, PEER, json.dumps(spec)], capture_output=True, text=True,
                          env=env, check=False, timeout=timeout)
    stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
  except OSError as e:
    raise SystemExit(f"--hf-python {python}: cannot run it ({e}).") from None
  except subprocess.TimeoutExpired as e:  # keep the batches it finished
    stdout, stderr, rc = (x.decode() if isinstance(x, bytes) else (x or "")
                          for x in (e.stdout, e.stderr, f"timeout after {timeout} s"))
  lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
  if not lines:
    raise SystemExit(f"benchmarks/peers/hf_generate_gpu.py failed under {python} (exit "
                     f"{rc}); it needs torch and transformers there. Its last output:\n"
                     f"{stderr[-2000:]}")
  info, rows = lines[0], {x["batch"]: x for x in lines[1:]}
  if rc:
    info["error"] = f"exit {rc}: {stderr[-500:]}"
  if info["params"] != cfg.num_params:
    raise SystemExit(f"the HF peer built {info['params']:,} parameters and jaxrl's "
                     f"{cfg.num_params:,}: the two models differ")
  return info, rows


def table(result) -> str:
  head = ("| cache | batch | tok/s | decode tok/s | roofline tok/s | of roofline | HF tok/s "
          "| vs HF |")
  out = [head, "|" + "---|" * 8]
  for r in result["rows"]:
    hf = "-" if r.get("hf_tok_s") is None else f"{r['hf_tok_s']:.0f}"
    vs = "-" if r.get("vs_hf") is None else f"{r['vs_hf']:.2f}x"
    out.append(f"| {r['cache']} | {r['batch']} | {r['tok_s']:.0f} | {r['decode_tok_s']:.0f} | "
               f"{r['roofline_tok_s']:.0f} | {r['of_roofline']:.1%} | {hf} | {vs} |")
  return "\n".join(out)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
  p.add_argument("--batches", default="1,16,64,256")
  p.add_argument("--caches", default="dense,paged",
                 help="comma list of dense, paged, paged:P (P positions per page, default 16), "
                      "paged-xla[:P] (XLA's gather path over the pages)")
  p.add_argument("--prompt", type=int, default=512)
  p.add_argument("--new", type=int, default=256)
  p.add_argument("--steps-per-call", type=int, default=32)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--hbm-gbps", type=float, default=None,
                 help="the chip's HBM bandwidth in GB/s (default: from the device name)")
  p.add_argument("--hf-python", default=None,
                 help="an interpreter with torch and transformers: HF generate side by side")
  p.add_argument("--hf-timeout", type=float, default=150.0,
                 help="seconds for the HF peer's whole run (the batches it finished are kept)")
  p.add_argument("--out", required=True, help="folder for decode_gpu.json and decode_gpu.md")
  args = p.parse_args(argv)
  batches = [int(b) for b in args.batches.split(",")]
  caches = args.caches.split(",")
  for c in caches:
    parse_cache(c)

  from jaxrl import backends
  from jaxrl.models import get_preset
  cfg = dataclasses.replace(get_preset(SHAPES[args.shape]), dtype=args.dtype,
                            param_dtype=args.dtype)
  hf = {}
  if args.hf_python:  # first: jax has not yet taken the chip's memory
    info, hf = run_hf(args.hf_python, cfg, batches=batches, prompt=args.prompt, new=args.new,
                      seed=args.seed, timeout=args.hf_timeout)
    print(f"HF generate: torch {info['torch']}, transformers {info['transformers']}, "
          f"{info['attention']} attention on {info['device']}: "
          + ", ".join(f"batch {b} {h['tokens'] / h['seconds']:.0f} tok/s" if "seconds" in h
                      else f"batch {b} {h.get('error')}" for b, h in hf.items()), flush=True)
  device = jax.devices()[0]
  gbps = hbm_gbps(device.device_kind, args.hbm_gbps)
  os.makedirs(args.out, exist_ok=True)
  result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "backend": backends.describe(), "shape": args.shape, "preset": SHAPES[args.shape],
            "params": cfg.num_params, "dtype": args.dtype, "prompt": args.prompt,
            "new": args.new, "steps_per_call": args.steps_per_call, "hbm_gbps": gbps,
            "rows": []}
  if args.hf_python:
    result["hf"] = {**info, "rows": list(hf.values())}
  print(f"{device.device_kind} ({device.platform}) | jax {jax.__version__} | {args.shape} "
        f"{cfg.num_params:,} params {args.dtype} | prompt {args.prompt} + {args.new} new | HBM "
        f"{gbps:.0f} GB/s | attention {result['backend'].get('attention', '?')}", flush=True)

  def save():
    with open(os.path.join(args.out, "decode_gpu.json"), "w") as f:
      json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "decode_gpu.md"), "w") as f:
      f.write(f"{result['date']}, {result['device']}, jax {result['jax']}, {args.shape} "
              f"({cfg.num_params:,} params, {args.dtype}), prompt {args.prompt} + "
              f"{args.new} new, HBM {gbps:.0f} GB/s\n\n{table(result)}\n")

  def on_row(row):
    roofline_s = row["step_bytes"] / (gbps * 1e9)
    row["roofline_tok_s"] = row["batch"] / roofline_s
    row["of_roofline"] = row["decode_tok_s"] / row["roofline_tok_s"]
    h = hf.get(row["batch"], {})
    row["hf_tok_s"] = h["tokens"] / h["seconds"] if "seconds" in h else None
    row["vs_hf"] = None if row["hf_tok_s"] is None else row["tok_s"] / row["hf_tok_s"]
    result["rows"].append(row)
    print(f"{row['cache']:>5} batch {row['batch']:4d}: {row['tok_s']:9.0f} tok/s, decode "
          f"{row['decode_tok_s']:9.0f} tok/s, roofline {row['roofline_tok_s']:9.0f} "
          f"({row['of_roofline']:.1%}), first call {row['first_call_s']:.1f} s", flush=True)
    save()

  run_jaxrl(cfg, batches=batches, caches=caches, prompt=args.prompt, new=args.new,
            steps_per_call=args.steps_per_call, repeats=args.repeats, seed=args.seed,
            on_row=on_row)
  if not hf:
    print("no --hf-python: HF generate not run, its columns are empty")
  save()
  print(table(result))
  return result


if __name__ == "__main__":
  main()
