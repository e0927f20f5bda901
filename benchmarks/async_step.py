"""Async GRPO against synchronous on a long-tailed completion-length distribution: wall seconds
per update and perf/sampler_busy, side by side in one run (issue 39's benchmark).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/async_step.py

Placement: 8 CPU devices, disaggregated: 4 learn, 1 samples (placement.sampler_devices=1; the
other 3 idle). XLA's CPU client runs one multi-device program at a time in a process (it gang-
schedules them: PjRtCpuLoadedExecutable::Execute waits for the previous multi-device launch),
so a 4-device sampler's decode calls queue behind the learner's update and never run beside it;
a one-device program runs on its caller's thread and does. On this 2-core machine a 1-device
sampler decodes a rollout no slower than a 4-device one (sync's gen 0.19-0.21 s against
0.25-0.32 s): `sync-s4` is sync on the 4 + 4 placement, to show it (not run by default).
Every mode packs the learner's completions (algo.pack_completions: the long tail would pad
each of the 64 completion rows to 64 tokens); `sync-unpacked` shows sync without. The modes,
each a real `jaxrl grpo` run of --steps counted steps after --warmup steps (not counted):
  sync      the learner waits for each step's rollout
  sync-unpacked  the same with the padded learner batch
  sync-s4   sync, the sampler on all 4 devices the learner leaves
  async-k1  rollout.async_generation, max_staleness 1 (step n's rollout overlaps step n-1's
            update)
  async-k2p max_staleness 2 with partial rollouts (newer weights between decode calls)
  async-k2ps the same with rollout.streaming: the next unit's groups take the slots a unit's
            short completions free (jaxrl/algorithms/grpo/producer.py, "Streaming")
All use algo.tis_cap 2 (as configs/grpo_tiny.py:async), so they run the same programs.
The modes alternate within each round, and rounds repeat (--rounds): this machine is shared and
its speed drifts, so the modes are compared hour for hour.

Equal work: the modes sample with weights of different ages, so with learning on they generate
different completion lengths (the async modes' shorter, on this shape), and updates per second
alone would credit them with generating less. Each line therefore also gives completion tokens
per second (the step's 64 completions x their mean length, over the seconds per update), and
`--frozen` runs every mode with the weights frozen (optim.lr=1e-30, as
tests/test_async_grpo.py): then every mode samples the same groups from the same weights, the
same tokens, and its ratio to sync is the overlap alone.

The shape is benchmarks/grpo_step.py's anchor (the `bench` preset, 4.49M parameters, 8 prompts
x 8 generations, up to 64 new tokens, beta 0.04, fp32), with eos honoured instead of ignored.
A random policy almost never samples eos (1 of 512 tokens: 88% of completions ran to 64), so
the long tail is made: the eos row of the (tied) embedding is set to LONG_TAIL_SCALE times a
fixed random unit vector before training. Its logit is then that multiple of the hidden state's
projection on the vector: large for most contexts (early eos), negative for a few, which never
stop. Measured on the anchor's prompts (256 completions, seed 0, temperature 1): median 5 tokens,
quartiles 2 / 11, 90th percentile 26, and 5.5% run to the 64-token cap, so nearly every batch of
64 holds at least one full-length completion (1 - 0.945^64 = 97%). `--lengths` prints the
distribution this run's policy produces. The reward is the task's (the untrained policy earns
~0): the timing does not depend on it.

Prints, per round and mode, the median seconds per update (timing_s/step: wall time between two
logged steps, one logged per step), the median perf/sampler_busy (the producer's decoding
seconds over wall seconds; sync: the rollout's share of the step, perf/gen_fraction), the
learner's gen wait, the mean completion length, the sampler's slot utilisation (live slot-steps
over slot-steps: how much of each decode call the long tail leaves idle) and the update's
seconds (timing_s/update), the process's CPU seconds per counted step (every thread's: "cpu
s"), the seconds per counted step spent tracing, compiling or loading compiled programs ("jit
s"; see COMPILE_EVENTS) and over the whole run, warm-up included ("jit run": the run's one-time
cost, which s/update leaves out), and the median over the counted steps in which nothing was
traced, compiled or loaded ("warm s", with their count: packed batches take a few row counts,
each compiled once per run, and a 12-step run meets some after its warm-up; a long run pays
each once); then each mode's median over rounds, its throughput against
sync and its floor: its CPU seconds over the machine's cores, the fewest wall seconds an update
doing that work can take however well it overlaps.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile

# One persistent compilation cache for the whole run (as tests/conftest.py does): the modes and
# rounds compile the same programs, and on this shared 2-core machine a compile costs minutes.
# The warm-up steps are dropped either way, so it shortens the run, not the figures.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxrl-async-jit-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402  (after the cache settings above)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl import config as config_lib
from jaxrl.backends.cpu import allocator
from jaxrl.algorithms import grpo
from jaxrl.algorithms.grpo import trainer as trainer_lib
from jaxrl.train import run as run_lib
from jaxrl.train.rundir import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANCHOR = ["model.preset=bench", "rollout.prompts_per_step=8", "rollout.group_size=8",
          "rollout.max_new_tokens=64", "rollout.slots=64", "rollout.steps_per_call=16",
          "algo.beta=0.04", "algo.tis_cap=2.0", "placement.mode=disaggregated",
          "mesh.fsdp=-1", "placement.sampler_devices=1", "placement.sampler_mesh.data=-1",
          "algo.pack_completions=True"]
MODES = {
    "sync": [],
    "sync-unpacked": ["algo.pack_completions=False"],
    "sync-s4": ["placement.sampler_devices=-1"],
    "async-k1": ["rollout.async_generation=True", "rollout.max_staleness=1"],
    "async-k2p": ["rollout.async_generation=True", "rollout.max_staleness=2",
                  "rollout.partial_rollouts=True"],
    "async-k2ps": ["rollout.async_generation=True", "rollout.max_staleness=2",
                   "rollout.partial_rollouts=True", "rollout.streaming=True"],
}
COMPLETIONS = 64  # per update: the anchor's 8 prompts x 8
LONG_TAIL_SCALE = 4.0  # the eos embedding row's norm (see the module docstring)


def long_tail(params, eos_id: int):
  """`params` with the eos row of the tied embedding set to LONG_TAIL_SCALE x a fixed random
  unit vector: most contexts stop within a few tokens, a few never do."""
  embed = params["embed"]
  u = jax.random.normal(jax.random.key(1), (embed.shape[1],), embed.dtype)
  row = LONG_TAIL_SCALE * u / jnp.linalg.norm(u)
  return dict(params, embed=jax.jit(lambda e: e.at[eos_id].set(row),
                                    out_shardings=embed.sharding)(embed))


def patch_init():
  """Every run's starting policy gets the long tail (Run.init_state is where the GRPO trainer
  builds it; the reference is copied from it after, so both carry it)."""
  original = run_lib.Run.init_state

  def init_state(self, tx, **kwargs):
    graphdef, state, shardings = original(self, tx, **kwargs)
    if not self.cfg.tie_embeddings:
      raise SystemExit("the long tail is made on a tied embedding; the preset is untied")
    return graphdef, state.replace(params=long_tail(state.params, self.tokenizer.eos_id)), \
        shardings
  run_lib.Run.init_state = init_state


def mode_config(mode: str, steps: int, frozen: bool = False):
  overrides = ANCHOR + MODES[mode] + [f"train.steps={steps}", "train.log_every=1",
                                      "train.save_every=1000", "eval.every=0"]
  overrides += ["optim.lr=1e-30"] if frozen else []
  return config_lib.load_config(os.path.join(ROOT, "configs/grpo_tiny.py"), overrides)


# Tracing, lowering, compiling and persistent-cache loads (jax.monitoring's events), summed over
# a run's counted steps: streaming admits partial groups, so its prefill sees new (bucketed)
# shapes after the warm-up. Such seconds are in s/update; the "jit s" column shows how many.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration",
                  "/jax/compilation_cache/cache_retrieval_time_sec")
_counting = {"workdir": None, "warmup": 0, "seconds": 0.0, "all": 0.0, "per_step": {}}


def _on_event(event: str, duration: float, **_):
  """Adds a compile event's seconds once the run has logged its warm-up steps (the metrics file
  is read at each event: there are tens of them, not thousands)."""
  workdir = _counting["workdir"]
  if event not in COMPILE_EVENTS or workdir is None:
    return
  _counting["all"] += duration
  try:
    logged = sum("timing_s/gen" in r for r in read_metrics(workdir))
  except OSError:
    return
  if logged >= _counting["warmup"]:
    _counting["seconds"] += duration
  # by the step in progress (1-based, as the metrics' "step"): the producer's compiles land on
  # whichever learner step was running when they happened
  per_step = _counting["per_step"]
  per_step[logged + 1] = per_step.get(logged + 1, 0.0) + duration


def cpu_seconds() -> float:
  """The process's CPU seconds so far, every thread's (user + system)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def patch_step(marks: list):
  """Appends the process's CPU seconds at the start of every GRPO step to `marks` (the
  trainer's loop calls the module's step(); the producer thread's seconds are counted too)."""
  original = trainer_lib.step

  def step(p, state, prompts):
    marks.append(cpu_seconds())
    return original(p, state, prompts)
  trainer_lib.step = step
  return original


def run_mode(mode: str, steps: int, warmup: int, frozen: bool = False) -> dict:
  config = mode_config(mode, steps + warmup, frozen)
  marks: list[float] = []
  original = patch_step(marks)
  with tempfile.TemporaryDirectory() as workdir:
    _counting.update(workdir=workdir, warmup=warmup, seconds=0.0, all=0.0, per_step={})
    try:
      grpo.run(config, workdir, out=lambda *a: None)
    finally:
      _counting["workdir"] = None
      trainer_lib.step = original
    rows = [r for r in read_metrics(workdir) if "timing_s/gen" in r][warmup:]
  # CPU seconds per counted step: from one step's start to the next's (the last step has no
  # next, so steps - 1 of them).
  cpu = np.diff(marks)[warmup:]
  busy_key = "perf/sampler_busy" if mode.startswith("async") else "perf/gen_fraction"
  # Steps during which nothing was traced, compiled or loaded: the run's steady state.
  warm = [r["timing_s/step"] for r in rows if _counting["per_step"].get(r["step"], 0.0) < 0.01]
  return {"step": statistics.median(r["timing_s/step"] for r in rows),
          "warm": statistics.median(warm) if warm else float("nan"), "n_warm": len(warm),
          "busy": statistics.median(r[busy_key] for r in rows),
          "wait": statistics.median(r["timing_s/gen_wait"] for r in rows),
          "gen": statistics.median(r["timing_s/gen"] for r in rows),
          "len": statistics.mean(r["response_length/mean"] for r in rows),
          "tok_s": statistics.median(COMPLETIONS * r["response_length/mean"] / r["timing_s/step"]
                                     for r in rows),
          "stale": statistics.mean(r.get("staleness/mean", 0.0) for r in rows),
          "partial": statistics.mean(r.get("rollout/partial_frac", 0.0) for r in rows),
          "util": statistics.median(r["sampler/slot_utilisation"] for r in rows),
          "cpu": float(np.median(cpu)),
          "jit": _counting["seconds"] / len(rows), "jit_all": _counting["all"],
          "update": statistics.median(r["timing_s/update"] for r in rows)
          if "timing_s/update" in rows[0] else float("nan")}


def print_lengths():
  """The completion lengths the long-tailed starting policy samples on the anchor's prompts
  (one rollout of 8 x 8 per seed, 4 seeds): the distribution the timings run on."""
  from jaxrl.data.hf_tokenizer import tokenizer_for
  from jaxrl.data.prompts import Prompts
  from jaxrl.models import get_preset
  from jaxrl.parallel import init_params, make_mesh
  from jaxrl.sampler import Engine, SamplingParams, generate
  from jaxrl.train.data import load_task
  config = mode_config("sync", 1)
  tok = tokenizer_for(config)
  prompts = Prompts(tok, config.get("data"))
  ids = [prompts.ids(r) for r in load_task(config).records("train", 32, 0)]
  cfg, mesh = get_preset("bench"), make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, params = init_params(cfg, mesh, "sampler", seed=config.seed)
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(
      temperature=1.0, max_new_tokens=64, eos_id=tok.eos_id))
  params = long_tail(params, tok.eos_id)
  lengths = np.concatenate([generate(engine, params, ids[8 * s:8 * s + 8], n=8, slots=64,
                                     steps_per_call=16, seed=s).lengths for s in range(4)])
  q = np.percentile(lengths, [25, 50, 75, 90])
  print(f"completion lengths ({lengths.size}): mean {lengths.mean():.1f}, quartiles "
        f"{q[0]:.0f} / {q[1]:.0f} / {q[2]:.0f}, 90th percentile {q[3]:.0f}, "
        f"{(lengths >= 64).mean():.1%} at the 64-token cap")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--steps", type=int, default=6, help="counted steps per run")
  p.add_argument("--warmup", type=int, default=6,
                 help="steps not counted (compiles; async k=2 fills its queue)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--modes", default=",".join(m for m in MODES if m != "sync-s4"))
  p.add_argument("--frozen", action="store_true",
                 help="weights frozen (lr 1e-30): every mode generates the same tokens")
  p.add_argument("--lengths", action="store_true",
                 help="first print the long-tailed policy's completion-length distribution")
  args = p.parse_args()
  modes = args.modes.split(",")
  for m in modes:
    if m not in MODES:
      raise SystemExit(f"--modes: unknown mode {m!r}; use some of {', '.join(MODES)}")
  if jax.device_count() < 8:
    raise SystemExit(f"{jax.device_count()} devices: run with "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=8")
  allocator.ensure()
  patch_init()
  jax.monitoring.register_event_duration_secs_listener(_on_event)
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, {allocator.describe()}")
  if args.lengths:
    print_lengths()
  print(f"{'round':>5s} {'mode':10s} {'s/update':>9s} {'busy':>6s} {'wait s':>7s} "
        f"{'gen s':>7s} {'len':>6s} {'tok/s':>6s} {'stale':>6s} {'partial':>8s} {'util':>5s} "
        f"{'upd s':>6s} {'cpu s':>6s} {'jit s':>6s} {'jit run':>7s} {'warm s':>9s} {'load':>5s}")
  results: dict[str, list[dict]] = {m: [] for m in modes}
  for rnd in range(args.rounds):
    for m in modes:
      r = run_mode(m, args.steps, args.warmup, args.frozen)
      results[m].append(r)
      print(f"{rnd + 1:5d} {m:10s} {r['step']:9.2f} {r['busy']:6.2f} {r['wait']:7.2f} "
            f"{r['gen']:7.2f} {r['len']:6.1f} {r['tok_s']:6.0f} {r['stale']:6.2f} "
            f"{r['partial']:8.2f} {r['util']:5.2f} {r['update']:6.2f} {r['cpu']:6.2f} "
            f"{r['jit']:6.2f} {r['jit_all']:7.1f} {r['warm']:5.2f} ({r['n_warm']}) "
            f"{os.getloadavg()[0]:5.1f}",
            flush=True)
  cores = len(os.sched_getaffinity(0))
  print(f"\nmedians over {args.rounds} round(s) (sync's busy is its perf/gen_fraction); "
        f"floor: the CPU seconds an update costs over the {cores} cores, the fewest wall "
        "seconds any overlap could take for that work")
  def warm_median(rounds):  # over the rounds that had a step without compiles
    warm = [r["warm"] for r in rounds if r["n_warm"]]
    return statistics.median(warm) if warm else float("nan")

  base = statistics.median(r["step"] for r in results[modes[0]])
  base_tok = statistics.median(r["tok_s"] for r in results[modes[0]])
  base_warm = warm_median(results[modes[0]])
  for m in modes:
    step = statistics.median(r["step"] for r in results[m])
    busy = statistics.median(r["busy"] for r in results[m])
    cpu = statistics.median(r["cpu"] for r in results[m])
    warm = warm_median(results[m])
    tok = statistics.median(r["tok_s"] for r in results[m])
    print(f"{m:10s} {step:6.2f} s/update  sampler busy {busy:4.2f}  cpu {cpu:4.2f} s "
          f"(floor {cpu / cores:4.2f} s/update)  throughput {base / step:4.2f}x {modes[0]}  "
          f"without compiles {warm:4.2f} s/update, {base_warm / warm:4.2f}x  "
          f"{tok:5.0f} completion tok/s, {tok / base_tok:4.2f}x")


if __name__ == "__main__":
  main()
