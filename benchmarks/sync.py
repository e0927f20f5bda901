"""Learner -> sampler weight sync against memcpy of the same bytes, in one run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/sync.py

Trees of 64 MiB and 1 GiB (fp32 matrices with logical axes embed x mlp) start in the learner
layout (FSDP over 8 devices) and move to the sampler layout, in both placements:
  colocated      learner fsdp=8 -> sampler data=2 x tensor=4 on the same 8 devices
  disaggregated  learner fsdp=4 on devices 0-3 -> sampler tensor=4 on devices 4-7
Columns: jaxrl's sync (one device_put), a jitted identity with out_shardings (the alternative
docs/design.md rejects; it cannot cross device sets, so disaggregated shows n/a), and a numpy memcpy
of the same number of bytes. GB/s counts the tree's bytes once, however many replicas receive
it. Medians of --repeats runs after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxrl.parallel.sync import Layout, make_placement, memcpy_gb_per_s, placement_config, sync

ROWS, COLS = 1024, 4096  # one 16 MiB fp32 matrix


def tree_of(mib: int, layout: Layout):
  n = max(1, mib // 16)
  shapes = {f"w{i}": jax.ShapeDtypeStruct((ROWS, COLS), np.float32) for i in range(n)}
  axes = {k: ("embed", "mlp") for k in shapes}
  shd = layout.shardings(shapes, axes)
  make = jax.jit(lambda: {k: jax.numpy.ones(s.shape, s.dtype) for k, s in shapes.items()},
                 out_shardings=shd)
  return make(), shapes, axes


def median_ms(fn, repeats):
  out = fn()  # warm-up (and compile)
  times = []
  for _ in range(repeats):
    jax.tree.map(lambda x: x.delete(), out)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  jax.tree.map(lambda x: x.delete(), out)
  return statistics.median(times) * 1e3


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--sizes-mib", default="64,1024")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args()
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices")
  print(f"{'placement':14s} {'size':>8s} {'sync ms':>9s} {'sync GB/s':>10s} {'jit-id GB/s':>12s} "
        f"{'memcpy GB/s':>12s} {'sync/memcpy':>12s}")
  for mode in ("colocated", "disaggregated"):
    section = placement_config()
    section.mode = mode
    section.sampler_mesh.tensor = 4
    if mode == "disaggregated":
      section.learner_devices = 4
    pl = make_placement(dict(data=1, fsdp=-1, tensor=1), section)
    for mib in map(int, args.sizes_mib.split(",")):
      params, shapes, axes = tree_of(mib, pl.learner)
      target = pl.sampler.shardings(shapes, axes)
      nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
      ms = median_ms(lambda: sync(params, target), args.repeats)
      if mode == "colocated":
        ident = jax.jit(lambda t: t, out_shardings=target)
        jit_gbs = f"{nbytes / 1e9 / (median_ms(lambda: ident(params), args.repeats) / 1e3):12.2f}"
      else:
        jit_gbs = f"{'n/a':>12s}"
      mem = memcpy_gb_per_s(nbytes, args.repeats)
      gbs = nbytes / 1e9 / (ms / 1e3)
      print(f"{mode:14s} {mib:>5d} MiB {ms:9.1f} {gbs:10.2f} {jit_gbs} {mem:12.2f} "
            f"{gbs / mem:11.2f}x", flush=True)
      jax.tree.map(lambda x: x.delete(), params)


if __name__ == "__main__":
  main()
