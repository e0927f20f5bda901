"""Time per GRPO step and its split by phase, from a real `jaxrl grpo` run's metrics.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 .venv/bin/python benchmarks/grpo_step.py

Two shapes, each run for --steps steps after one warm-up step (compiles) that is not counted:
  demo    configs/grpo_tiny.py as the demo runs it (tiny preset, 16 prompts x 8, up to 8 tokens)
  anchor  the peer anchor: the 4.49M-parameter Qwen2-style `bench` preset, 8 prompts x 8
          generations, exactly 64 completion tokens (eos ignored), beta 0.04 with a reference
          model, fp32. TRL 1.16's GRPOTrainer took 2.23-2.33 s per step on this shape on this
          machine kind (generation 0.8-1.0 s, scoring + reference 0.35 s, update 1.1 s).
  anchor-disagg / anchor-async
          the anchor shape on disaggregated placement (half the devices learn, half sample),
          synchronous and with async generation (step k+1's rollout overlaps step k's update).
          They need at least 2 devices: run them with --xla_force_host_platform_device_count=2.
Prints the median step time, perf/gen_fraction and the median of each timing_s/* phase (gen is
the rollout's own time; with async generation the learner waits only timing_s/gen_wait).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import jax

from jaxrl import config as config_lib
from jaxrl.rl import grpo
from jaxrl.train.rundir import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {
    "demo": [],
    "anchor": ["model.preset=bench", "rollout.prompts_per_step=8", "rollout.group_size=8",
               "rollout.max_new_tokens=64", "rollout.ignore_eos=True", "rollout.slots=64",
               "rollout.steps_per_call=16", "algo.beta=0.04"],
}
SHAPES["anchor-disagg"] = SHAPES["anchor"] + ["placement.mode=disaggregated"]
SHAPES["anchor-async"] = SHAPES["anchor-disagg"] + ["rollout.async_generation=True"]
PHASES = ("gen", "score", "ref", "update", "sync")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--shapes", default="demo,anchor")
  args = p.parse_args()
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, "
        f"load average {os.getloadavg()[0]:.1f}")
  print(f"{'shape':13s} {'s/step':>7s} {'gen frac':>9s} {'gen wait':>9s} " +
        " ".join(f"{k + ' s':>9s}" for k in PHASES) + f" {'TRL s/step':>11s} {'vs TRL':>7s}")
  for shape in args.shapes.split(","):
    overrides = SHAPES[shape] + [f"train.steps={args.steps + 1}", "train.log_every=1",
                                 "train.save_every=1000", "eval.every=0",
                                 "mesh.fsdp=-1", "placement.sampler_mesh.data=-1"]
    config = config_lib.load_config(os.path.join(ROOT, "configs/grpo_tiny.py"), overrides)
    with tempfile.TemporaryDirectory() as workdir:
      grpo.run(config, workdir, out=lambda *a: None)
      rows = [r for r in read_metrics(workdir) if "timing_s/gen" in r][1:]  # drop warm-up
    med = {k: statistics.median(r[f"timing_s/{k}"] for r in rows) for k in PHASES}
    step = statistics.median(r["timing_s/step"] for r in rows)
    frac = statistics.median(r["perf/gen_fraction"] for r in rows)
    wait = statistics.median(r["timing_s/gen_wait"] for r in rows)
    anchor = shape.startswith("anchor")
    trl = "2.23-2.33" if anchor else "-"
    ratio = f"{2.28 / step:6.2f}x" if anchor else f"{'-':>7s}"
    print(f"{shape:13s} {step:7.2f} {frac:9.2f} {wait:9.3f} " +
          " ".join(f"{med[k]:9.3f}" for k in PHASES) +
          f" {trl:>11s} {ratio}", flush=True)


if __name__ == "__main__":
  main()
