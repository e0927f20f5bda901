"""Cached decoding against recomputing the whole sequence, side by side, in one run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/decode.py

Both paths decode greedily the same number of tokens from the same prompts on the same mesh;
the baseline runs a full-sequence forward over the growing sequence for every new token (what a
model without a KV cache must do). Prints tokens/s for each and the ratio. Compile time is
excluded (one warm-up pass each).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import apply, get_preset, init_cache
from jaxrl.parallel import cache_sharding, describe, init_params, make_mesh


def bench(preset: str, batch: int, prompt_len: int, new: int, mesh) -> tuple[float, float]:
  cfg = get_preset(preset)
  graphdef, params = init_params(cfg, mesh, "sampler")
  prompts = jax.random.randint(jax.random.key(0), (batch, prompt_len), 3, 259)
  S = prompt_len + new

  @jax.jit
  def prefill(params, tokens, cache):
    logits, cache = apply(graphdef, params, tokens, jnp.broadcast_to(jnp.arange(prompt_len),
                                                                     tokens.shape), cache=cache)
    return jnp.argmax(logits[:, -1], -1), cache

  def step(params, tok, pos, cache):
    logits, cache = apply(graphdef, params, tok[:, None], jnp.full((batch, 1), pos), cache=cache)
    return jnp.argmax(logits[:, 0], -1), cache

  step = jax.jit(step, donate_argnums=3)

  def cached():
    cache = jax.device_put(init_cache(cfg, batch, S),
                           [cache_sharding(mesh, cfg, batch, S)] * cfg.num_layers)
    tok, cache = prefill(params, prompts, cache)
    for i in range(new - 1):
      tok, cache = step(params, tok, prompt_len + i, cache)
    return jax.block_until_ready(tok)

  # Baseline: a fixed-size buffer (so it compiles once) and a full forward per new token.
  @jax.jit
  def full_step(params, seq, n):
    logits, _ = apply(graphdef, params, seq)
    nxt = jnp.argmax(jnp.take(logits, n - 1, axis=1), -1)
    return seq.at[:, n].set(nxt)

  def recompute():
    seq = jnp.zeros((batch, S), jnp.int32).at[:, :prompt_len].set(prompts)
    for n in range(prompt_len, S):
      seq = full_step(params, seq, n)
    return jax.block_until_ready(seq)

  out = []
  for fn in (cached, recompute):
    fn()  # compile
    t0 = time.perf_counter()
    fn()
    out.append(batch * new / (time.perf_counter() - t0))
  return out[0], out[1]


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--presets", default="tiny,small")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=64)
  p.add_argument("--new", type=int, default=64)
  args = p.parse_args()
  mesh = make_mesh(data=1, fsdp=-1, tensor=min(4, jax.device_count()))
  print(f"jax {jax.__version__} | {describe(mesh)} | batch {args.batch}, prompt "
        f"{args.prompt_len}, {args.new} new tokens")
  print(f"{'preset':8s} {'kv-cache tok/s':>15s} {'recompute tok/s':>16s} {'ratio':>7s}")
  for preset in args.presets.split(","):
    c, r = bench(preset, args.batch, args.prompt_len, args.new, mesh)
    print(f"{preset:8s} {c:15.0f} {r:16.0f} {c / r:6.1f}x")


if __name__ == "__main__":
  main()
