"""Per-seed held-out gain of `jaxrl launch --seeds` runs: each run's first and last logged value
of a metric (eval/accuracy by default: step 0, before any update, and the end), the gain, the
largest logged KL, and the median (min-max) of the gain over the seeds. `jaxrl compare` gives
the spread of final values; a learning test's bar is on the gain from each seed's own start
(the held-out prompts are drawn per seed, so the start differs by seed).

    .venv/bin/python scripts/seed_gains.py runs/ppo_seeds [--metric eval/accuracy]
"""

import argparse
import json
import os
import statistics

from jaxrl.plot import run_dirs
from jaxrl.train.rundir import read_metrics


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("dirs", nargs="+", help="run dirs or experiment roots")
  ap.add_argument("--metric", default="eval/accuracy")
  args = ap.parse_args(argv)
  gains = []
  for d in run_dirs(args.dirs):
    rows = read_metrics(d)
    xs = [(r["step"], r[args.metric]) for r in rows if isinstance(r.get(args.metric), (int, float))]
    # summary.json's kl/max spans every step; the logged rows only every log_every-th.
    summary = os.path.join(d, "summary.json")
    kl = [json.load(open(summary)).get("kl/max")] if os.path.isfile(summary) else []
    kl = [k for k in kl if isinstance(k, (int, float))] or [
        r["kl"] for r in rows if isinstance(r.get("kl"), (int, float))]
    seed = json.load(open(os.path.join(d, "config.json"))).get("seed")
    (s0, first), (s1, last) = xs[0], xs[-1]
    gains.append(last - first)
    print(f"{os.path.basename(d):<14} seed {seed}: step {s0} {first:.3f} -> step {s1} {last:.3f}"
          f" ({last - first:+.3f})" + (f", KL max {max(kl):.3f}" if kl else ""))
  print(f"gain median {statistics.median(gains):+.3f} ({min(gains):+.3f} to {max(gains):+.3f}) "
        f"over {len(gains)} runs")


if __name__ == "__main__":
  main()
