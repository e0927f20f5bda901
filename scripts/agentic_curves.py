"""The calculator recipe over seeds (configs/agentic_tiny.py: the :sft warm start, then GRPO
with the calculator environment), and the docs' plot of the multi-turn held-out eval over
GRPO steps: eval/accuracy and eval/tool_calls/mean, median and min-max over the seeds.

    .venv/bin/python scripts/agentic_curves.py --seeds 0-4 --workdir runs/agentic_seeds \\
        --out docs/guides/img/agentic_seeds.png

Each seed S trains WORKDIR/sft_S then WORKDIR/grpo_S (init.checkpoint = sft_S, seed S in both),
the commands tests/test_agentic.py's learning test runs; a run dir with a summary.json is kept,
so a second call only plots. --warm-start SFT_DIR starts every seed's GRPO from one SFT run
(the spread of GRPO alone); --plot DIR... plots finished GRPO run dirs (e.g. the cells of
several ISA levels and dot kernels, each run under its own XLA_FLAGS and JAXRL_CPU_DOTS).
Arguments after `--` reach the GRPO runs as overrides, e.g. `-- --config.train.steps=60`.
Prints each run's step-0 and final values and the gain.
"""

import argparse
import math
import os
import statistics

from jaxrl import cli
from jaxrl.train.rundir import read_metrics

METRICS = (("eval/accuracy", "held-out accuracy (greedy conversations)"),
           ("eval/tool_calls/mean", "held-out tool calls per conversation"))


def seeds_of(text: str) -> list[int]:
  out = []
  for part in text.split(","):
    lo, _, hi = part.partition("-")
    out += list(range(int(lo), int(hi or lo) + 1))
  return out


def train(workdir: str, seed: int, overrides: list[str], warm_start: str = "") -> str:
  """The seed's GRPO run dir, after its SFT warm start (both kept when already finished), or
  from `warm_start`'s SFT run when given."""
  sft, grpo = warm_start or os.path.join(workdir, f"sft_{seed}"), os.path.join(
      workdir, f"grpo_{seed}")
  if not os.path.isfile(os.path.join(sft, "summary.json")):
    cli.main(["sft", "--config", "configs/agentic_tiny.py:sft", "--workdir", sft,
              f"--config.seed={seed}"])
  if not os.path.isfile(os.path.join(grpo, "summary.json")):
    cli.main(["grpo", "--config", "configs/agentic_tiny.py", "--workdir", grpo,
              f"--config.seed={seed}", f"--config.init.checkpoint={sft}", *overrides])
  return grpo


def plot(runs: dict[str, str], out_png: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(METRICS), figsize=(4.8 * len(METRICS), 3.4))
  rows = {s: read_metrics(d) for s, d in runs.items()}
  for ax, (key, title) in zip(axes, METRICS):
    by_step: dict[int, list[float]] = {}
    for s, rs in rows.items():
      for r in rs:
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]):
          by_step.setdefault(r["step"], []).append(r[key])
    steps = sorted(by_step)
    ax.plot(steps, [statistics.median(by_step[t]) for t in steps], marker="o", linewidth=1.5,
            label=f"median of {len(runs)} runs")
    ax.fill_between(steps, [min(by_step[t]) for t in steps], [max(by_step[t]) for t in steps],
                    alpha=0.25, linewidth=0, label="min-max")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("GRPO step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
  fig.savefig(out_png, dpi=100)
  plt.close(fig)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seeds", default="0-4")
  ap.add_argument("--workdir", default="runs/agentic_seeds")
  ap.add_argument("--out", default="docs/guides/img/agentic_seeds.png")
  ap.add_argument("--warm-start", default="", metavar="SFT_DIR",
                  help="every seed's GRPO starts from this SFT run (default: each its own)")
  ap.add_argument("--plot", nargs="+", default=[], metavar="GRPO_DIR",
                  help="plot these finished GRPO runs instead of training seeds")
  ap.add_argument("overrides", nargs="*", help="GRPO overrides, after --")
  args = ap.parse_args(argv)
  runs = ({d: d for d in args.plot} if args.plot else
          {f"seed {s}": train(args.workdir, s, args.overrides, args.warm_start)
           for s in seeds_of(args.seeds)})
  for s, d in runs.items():
    evals = [r for r in read_metrics(d) if "eval/accuracy" in r]
    first, last = evals[0], evals[-1]
    print(f"{s}: " + "; ".join(
        f"{k} step {first['step']} {first[k]:.3f} -> step {last['step']} {last[k]:.3f} "
        f"({last[k] - first[k]:+.3f})" for k, _ in METRICS))
  plot(runs, args.out)
  print(f"plot: {args.out}")


if __name__ == "__main__":
  main()
