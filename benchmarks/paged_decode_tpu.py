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

Two compiler figures per step, each against that roofline:
  - cost_model_ms: XLA's `bytes accessed` (cost_analysis) plus the kernel's bytes, over the
    HBM bandwidth. It counts every operand and result of every op whatever memory it lives in:
    on a v5e XLA keeps the weights' slices, the tied embedding (a cross-program prefetch) and
    the logits in VMEM (`S(1)` in the compiled HLO), so a weight prefetched there is counted
    when the DMA reads it, when it lands in VMEM and when the matmul reads it; a gather is
    charged its whole table (the embedding lookup of one token per slot: 78 MB for 64 KB read).
    It counts far more than the HBM traffic and is not an estimate of it.
  - estimated_ms: the compiler's own time estimate. libtpu writes `estimated_cycles` on each op
    of the compiled module; summed over the program (a loop's body times its trip count;
    jaxrl.parallel.compile.estimated_cycles) at the chip's clock they give estimated_ops_ms.
    The asynchronous DMAs that bring the weights into VMEM carry no cycles (they overlap the
    ops), nor does a Pallas call, so the step is taken as max(estimated_ops_ms, the weights
    over the HBM bandwidth) + the kernel's bytes over the HBM bandwidth (kernel_ms). Where
    the ops come to less than the weights' read, that is the floor, not an estimate
    (`floor_bound` says so).
`--steps K` compiles the rollout's scan of K decode steps (rollout.steps_per_call, default 8)
and gives the estimate per step: the ops hoisted out of the scan (loop-invariant work on the
weights) run once per K steps. XLA's cost model counts a loop's body once (at 2 layers, 8
steps came to the bytes of 1), so cost_model_ms is given for K = 1 only.
`--ops N` prints the N ops with the most estimated time (summed over ops of one kind).
`--layouts auto` compiles the step with the weights in the layouts XLA picks for it (a
what-if: the engine passes them in their default layouts).
The step takes the sampler's params as Engine.decode_params gives them on TPU (each layer's
q, k and v heads-major, [heads, H, D]); that transpose, made once per weight sync, is
compiled too and reported as heads_major_sync_bytes_accessed / heads_major_sync_estimated_ms.
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


def compile_step(cfg, mesh, *, slots, max_len, pages, page_size, choice, layouts="default",
                 steps=1):
  from jaxrl.models import abstract_model
  from jaxrl.models.llama import is_projection
  from jaxrl.sampler import Engine, SamplingParams
  from jaxrl.train import programs as pg
  os.environ["JAXRL_TPU_PAGED"] = choice
  model = abstract_model(cfg)
  params = pg.params_of(model, mesh, "sampler")
  engine = Engine(model[0], cfg, mesh, sampling=SamplingParams(max_new_tokens=max_len))
  sync_program = None
  if engine.heads_major:  # the sampler's params as Engine.decode_params gives them on TPU
    picked = [x for path, x in jax.tree_util.tree_leaves_with_path(params)
              if is_projection(path, x)]
    sync_program = engine._to_heads_major.lower(picked).compile()

    def heads_major(path, x):
      if not is_projection(path, x):
        return x
      spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
      return pg.spec((x.shape[1], x.shape[2], x.shape[0]), x.dtype,
                     NamedSharding(mesh, P(spec[1], spec[2], spec[0])))

    params = jax.tree_util.tree_map_with_path(heads_major, params)
  rep = NamedSharding(mesh, P())
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep)
  state = jax.tree.map(
      lambda x, s: pg.spec(x.shape, x.dtype, s),
      jax.eval_shape(lambda: engine._paged_init_fn(slots, max_len // page_size, pages,
                                                   page_size)(jnp.int32(max_len))),
      engine._paged_shardings(slots))
  in_shardings = None
  if layouts == "auto":  # the weights in the layouts the compiler picks for this program
    from jax.experimental.layout import Format, Layout
    in_shardings = (jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), params),
                    jax.tree.map(lambda x: x.sharding, state), rep)
  compiled = jax.jit(lambda p, s, k: engine._steps_fn(p, s, k, steps=steps), donate_argnums=1,
                     in_shardings=in_shardings).lower(params, state, key).compile()
  # What one chip holds of the weights: one shard of each.
  weight_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                     for x in jax.tree.leaves(params))
  return compiled, weight_bytes, sync_program


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
  ap.add_argument("--paths", default="pallas,xla", help="decode attention paths to compile")
  ap.add_argument("--ops", type=int, default=0, help="print the N costliest kinds of op")
  ap.add_argument("--steps", type=int, default=1,
                  help="decode steps per call (the rollout's steps_per_call): figures per step")
  ap.add_argument("--layouts", default="default", choices=("default", "auto"),
                  help="auto: the weights in the layouts XLA picks (what-if: the engine does "
                  "not do this today)")
  args = ap.parse_args()

  from jaxrl.models import get_preset
  from jaxrl.parallel import make_mesh
  from jaxrl.parallel.compile import chip_of, estimated_cycles, topology_devices
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
         "max_len": max_len, "length_at_step": length, "layouts": args.layouts,
         "steps_per_call": args.steps}
  clock = chip.clock_hz
  for choice in args.paths.split(","):
    compiled, weight_bytes, sync_program = compile_step(
        cfg, mesh, slots=args.slots, max_len=max_len, pages=pages, page_size=args.page,
        choice=choice, layouts=args.layouts, steps=args.steps)
    hlo = compiled.as_text()
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    kv = kernel_kv if choice == "pallas" else gather_kv
    roofline_s = (weight_bytes + kv) / chip.hbm_bytes_per_s
    cycles, by_kind = estimated_cycles(hlo)
    cycles /= args.steps  # per step
    kernel_s = (kv if choice == "pallas" else 0) / chip.hbm_bytes_per_s
    # The weights' DMAs into VMEM are asynchronous and carry no cycles: they overlap the ops,
    # so the ops' cycles and the weights' read over the HBM bandwidth bound the step together.
    ops_s = cycles / clock
    estimated_s = max(ops_s, weight_bytes / chip.hbm_bytes_per_s) + kernel_s
    cost_s = (cost.get("bytes accessed", 0) + (kv if choice == "pallas" else 0)
              ) / chip.hbm_bytes_per_s
    out[choice] = {
        "kernel_calls": hlo.count("custom_call_target=\"tpu_custom_call\""),
        "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
        "cost_bytes_accessed": cost.get("bytes accessed"), "cost_flops": cost.get("flops"),
        "weight_bytes_per_chip": weight_bytes, "kv_bytes_read_per_chip": kv,
        "roofline_ms_per_step": roofline_s * 1e3,
        "roofline_tokens_per_s_per_chip": slots_chip / roofline_s,
        "roofline_us_per_token": roofline_s / args.slots * 1e6,  # the slice's step / batch
        "cost_model_ms": cost_s * 1e3 if args.steps == 1 else None,
        "cost_model_ratio": cost_s / roofline_s if args.steps == 1 else None,
        "estimated_cycles": cycles, "estimated_ops_ms": ops_s * 1e3,
        "kernel_ms": kernel_s * 1e3, "estimated_ms": estimated_s * 1e3,
        "estimated_us_per_token": estimated_s / args.slots * 1e6,
        "estimated_ratio": estimated_s / roofline_s,
        "floor_bound": ops_s < weight_bytes / chip.hbm_bytes_per_s}
    if sync_program is not None:  # the transpose Engine.decode_params adds to each sync
      sync_cost = sync_program.cost_analysis()
      sync_cost = sync_cost[0] if isinstance(sync_cost, list) else sync_cost
      sync_cycles, _ = estimated_cycles(sync_program.as_text())
      out[choice].update(
          heads_major_sync_bytes_accessed=sync_cost.get("bytes accessed"),
          heads_major_sync_estimated_ms=sync_cycles / clock * 1e3)
    print(choice, json.dumps(out[choice]), flush=True)
    for kind, c in by_kind.most_common(args.ops):
      c /= args.steps
      print(f"  {c / clock * 1e6:9.1f} us  {kind}")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
