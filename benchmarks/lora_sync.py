"""LoRA weight sync: full against adapter-only, and applying the adapters at decode time against
merging them into the sampler's base copy, in one run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/lora_sync.py

For each preset (LoRA rank 16 on all linear layers, fp32), colocated (learner fsdp=8 -> sampler
data=2 x tensor=4 on the same devices):
  full sync      every parameter moves (what a run without adapter-only sync does)
  adapter sync   only the adapters move; the sampler keeps its base copy and applies them at
                 decode time (WeightSync, lora_sampler="apply": the transfer alone)
  sync + merge   only the adapters move, merged on the sampler into a plain model beside its base
                 copy (WeightSync's default, lora_sampler="merge"; colocated, one jitted program
                 takes the learner's adapters and writes the merged weights)
  decode step    one decode step of `--slots` slots (Engine.generate_steps, --steps per call),
                 with the adapters applied (the LoRA graph) against the merged plain graph
Per RL step of --new-tokens decode steps: apply = adapter sync + new_tokens x adapted step;
merge = sync + merge + new_tokens x plain step. Medians of --repeats after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from jaxrl.models import abstract_model, get_preset, lora
from jaxrl.models.config import LORA_WEIGHTS
from jaxrl.parallel import describe, init_params
from jaxrl.parallel.sync import bench_sync, make_placement, placement_config, release
from jaxrl.sampler import Engine, SamplingParams


def decode_ms(cfg, params, mesh, slots, max_len, steps, repeats):
  """Median ms per decode step of `slots` slots (a fresh state per call, not timed)."""
  graphdef, _, _ = abstract_model(cfg)
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(temperature=1.0,
                                                               max_new_tokens=max_len))
  key = jax.random.key(0)
  times = []
  for i in range(repeats + 1):
    state = engine.init_decode_state(slots, max_len)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    jax.block_until_ready(engine.generate_steps(params, state, key, steps=steps))
    if i:  # the first call compiles
      times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3 / steps


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--presets", default="tiny,bench")
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args()
  section = placement_config()
  section.sampler_mesh.tensor = 4
  pl = make_placement(dict(data=1, fsdp=-1, tensor=1), section)
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices; learner "
        f"{describe(pl.learner.mesh)} -> sampler {describe(pl.sampler.mesh)}")
  print(f"{'preset':7s} {'full MiB':>9s} {'full ms':>8s} {'adapt MiB':>10s} {'adapt ms':>9s} "
        f"{'sync+merge ms':>14s} {'step+LoRA':>10s} {'step plain':>11s} {'apply/RL step':>14s} "
        f"{'merge/RL step':>14s}")
  for preset in args.presets.split(","):
    cfg = get_preset(preset).replace(lora_rank=args.rank, lora_alpha=2.0 * args.rank,
                                     lora_targets=LORA_WEIGHTS)
    _, params = init_params(cfg, pl.learner.mesh, "learner")
    full = bench_sync(cfg, pl, params, repeats=args.repeats)
    # The transfer alone ("apply" leaves the adapters as they arrive); the merge is timed below.
    adapt = bench_sync(cfg, pl, params, repeats=args.repeats, adapters_only=True,
                       lora_sampler="apply")
    merged_sync = bench_sync(cfg, pl, params, repeats=args.repeats, adapters_only=True)
    # The sampler side: its copy of the adapted model, and the merged plain one.
    sampled = jax.device_put(params, pl.sampler.model_shardings(cfg))
    base_cfg = lora.base_config(cfg)
    merged = jax.jit(lambda p: lora.merge_lora(cfg, p),
                     out_shardings=pl.sampler.model_shardings(base_cfg))(sampled)
    max_len = args.new_tokens + 32
    step_lora = decode_ms(cfg, sampled, pl.sampler.mesh, args.slots, max_len, args.steps,
                          args.repeats)
    step_plain = decode_ms(base_cfg, merged, pl.sampler.mesh, args.slots, max_len, args.steps,
                           args.repeats)
    apply_rl = adapt.ms + args.new_tokens * step_lora
    merge_rl = merged_sync.ms + args.new_tokens * step_plain
    print(f"{preset:7s} {full.bytes / 2**20:9.2f} {full.ms:8.1f} {adapt.bytes / 2**20:10.3f} "
          f"{adapt.ms:9.1f} {merged_sync.ms:14.1f} {step_lora:10.2f} {step_plain:11.2f} "
          f"{apply_rl:12.0f}ms {merge_rl:12.0f}ms", flush=True)
    release(sampled)
    release(merged)
    release(params)
  print(f"(rank {args.rank}, all-linear; {args.slots} slots; an RL step = {args.new_tokens} "
        "decode steps; apply = adapter sync + steps with LoRA; merge = sync + merge + plain "
        "steps)")


if __name__ == "__main__":
  main()
