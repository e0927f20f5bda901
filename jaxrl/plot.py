"""PNG plots of runs' metrics.jsonl: the demo's row of panels, the standard panels of
`jaxrl plot DIR`, and the side-by-side runs of `jaxrl compare DIR...`."""

from __future__ import annotations

import functools
import math
import os

from jaxrl.errors import ConfigError
from jaxrl.train.rundir import infer_command, read_metrics, read_run

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


# ----------------------------------------------------------------------------- jaxrl plot

# The standard panels of `jaxrl plot DIR`: one PNG each, a line per metric over steps.
STANDARD = {
    "reward": (("reward/mean", "reward mean"), ("reward/std", "reward std")),
    "accuracy": (("accuracy", "train batch accuracy"), ("eval/accuracy", "held-out accuracy")),
    "kl": (("kl", "KL to reference"),),
    "entropy": (("entropy", "policy entropy"),),
    "lengths": (("response_length/mean", "mean response length"),
                ("response_length/clip_ratio", "fraction cut at max length")),
    "loss": (("loss", "loss"), ("grad_norm", "grad norm")),
}
# The timing split: seconds per step by phase (the rest of the step is host work).
TIMING = ("gen", "score", "ref", "update", "sync")


def _points(rows, key):
  return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))
          and math.isfinite(r[key])]


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot_standard(workdir: str, out_dir: str | None = None) -> dict[str, str]:
  """Writes DIR/plots/<panel>.png for each standard panel the run logged (reward, accuracy,
  KL, entropy, lengths, loss, timing); returns {panel: path}. An SFT run has no reward, KL or
  timing split: those panels are left out, not drawn empty."""
  plt = _plt()
  rows = read_metrics(workdir)
  out_dir = out_dir or os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)
  written = {}
  for panel, metrics in STANDARD.items():
    series = [(label, _points(rows, key)) for key, label in metrics]
    series = [(label, pts) for label, pts in series if pts]
    if not series:
      continue
    fig, axes = plt.subplots(1, len(series), figsize=(4.5 * len(series), 3.2), squeeze=False)
    for ax, (label, pts) in zip(axes[0], series):
      xs, ys = zip(*pts)
      ax.plot(xs, ys, marker="o" if len(pts) < 20 else None, linewidth=1.5)
      ax.set_title(label)
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
    fig.tight_layout()
    written[panel] = os.path.join(out_dir, f"{panel}.png")
    fig.savefig(written[panel], dpi=100)
    plt.close(fig)
  steps = [r for r in rows if all(isinstance(r.get(f"timing_s/{k}"), (int, float))
                                  for k in TIMING)]
  if steps:
    xs = [r["step"] for r in steps]
    parts = [[r[f"timing_s/{k}"] for r in steps] for k in TIMING]
    total = [r.get("timing_s/step_wall", r.get("timing_s/step", 0.0)) for r in steps]
    other = [max(t - sum(p[i] for p in parts), 0.0) for i, t in enumerate(total)]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.stackplot(xs, *parts, other, labels=[*TIMING, "other (host)"], alpha=0.85)
    ax.set_title("time per step by phase")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7, loc="upper left", ncols=3)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written["timing"] = os.path.join(out_dir, "timing.png")
    fig.savefig(written["timing"], dpi=100)
    plt.close(fig)
  return written


# ----------------------------------------------------------------------------- jaxrl compare

COMPARE_DEFAULT = ("loss", "reward/mean", "kl", "accuracy", "eval/accuracy")


def run_dirs(paths) -> list[str]:
  """Each path that is a run (holds metrics.jsonl), or the runs one level inside it (an
  experiment root written by `jaxrl launch`), in order."""
  out = []
  for p in paths:
    if os.path.isfile(os.path.join(p, "metrics.jsonl")):
      out.append(p)
      continue
    inner = sorted(os.path.join(p, d) for d in os.listdir(p)) if os.path.isdir(p) else []
    inner = [d for d in inner if os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if not inner:
      raise ConfigError(f"{p} holds no metrics.jsonl, nor do its subdirectories: give run "
                        "directories (or an experiment root from `jaxrl launch`).")
    out += inner
  return out


def final_metrics(workdir: str) -> dict:
  """The last logged value of each metric (an eval metric is logged only at eval steps)."""
  last = {}
  for row in read_metrics(workdir):
    for k, v in row.items():
      if isinstance(v, (int, float)) and math.isfinite(v):
        last[k] = v
  return last


def compare_table(dirs: list[str], metrics=None) -> tuple[str, list[str]]:
  """A text table of each run's final metrics; returns it and the metric names it shows."""
  finals = {d: final_metrics(d) for d in dirs}
  names = list(metrics or [m for m in COMPARE_DEFAULT if any(m in f for f in finals.values())])
  unknown = [m for m in names if not any(m in f for f in finals.values())]
  if unknown:
    logged = sorted({k for f in finals.values() for k in f})
    raise ConfigError(f"--metrics {unknown[0]!r} is in none of the runs: logged metrics are "
                      f"{', '.join(logged)}.")
  label = _labels(dirs)
  w = max(len("run"), *(len(label[d]) for d in dirs))
  head = f"{'run':<{w}}  {'step':>6}" + "".join(f"  {m:>14}" for m in names)
  lines = [head, "-" * len(head)]
  for d in dirs:
    f = finals[d]
    cells = "".join(f"  {f[m]:>14.4g}" if m in f else f"  {'-':>14}" for m in names)
    lines.append(f"{label[d]:<{w}}  {int(f.get('step', 0)):>6}{cells}")
  return "\n".join(lines), names


def _labels(dirs):
  """Short run labels: the paths without their common prefix."""
  if len(dirs) == 1:
    return {dirs[0]: os.path.basename(os.path.normpath(dirs[0]))}
  common = os.path.commonpath([os.path.abspath(d) for d in dirs])
  return {d: os.path.relpath(os.path.abspath(d), common) for d in dirs}


def _save_panels(plt, fig, axes, out_png: str) -> str:
  """The legend on the first panel, then the PNG written (its folder made) and the figure
  closed: the end of every multi-run plot."""
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
  fig.savefig(out_png, dpi=100)
  plt.close(fig)
  return out_png


def plot_compare(dirs: list[str], metrics, out_png: str) -> str:
  """One panel per metric, a line per run over steps."""
  plt = _plt()
  label = _labels(dirs)
  rows = {d: read_metrics(d) for d in dirs}
  fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.4), squeeze=False)
  for ax, key in zip(axes[0], metrics):
    for d in dirs:
      pts = _points(rows[d], key)
      if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o" if len(pts) < 20 else None, linewidth=1.3, label=label[d])
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  return _save_panels(plt, fig, axes, out_png)


# ----------------------------------------------------------------------------- seeds


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


@functools.lru_cache(maxsize=None)
def _default_config(command: str | None) -> dict:
  """Today's defaults of the config a `command` run reads (its trainer's default_config()), or
  the shared sections alone when the command is unknown, as config.json would hold them (JSON
  types: a tuple default reads as the list a run wrote). Imported here, not at the top: the
  trainers' modules cost `jaxrl compare` about 2 s to import. Callers must not mutate it."""
  import json
  from jaxrl import config as config_lib
  if command == "sft":
    from jaxrl.algorithms.sft import default_config
  elif command == "rm":
    from jaxrl.algorithms.rm import default_config
  elif command == "dpo":
    from jaxrl.algorithms.dpo import default_config
  elif command == "grpo":
    from jaxrl.algorithms.grpo.config import default_config
  elif command == "ppo":
    from jaxrl.algorithms.ppo.config import default_config
  else:
    default_config = config_lib.base_config
  return json.loads(json.dumps(default_config().to_dict(), default=str))


def _setting(workdir: str, defaults=None) -> dict:
  """What a run is, apart from its seed: its config.json flattened, without `seed` and without
  the backend's descriptions, but with its device count (1 and 8 devices are different
  settings). A key the run's config.json lacks takes today's default (`defaults(command)`,
  jaxrl's own by default): a run written before a code change added a section (model.lora, say)
  ran as that section's defaults do, so it groups with the seeds of its sweep run after the
  change, while a key both name with different values still tells them apart."""
  import json
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):  # not a trainer's run dir: a setting of its own
    return {"run": os.path.abspath(workdir)}
  with open(path, encoding="utf-8") as f:
    config = json.load(f)
  command = (read_run(workdir) or {}).get("command") or infer_command(config)
  base = {k: v for k, v in (defaults or _default_config)(command).items()
          if k not in ("seed", "backend")}
  config.pop("seed", None)
  backend = config.pop("backend", None) or {}
  flat = {**_flat(base), **_flat(config)}
  flat["devices"] = backend.get("devices", "?")
  return flat


def group_runs(dirs: list[str]) -> dict[str, list[str]]:
  """Runs whose configs differ only in `seed`, grouped, in first-seen order. Each group's label
  names the settings that tell the groups apart (e.g. `optim.lr=0.003 devices=8`), or `all`."""
  settings = {d: _setting(d) for d in dirs}
  groups: list[tuple[dict, list[str]]] = []
  for d in dirs:
    for setting, members in groups:
      if setting == settings[d]:
        members.append(d)
        break
    else:
      groups.append((settings[d], [d]))
  keys = sorted({k for s, _ in groups for k in s})
  differ = [k for k in keys if len({repr(s.get(k)) for s, _ in groups}) > 1]
  out = {}
  for setting, members in groups:
    label = " ".join(f"{k}={setting.get(k)}" for k in differ) or "all"
    out[label] = members
  return out


def aggregate(dirs: list[str], metrics) -> dict[str, dict[str, dict[str, float]]]:
  """{group: {metric: {n, mean, std, median, min, max}}} of each run's final value (std is the
  sample standard deviation, ddof=1; 0 for a single run). A run that never logged the metric
  is left out of its n."""
  import numpy as np
  out = {}
  for label, members in group_runs(dirs).items():
    finals = [final_metrics(d) for d in members]
    out[label] = {}
    for m in metrics:
      xs = np.array([f[m] for f in finals if m in f], dtype=np.float64)
      if not len(xs):
        continue
      out[label][m] = {"n": len(xs), "mean": float(xs.mean()),
                       "std": float(xs.std(ddof=1)) if len(xs) > 1 else 0.0,
                       "median": float(np.median(xs)), "min": float(xs.min()),
                       "max": float(xs.max())}
  return out


def aggregate_table(agg: dict, metrics) -> str:
  """One block per metric: a row per group with n, mean, std, median, min and max."""
  w = max(len("group"), *(len(g) for g in agg))
  lines = []
  for m in metrics:
    lines += ["", m, f"{'group':<{w}}  {'n':>3}" + "".join(
        f"  {c:>9}" for c in ("mean", "std", "median", "min", "max"))]
    for g, stats in agg.items():
      s = stats.get(m)
      cells = ("".join(f"  {s[c]:>9.4g}" for c in ("mean", "std", "median", "min", "max"))
               if s else f"  {'-':>9}" * 5)
      lines.append(f"{g:<{w}}  {s['n'] if s else 0:>3}{cells}")
  return "\n".join(lines[1:])


def plot_bands(dirs: list[str], metrics, out_png: str) -> str:
  """One panel per metric, per group of seeds: the mean over steps, and a band from the min
  to the max (at each step, over the runs that logged it)."""
  import numpy as np
  plt = _plt()
  groups = group_runs(dirs)
  rows = {d: read_metrics(d) for d in dirs}
  fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.4), squeeze=False)
  for ax, key in zip(axes[0], metrics):
    for label, members in groups.items():
      by_step: dict[int, list[float]] = {}
      for d in members:
        for step, v in _points(rows[d], key):
          by_step.setdefault(step, []).append(v)
      if not by_step:
        continue
      steps = sorted(by_step)
      vals = [np.array(by_step[s]) for s in steps]
      line, = ax.plot(steps, [v.mean() for v in vals], linewidth=1.5,
                      label=f"{label} (n={len(members)})")
      ax.fill_between(steps, [v.min() for v in vals], [v.max() for v in vals],
                      color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_title(f"{key} (mean, min-max)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  return _save_panels(plt, fig, axes, out_png)
