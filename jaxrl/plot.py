"""PNG plots of a run's metrics.jsonl: reward, KL and held-out accuracy over steps."""

from __future__ import annotations

import math

from jaxrl.train.rundir import read_metrics

PANELS = (("reward/mean", "reward (train batch)"), ("kl", "KL to reference"),
          ("eval/accuracy", "held-out accuracy"))


def plot_run(workdir: str, out_png: str, *, title: str = "", panels=PANELS,
             hlines: dict | None = None) -> str:
  """Writes one row of panels (a line per metric over steps) to `out_png`; returns its path.
  `hlines` maps a metric to {label: y} reference lines (e.g. the SFT starting accuracy)."""
  import matplotlib
  matplotlib.use("Agg")  # files only; no display needed (servers, CI, TPU VMs)
  import matplotlib.pyplot as plt

  rows = read_metrics(workdir)
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2))
  for ax, (key, label) in zip(axes, panels):
    pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None
           and math.isfinite(r[key])]
    if pts:
      xs, ys = zip(*pts)
      ax.plot(xs, ys, marker="o" if len(pts) < 20 else None, linewidth=1.5)
    for name, y in ((hlines or {}).get(key) or {}).items():
      ax.axhline(y, color="gray", linestyle="--", linewidth=1)
      ax.annotate(name, (0, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                  color="gray")
    ax.set_title(label)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  plt.close(fig)
  return out_png
