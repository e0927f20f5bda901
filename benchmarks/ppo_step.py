"""Time per PPO step against GRPO's on the anchor shape, with each one's split by phase, in one
run (so both are measured in the same minutes of this shared machine).

    XLA_FLAGS=--xla_force_host_platform_device_count=1 .venv/bin/python benchmarks/ppo_step.py

The anchor shape is benchmarks/grpo_step.py's: the 4.49M-parameter `bench` preset, 64
completions of exactly 64 tokens per step (eos ignored), fp32, colocated. The runs:
  grpo     configs/grpo_tiny.py: 8 prompts x 8, beta 0.04 KL in the loss (the old log-probs
           from the update's own forward)
  ppo      configs/ppo_tiny.py: 64 prompts x 1 (PPO proper), k1 KL in the reward at beta 0.04
           (a separate old-policy forward, since the rewards need it before the update), the
           critic's value forward, GAE, and the critic's update beside the actor's
  ppo-g8   PPO on GRPO's batch exactly: 8 prompts x 8
Each runs --steps steps after one warm-up step (compiles) that is not counted, --rounds times,
interleaved. Prints the median s/step and the median of each phase: gen (the rollout), score
(old-policy forward + rewards), ref, values (the critic's forward), update (the actor's),
critic (the critic's update), sync.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_step import SHAPES  # noqa: E402  (the anchor, as grpo_step.py runs it)

from jaxrl import config as config_lib  # noqa: E402
from jaxrl.backends.cpu import allocator  # noqa: E402
from jaxrl.algorithms import grpo, ppo  # noqa: E402
from jaxrl.train.rundir import read_metrics  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANCHOR = [x for x in SHAPES["anchor"] if not x.startswith(("rollout.prompts_per_step",
                                                           "rollout.group_size"))]
RUNS = {
    "grpo": ("grpo_tiny.py", grpo, ANCHOR + ["rollout.prompts_per_step=8",
                                             "rollout.group_size=8"]),
    "ppo": ("ppo_tiny.py", ppo, ANCHOR + ["rollout.prompts_per_step=64",
                                          "rollout.group_size=1"]),
    "ppo-g8": ("ppo_tiny.py", ppo, ANCHOR + ["rollout.prompts_per_step=8",
                                             "rollout.group_size=8"]),
}
PHASES = ("gen", "score", "ref", "values", "update", "critic", "sync")
KEYS = {"critic": "timing_s/critic_update"}


def run(name: str, steps: int) -> dict:
  file, module, overrides = RUNS[name]
  config = config_lib.load_config(
      os.path.join(ROOT, "configs", file),
      overrides + [f"train.steps={steps + 1}", "train.log_every=1", "train.save_every=1000",
                   "eval.every=0", "mesh.fsdp=-1", "placement.sampler_mesh.data=-1"],
      module.CHOICES)
  with tempfile.TemporaryDirectory() as workdir:
    module.run(config, workdir, out=lambda *a: None)
    rows = [r for r in read_metrics(workdir) if "timing_s/gen" in r][1:]  # drop warm-up
  med = {"step": statistics.median(r["timing_s/step"] for r in rows)}
  for k in PHASES:
    key = KEYS.get(k, f"timing_s/{k}")
    med[k] = statistics.median(r[key] for r in rows) if key in rows[0] else None
  return med


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--rounds", type=int, default=1)
  p.add_argument("--runs", default="grpo,ppo,ppo-g8")
  args = p.parse_args()
  allocator.ensure()
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, "
        f"load average {os.getloadavg()[0]:.1f}, {allocator.describe()}")
  print(f"{'run':8s} {'s/step':>7s} " + " ".join(f"{k + ' s':>9s}" for k in PHASES))
  results = []
  for _ in range(args.rounds):
    for name in args.runs.split(","):
      med = run(name, args.steps)
      results.append((name, med))
      print(f"{name:8s} {med['step']:7.2f} " + " ".join(
          f"{med[k]:9.3f}" if med[k] is not None else f"{'-':>9s}" for k in PHASES),
          flush=True)
  if args.rounds > 1:
    print(f"\nmedians over {args.rounds} rounds")
    for name in args.runs.split(","):
      ms = [m for n, m in results if n == name]
      print(f"{name:8s} {statistics.median(m['step'] for m in ms):7.2f} " + " ".join(
          f"{statistics.median(m[k] for m in ms):9.3f}" if ms[0][k] is not None
          else f"{'-':>9s}" for k in PHASES))


if __name__ == "__main__":
  main()
