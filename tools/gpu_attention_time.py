"""The learner's attention paths on a GPU, timed: forward + the three gradients of Pallas
(Triton) flash attention, cuDNN's fused attention and XLA's attention, on one shape, in one run.
tools/gpu_check.sh runs it (stage `tune`); it answers docs/guides/kernels.md's open question,
which of Pallas and cuDNN the learner should default to on a GPU.

    python3 tools/gpu_attention_time.py                        # on a GPU: Qwen3-0.6B's heads
    JAX_PLATFORMS=cpu .venv/bin/python tools/gpu_attention_time.py --interpret --batch 1 \
        --seq 64 --heads 4 --kv-heads 2 --head-dim 32 --paths pallas,xla --repeats 1   # smoke

Shape (defaults): 4 rows of 2,048 positions, 16 query and 8 KV heads of 128 (Qwen3-0.6B's
attention), bfloat16, causal, no packing (cuDNN through jax.nn takes no segment ids). Each path
is jax.jit(value_and_grad) of sum(out * cot) over q, k and v; the figure is the median of
--repeats timed calls after one that compiles. Model TFLOP/s counts the causal forward's two
products (2 x 2 x B x heads x T^2 / 2 x head_dim) and the backward as twice the forward, so
the three paths are read against the same work (a flash kernel's recompute is not counted).
Prints one line per path; --out writes them as JSON too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def attention_fns(interpret: bool):
  """{path: fn(q [B, T, K, G, H], keys [B, K, T, H], values) -> [B, T, K, G, H]}."""
  from jaxrl.backends.gpu.attention import cudnn_attention, pallas_attention
  from jaxrl.models.attention import xla_attention

  def xla(q, k, v):
    T = q.shape[1]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (q.shape[0], T, T))
    return xla_attention(q, k, v, mask)

  return {"pallas": lambda q, k, v: pallas_attention(q, k, v, interpret=interpret),
          "cudnn": cudnn_attention, "xla": xla}


def model_flops(B, T, heads, head_dim) -> float:
  forward = 2 * 2 * B * heads * (T * T / 2) * head_dim
  return 3 * forward


def time_path(fn, args, cot, repeats: int) -> dict:
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * cot)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  t0 = time.perf_counter()
  jax.block_until_ready(step(*args))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(time.perf_counter() - t0)
  return {"ms": 1e3 * statistics.median(times), "first_call_s": compile_s}


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser()
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--paths", default="pallas,cudnn,xla")
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--interpret", action="store_true",
                 help="Pallas's interpreter (CPU smoke runs; times mean nothing there)")
  p.add_argument("--out", default=None, help="a JSON file for the rows")
  args = p.parse_args(argv)
  if args.heads % args.kv_heads:
    raise SystemExit(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}.")
  fns = attention_fns(args.interpret)
  paths = args.paths.split(",")
  for path in paths:
    if path not in fns:
      raise SystemExit(f"--paths names {path!r}: use some of {', '.join(fns)}.")
  B, T, K, H = args.batch, args.seq, args.kv_heads, args.head_dim
  G = args.heads // K
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  q = jnp.asarray(rng.standard_normal((B, T, K, G, H)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((B, K, T, H)), dtype) for _ in range(2))
  cot = jnp.asarray(rng.standard_normal((B, T, K, G, H)), jnp.float32)
  flops = model_flops(B, T, args.heads, H)
  device = jax.devices()[0]
  print(f"{device.device_kind} | jax {jax.__version__} | B {B} T {T} heads {args.heads} / "
        f"{K} kv x {H} {args.dtype}, causal, forward + gradients", flush=True)
  rows = []
  for path in paths:
    try:
      r = time_path(fns[path], (q, k, v), cot, args.repeats)
    except Exception as e:  # one path failing must not hide the others' figures
      print(f"{path:>7s}: failed: {type(e).__name__}: {str(e)[:500]}", flush=True)
      rows.append({"path": path, "error": f"{type(e).__name__}: {str(e)[:500]}"})
      continue
    r.update(path=path, tflops=flops / (r["ms"] / 1e3) / 1e12)
    rows.append(r)
    print(f"{path:>7s}: {r['ms']:8.2f} ms  {r['tflops']:7.1f} model TFLOP/s  (first call "
          f"{r['first_call_s']:.1f} s)", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"device": device.device_kind, "jax": jax.__version__, "batch": B, "seq": T,
                 "heads": args.heads, "kv_heads": K, "head_dim": H, "dtype": args.dtype,
                 "rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  sys.exit(0 if all("error" not in r for r in main()) else 1)
