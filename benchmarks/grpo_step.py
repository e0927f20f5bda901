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
the rollout's own time; with async generation the learner waits only timing_s/gen_wait), and
at the end each phase's model GFLOP/s (the perf/tflops/* metrics, jaxrl/models/flops.py), TRL's
counted the same way for the work its step does.

The peer, side by side:

    XLA_FLAGS=--xla_force_host_platform_device_count=1 .venv/bin/python benchmarks/grpo_step.py \
        --shapes anchor --trl-python /tmp/peer/bin/python --rounds 2

runs TRL's GRPOTrainer on the anchor shape (benchmarks/peers/trl_grpo_anchor.py, under that
interpreter: a separate venv with torch and trl, never a jaxrl dependency) after each round of
the shapes, so both are measured in the same hour of this shared machine, whose speed drifts by
up to 1.5x over a day. The "vs TRL" ratios divide by the TRL median measured in the run;
without --trl-python the script prints jaxrl's figures and no ratio.

jaxrl's side runs on tcmalloc when the machine has it, as the `jaxrl` command does (the script
re-executes itself once; JAXRL_TCMALLOC=0 keeps glibc malloc; see
jaxrl/backends/cpu/allocator.py). TRL runs on glibc malloc, as it does by default;
--trl-tcmalloc also times it with the same tcmalloc preloaded, in the same rounds, and the
summary gives jaxrl's ratio to both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile

import jax

from jaxrl.backends.cpu import allocator
from jaxrl import config as config_lib
from jaxrl.models import flops
from jaxrl.algorithms import grpo
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
FLOP_PHASES = ("gen", "ref", "update")


def shape_config(shape: str, steps: int):
  """configs/grpo_tiny.py on `shape` for `steps` GRPO steps, logging every step, with no
  held-out evals or checkpoints in between, on every device (benchmarks/profile_step.py runs
  the same)."""
  overrides = SHAPES[shape] + [f"train.steps={steps}", "train.log_every=1",
                               "train.save_every=1000", "eval.every=0",
                               "mesh.fsdp=-1", "placement.sampler_mesh.data=-1"]
  return config_lib.load_config(os.path.join(ROOT, "configs/grpo_tiny.py"), overrides)


def run_shape(shape, steps):
  config = shape_config(shape, steps + 1)
  with tempfile.TemporaryDirectory() as workdir:
    grpo.run(config, workdir, out=lambda *a: None)
    rows = [r for r in read_metrics(workdir) if "timing_s/gen" in r][1:]  # drop warm-up
  if not rows:
    raise SystemExit(f"{shape}: the run logged no step after its warm-up step (it stopped "
                     "early: a SIGTERM or SIGINT, such as a timeout's, saves and stops a run).")
  med = {k: statistics.median(r[f"timing_s/{k}"] for r in rows) for k in PHASES}
  med["step"] = statistics.median(r["timing_s/step"] for r in rows)
  med["frac"] = statistics.median(r["perf/gen_fraction"] for r in rows)
  med["wait"] = statistics.median(r["timing_s/gen_wait"] for r in rows)
  for k in FLOP_PHASES:
    med[f"gflops/{k}"] = statistics.median(r[f"perf/tflops/{k}"] for r in rows) * 1e3
  return med


def trl_gflops(t: dict) -> dict:
  """TRL's model GFLOP/s by phase on the anchor, counted as jaxrl counts its own
  (jaxrl.models.flops) for the work TRL's step does: every row feeds its own prompt (HF
  generate and TRL's forwards have no shared prompt), the reference forward once (its phase
  also holds the cheap scoring), and the update one forward and one backward."""
  spec = anchor_spec()
  rows = spec["prompts"] * spec["generations"]
  tokens, pairs = flops.sequence_counts([spec["prompt_tokens"]] * rows,
                                        [t["completion_length"]] * rows, share_prompt=False)
  fwd = flops.forward_flops(config_lib.model_config(shape_config("anchor", 1)), tokens=tokens,
                            pairs=pairs) / 1e9
  return {"gen": fwd / t["gen"], "ref": fwd / t["score_ref"], "update": 3 * fwd / t["update"]}


def anchor_spec() -> dict:
  """The anchor shape as the TRL harness builds it, read from the same config and preset the
  jaxrl side runs, so the two cannot drift apart. The harness's prompts are 16 random tokens,
  the width jaxrl's learner pads the anchor's (shorter) task prompts to."""
  config = config_lib.load_config(os.path.join(ROOT, "configs/grpo_tiny.py"), SHAPES["anchor"])
  m, r = config_lib.model_config(config), config.rollout
  if m.dtype != "float32" or not m.qkv_bias or m.qk_norm or m.rope_scaling is not None:
    raise SystemExit(f"the TRL harness builds a Qwen2 model in fp32; the anchor preset is {m}")
  return {"vocab_size": m.vocab_size, "hidden_size": m.embed_dim,
          "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
          "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
          "intermediate_size": m.mlp_dim, "tie_word_embeddings": m.tie_embeddings,
          "max_position_embeddings": m.max_seq_len, "rope_theta": m.rope_theta,
          "rms_norm_eps": m.norm_eps, "prompts": r.prompts_per_step,
          "generations": r.group_size, "completion_tokens": r.max_new_tokens,
          "prompt_tokens": 16, "beta": config.algo.beta}


def run_trl(python, steps, tcmalloc=None):
  """TRL's step on the anchor shape, in its own interpreter (see the module docstring); on
  glibc malloc as TRL runs by default, or with `tcmalloc` (a library path) preloaded."""
  script = os.path.join(ROOT, "benchmarks", "peers", "trl_grpo_anchor.py")
  env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
  env.pop("XLA_FLAGS", None)
  preload = [x for x in env.pop("LD_PRELOAD", "").split(":") if x and "tcmalloc" not in x]
  if tcmalloc:
    preload.insert(0, tcmalloc)
  if preload:
    env["LD_PRELOAD"] = ":".join(preload)
  proc = subprocess.run([python, script, str(steps), json.dumps(anchor_spec())],
                        capture_output=True, text=True, env=env)
  if proc.returncode != 0:
    raise SystemExit(f"benchmarks/peers/trl_grpo_anchor.py failed under {python} "
                     f"(exit {proc.returncode}); its last output:\n{proc.stderr[-2000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--shapes", default="demo,anchor")
  p.add_argument("--trl-python", default=None,
                 help="an interpreter with torch and trl: also time TRL's GRPOTrainer on the "
                      "anchor shape after each round, in this run")
  p.add_argument("--rounds", type=int, default=1,
                 help="repeat the shapes (and the TRL run) this many times, interleaved")
  p.add_argument("--trl-tcmalloc", action="store_true",
                 help="also time TRL with tcmalloc preloaded (as jaxrl runs), each round")
  args = p.parse_args()
  allocator.ensure()  # jaxrl's side runs as the jaxrl command does (backends/cpu/allocator.py)
  if args.trl_python:  # fail before minutes of timing, not after
    check = subprocess.run([args.trl_python, "-c", "import torch, trl"], capture_output=True,
                           text=True)
    if check.returncode != 0:
      raise SystemExit(f"--trl-python {args.trl_python}: cannot import torch and trl there "
                       f"({(check.stderr.strip().splitlines() or ['no output'])[-1]})."
                       " Make a venv with them: python3.11 -m venv /tmp/peer && "
                       "/tmp/peer/bin/pip install torch==2.13.0 trl==1.16.0")
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, "
        f"load average {os.getloadavg()[0]:.1f}, {allocator.describe()}")
  trl_runs = [("TRL", None)]
  if args.trl_tcmalloc:
    if not allocator.loaded():
      raise SystemExit(f"--trl-tcmalloc: no tcmalloc here to preload ({allocator.describe()})")
    trl_runs.append(("TRL+tcm", allocator.loaded()))
  print(f"{'shape':13s} {'s/step':>7s} {'gen frac':>9s} {'gen wait':>9s} " +
        " ".join(f"{k + ' s':>9s}" for k in PHASES))
  results, trl_steps, trl_rates = [], {}, {}
  for _ in range(args.rounds):
    for shape in args.shapes.split(","):
      med = run_shape(shape, args.steps)
      results.append((shape, med))
      print(f"{shape:13s} {med['step']:7.2f} {med['frac']:9.2f} {med['wait']:9.3f} " +
            " ".join(f"{med[k]:9.3f}" for k in PHASES), flush=True)
    for name, lib in trl_runs if args.trl_python else ():
      t = run_trl(args.trl_python, args.steps, tcmalloc=lib)
      trl_steps.setdefault(name, []).append(t["step"])
      trl_rates.setdefault(name, []).append(trl_gflops(t))
      # TRL's scoring and reference forward are one phase there: shown under "ref s".
      print(f"{name + ' ' + t['trl']:13s} {t['step']:7.2f} {t['gen'] / t['step']:9.2f} "
            f"{'-':>9s} {t['gen']:9.3f} {'-':>9s} {t['score_ref']:9.3f} {t['update']:9.3f} "
            f"{'-':>9s}  (score + ref; torch {t['torch']}, transformers "
            f"{t.get('transformers', '?')}, {t['threads']} threads, "
            f"{t['params']:,} params, {t['completion_length']:.0f}-token completions)",
            flush=True)
  peers = {name: statistics.median(v) for name, v in trl_steps.items()}
  # A ratio only to a peer timed in this run: the machine's speed drifts by up to 1.5x over a
  # day, so a stored TRL figure would compare two different hours.
  print(f"\nmedians over {args.rounds} round(s); " + (
      "TRL from this run: " + ", ".join(f"{name} {t:.2f} s/step" for name, t in peers.items())
      if peers else "no ratio to TRL without --trl-python (run the peer beside jaxrl)"))
  for shape in args.shapes.split(","):
    if not shape.startswith("anchor"):
      continue
    step = statistics.median(m["step"] for s, m in results if s == shape)
    print(f"{shape:13s} {step:7.2f} s/step" + ("  " if peers else "") +
          "  ".join(f"{t / step:5.2f}x {name}" for name, t in peers.items()))
  # Model GFLOP/s by phase (jaxrl.models.flops): the same work counted the same way on both
  # sides, so it says how close each phase runs to the machine's product rate.
  print(f"\nmodel GFLOP/s by phase (medians; jaxrl counts each group's prompt once, as it runs "
        f"them)\n{'':13s} " + " ".join(f"{k:>9s}" for k in FLOP_PHASES))
  for shape in dict.fromkeys(s for s, _ in results):
    print(f"{shape:13s} " + " ".join(
        f"{statistics.median(m[f'gflops/{k}'] for s, m in results if s == shape):9.1f}"
        for k in FLOP_PHASES))
  for name, rates in trl_rates.items():
    print(f"{name:13s} " + " ".join(f"{statistics.median(r[k] for r in rates):9.1f}"
                                    for k in FLOP_PHASES))


if __name__ == "__main__":
  main()
