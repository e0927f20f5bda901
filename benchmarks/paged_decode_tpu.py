"""The paged cache's decode step compiled for a TPU topology on this CPU machine (libtpu's AOT
compiler, no chip), with the Pallas paged attention kernel and with XLA's gather path:
per-chip memory from XLA's memory analysis, and the step's HBM roofline.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/paged_decode_tpu.py \
        --preset qwen3-0.6b --topology v5e:2x4 --slots 64 --prompt 512 --new 256

The scenario is issue 37's GRPO rollout: slots / G prompts of `prompt` tokens, G samples each
sharing the prompt's full pages, `new` tokens of room per sample, pages of 16. The roofline
counts what one decode step must read per chip: the weights it holds, and the keys and values
of each slot's pages up to its length (taken at mid-completion, prompt + new / 2), against the
chip's HBM bandwidth. XLA's cost model does not see inside a Pallas call, so the kernel's
bytes are counted from its shapes (whole pages up to each slot's length); the gather path's
are its whole table (n * P positions per slot) read and its gathered copy written and read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def compile_step(cfg, mesh, *, slots, max_len, pages, page_size, choice):
  from jaxrl.models import abstract_model
  from jaxrl.sampler import Engine, SamplingParams
  from jaxrl.train import programs as pg
  os.environ["JAXRL_TPU_PAGED"] = choice
  model = abstract_model(cfg)
  params = pg.params_of(model, mesh, "sampler")
  engine = Engine(model[0], cfg, mesh, sampling=SamplingParams(max_new_tokens=max_len))
  rep = NamedSharding(mesh, P())
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep)
  state = jax.tree.map(
      lambda x, s: pg.spec(x.shape, x.dtype, s),
      jax.eval_shape(lambda: engine._paged_init_fn(slots, max_len // page_size, pages,
                                                   page_size)(jnp.int32(max_len))),
      engine._paged_shardings(slots))
  compiled = jax.jit(lambda p, s, k: engine._steps_fn(p, s, k, steps=1),
                     donate_argnums=1).lower(params, state, key).compile()
  # What one chip holds of the weights: one shard of each.
  weight_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                     for x in jax.tree.leaves(params))
  return compiled, weight_bytes


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen3-0.6b")
  ap.add_argument("--layers", type=int, default=0, help="cut the model to this many layers")
  ap.add_argument("--topology", default="v5e:2x4")
  ap.add_argument("--mesh", default="1,2,4", help="data,fsdp,tensor")
  ap.add_argument("--slots", type=int, default=64)
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--new", type=int, default=256)
  ap.add_argument("--page", type=int, default=16)
  args = ap.parse_args()

  from jaxrl.models import get_preset
  from jaxrl.parallel import make_mesh
  from jaxrl.parallel.compile import chip_of, topology_devices
  cfg = dataclasses.replace(get_preset(args.preset), dtype="bfloat16", param_dtype="bfloat16")
  if args.layers:
    cfg = dataclasses.replace(cfg, num_layers=args.layers)
  data, fsdp, tensor = (int(x) for x in args.mesh.split(","))
  mesh = make_mesh(data, fsdp, tensor, devices=topology_devices(args.topology))
  chip = chip_of(args.topology)  # peak rates of v5e / v5p / v6e
  max_len = args.prompt + args.new
  shared = args.slots // args.group * (args.prompt // args.page)
  own = args.slots * -(-(max_len - args.prompt // args.page * args.page) // args.page)
  pages = shared + own
  # Per chip: the slots over data x fsdp, the KV heads over tensor, every page on every chip.
  slots_chip = args.slots // (data * fsdp)
  kv_chip = cfg.num_kv_heads // tensor
  length = args.prompt + args.new // 2
  item = 2  # bfloat16 cache
  per_pos = 2 * cfg.num_layers * kv_chip * cfg.head_dim * item  # keys and values, all layers
  kernel_kv = slots_chip * -(-length // args.page) * args.page * per_pos
  gather_kv = slots_chip * max_len * per_pos * 3  # the table read, the copy written and read
  out = {"preset": args.preset, "layers": cfg.num_layers, "topology": args.topology,
         "mesh": args.mesh, "slots": args.slots, "pages": pages, "page_size": args.page,
         "max_len": max_len, "length_at_step": length}
  for choice in ("pallas", "xla"):
    compiled, weight_bytes = compile_step(cfg, mesh, slots=args.slots, max_len=max_len,
                                          pages=pages, page_size=args.page, choice=choice)
    hlo = compiled.as_text()
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    kv = kernel_kv if choice == "pallas" else gather_kv
    roofline_s = (weight_bytes + kv) / chip.hbm_bytes_per_s
    out[choice] = {
        "kernel_calls": hlo.count("custom_call_target=\"tpu_custom_call\""),
        "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
        "cost_bytes_accessed": cost.get("bytes accessed"), "cost_flops": cost.get("flops"),
        "weight_bytes_per_chip": weight_bytes, "kv_bytes_read_per_chip": kv,
        "roofline_ms_per_step": roofline_s * 1e3,
        "roofline_tokens_per_s_per_chip": slots_chip / roofline_s,
        "cost_model_ms": (cost.get("bytes accessed", 0) + (kv if choice == "pallas" else 0))
        / chip.hbm_bytes_per_s * 1e3}
    print(choice, json.dumps(out[choice]), flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
