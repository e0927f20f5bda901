"""Would streaming the reference forward during decoding shorten a GRPO step? The probe behind
benchmarks/README.md's answer (no, on CPU).

    .venv/bin/python benchmarks/ref_overlap.py                      # one CPU device
    XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python benchmarks/ref_overlap.py

On the anchor's shape (bench preset, 64 slots, 16 decode steps per call) it times one decode
call, one cached reference forward over a 16-token chunk of all 64 rows (the chunk a streamed
reference would run after each decode call), and the two dispatched together: the reference
on the last device, decoding on the first. With one device both land on the same device and run
one after the other; with two they may overlap. Streaming pays only if the chunks' cost beyond
the overlap is below the batched reference forward's (benchmarks/grpo_step.py's ref s).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.backends.cpu import allocator
from jaxrl.models import get_preset, init_cache, token_logprobs
from jaxrl.parallel import init_params, make_mesh
from jaxrl.sampler import Engine, SamplingParams


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--slots", type=int, default=64)
  p.add_argument("--chunk", type=int, default=16)
  p.add_argument("--cache", type=int, default=96, help="cache positions (prompt + completion)")
  p.add_argument("--repeats", type=int, default=8)
  args = p.parse_args()
  allocator.ensure()
  B, T, S = args.slots, args.chunk, args.cache
  cfg = get_preset("bench")
  devices = jax.devices()
  mesh = make_mesh(1, 1, 1, devices=devices[:1])
  graphdef, params = init_params(cfg, mesh, "sampler", seed=0)
  engine = Engine(graphdef, cfg, mesh,
                  sampling=SamplingParams(temperature=1.0, max_new_tokens=S, eos_id=None))
  state = [engine.init_decode_state(B, S)]
  key = jax.random.key(0)
  ref_dev = devices[-1]
  ref_graphdef, ref_params = init_params(cfg, make_mesh(1, 1, 1, devices=[ref_dev]), "learner",
                                         seed=1)
  cache = jax.device_put(init_cache(cfg, B, S), ref_dev)
  tokens = jax.device_put(jnp.ones((B, T), jnp.int32), ref_dev)

  @jax.jit
  def ref_chunk(p, cache, tokens, start):
    model = nnx.merge(ref_graphdef, p)
    pos = start + jnp.broadcast_to(jnp.arange(T), (B, T))
    logits, cache = model(tokens, pos, cache=cache)
    return token_logprobs(logits, tokens)[0], cache

  def decode():
    state[0], out = engine.generate_steps(params, state[0], key, steps=T)
    return out

  def ref():
    return ref_chunk(ref_params, cache, tokens, S // 3)

  def ms(fn):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(args.repeats):
      t = time.perf_counter()
      jax.block_until_ready(fn())
      ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3

  print(f"jax {jax.__version__}, {len(devices)} {jax.default_backend()} device(s), "
        f"{allocator.describe()}; decode on {devices[0]}, reference on {ref_dev}")
  d, r = ms(lambda: decode()), ms(lambda: ref())
  both = ms(lambda: (ref(), decode()))
  print(f"decode call ({T} steps x {B} slots) {d:6.1f} ms")
  print(f"reference chunk ({B} x {T} tokens)  {r:6.1f} ms")
  print(f"both dispatched together     {both:6.1f} ms  (sum {d + r:.1f}; hidden {d + r - both:.1f})")


if __name__ == "__main__":
  main()
