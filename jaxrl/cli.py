"""The `jaxrl` console script: parses, dispatches, and turns ConfigError into one clear line.

    jaxrl <command> --config configs/<file>.py[:arg] [--config.a.b=value ...] --workdir DIR

The logic lives in importable modules (a notebook calls them directly); this file only parses.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
from importlib import metadata

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.parallel import describe, init_params, mesh_from_config, param_table
from jaxrl.parallel.plan import memory_plan, plan_programs, suggest
from jaxrl.parallel.sync import bench_sync, make_placement, memcpy_gb_per_s
from jaxrl.tasks import ERROR_MODES, get_task

_LIBS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "ml-collections",
         "numpy", "tokenizers", "safetensors")

# The trainer commands and the modules that own their defaults (default_config) and their
# sections' choices (CHOICES).
TRAINERS = {name: f"jaxrl.algorithms.{name}" for name in ("sft", "rm", "grpo", "dpo", "ppo")}

# Commands import the trainers, io, data, plot and launch inside their functions (lazy: the
# training stack adds about 2 s to start-up, which `jaxrl data`, `plot`, `compare` or `--help`
# should not pay). config and parallel come with the jaxrl package anyway.


def trainer(command: str):
  """The module of a trainer command (jaxrl.algorithms.grpo for "grpo"), imported now."""
  return importlib.import_module(TRAINERS[command])


def _choices(command: str | None):
  """The choices a command's config is validated against beyond the shared sections: its
  module's CHOICES (a trainer's, or `jaxrl sample`'s), or none."""
  if command == "sample":
    from jaxrl.sampler import command as sample_command
    return sample_command.CHOICES
  if command == "eval":
    from jaxrl.evals import command as eval_command
    return eval_command.CHOICES
  return trainer(command).CHOICES if command in TRAINERS else None


def _common(p: argparse.ArgumentParser, *, config_required: bool) -> None:
  p.add_argument("--config", required=config_required, metavar="FILE[:ARG]",
                 help="config file whose get_config(arg) returns a ConfigDict; override any "
                 "field with --config.a.b=value")
  p.add_argument("--workdir", metavar="DIR", help="run directory")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jaxrl", description="JAX-native post-training for language models.",
      epilog="Any command taking --config also takes --config.a.b=value overrides.")
  sub = p.add_subparsers(dest="command", metavar="<command>")
  s = sub.add_parser("info", help="JAX and library versions, devices, and the mesh a config "
                     "would build")
  _common(s, config_required=False)
  s = sub.add_parser("model", help="parameter table, parameter count and bytes per device for "
                     "the config's model, mesh and layout")
  _common(s, config_required=True)
  s = sub.add_parser("sweep", help="expand the config file's sweep() into runs")
  _common(s, config_required=True)
  s.add_argument("--dry-run", action="store_true", help="list the runs without running them")
  s.add_argument("--command", dest="run_command", default="model",
                 help="the jaxrl command each run executes (default: model)")
  s.add_argument("--seeds", metavar="SEEDS", help="each run once per seed, e.g. 0-4")
  s = sub.add_parser("plan", help="memory plan of a trainer's config: bytes per device for each "
                     "role and program, and whether it fits a device")
  _common(s, config_required=True)
  s.add_argument("--compile", metavar="TOPOLOGY", help="also compile the trainer's programs for "
                 "a TPU topology (e.g. v5e:2x4, v5p:2x2x1, v6e:2x4; needs libtpu) and print "
                 "XLA's bytes and a roofline time per chip")
  s = sub.add_parser("bench", help="measure a systems figure on this machine (sync: learner -> "
                     "sampler weight sync against memcpy)")
  s.add_argument("what", choices=["sync"])
  _common(s, config_required=True)
  s.add_argument("--repeats", type=int, default=10)
  s = sub.add_parser("convert", help="checkpoints: hf-to-jaxrl (a Hugging Face directory into "
                     "jaxrl's format) or jaxrl-to-hf (back to config.json + safetensors)")
  s.add_argument("direction", choices=["hf-to-jaxrl", "jaxrl-to-hf"])
  s.add_argument("--src", metavar="DIR", help="hf-to-jaxrl: the Hugging Face checkpoint")
  s.add_argument("--checkpoint", metavar="DIR", help="jaxrl-to-hf: the jaxrl checkpoint, or a "
                 "jaxrl sft / grpo run directory (its latest params)")
  s.add_argument("--out", metavar="DIR", required=True, help="directory to write")
  s.add_argument("--param-dtype", choices=["float32", "bfloat16"],
                 help="hf-to-jaxrl: parameter dtype (default: the checkpoint's own)")
  s.add_argument("--max-shard-mb", type=float, default=2048.0,
                 help="jaxrl-to-hf: largest safetensors file (default 2048 MiB)")
  s.add_argument("--merge", action="store_true", help="jaxrl-to-hf of a LoRA checkpoint: full "
                 "weights with the adapters merged (default: the PEFT adapter; "
                 "docs/guides/peft.md)")
  _common(s, config_required=False)
  s = sub.add_parser("sample", help="completions for a JSONL file of prompts, printed and "
                     "written to DIR/completions.jsonl")
  _common(s, config_required=True)
  s.add_argument("--prompts", required=True, metavar="FILE", help='JSONL, {"prompt": ...}, '
                 '{"messages": [...]} or {"prompt_ids": [...]} a line')
  s.add_argument("--n", type=int, default=None, help="samples per prompt (default: sampling.n)")
  s.add_argument("--checkpoint", metavar="DIR",
                 help="a jaxrl sft / grpo / dpo run directory (its latest params, with the "
                 "tokenizer of the checkpoint it started from) or a Hugging Face checkpoint; "
                 "without it, model.hf_path's weights, else a random init")
  s = sub.add_parser("eval", help="held-out metrics of a checkpoint (greedy accuracy; pass@k, "
                     "mean@k, maj@k with eval.n > 0): DIR/eval.json and DIR/completions.jsonl")
  _common(s, config_required=True)
  s.add_argument("--checkpoint", metavar="RUN", help="a jaxrl sft or grpo run directory (its "
                 "latest params); without it, model.hf_path's weights")
  s.add_argument("--data", metavar="FILE", help='JSONL, {"prompt", "answer"} a line (default: '
                 "data.eval_file, else data.task's test split)")
  s = sub.add_parser("demo", help="the embedded default job (runs with no arguments)")
  _common(s, config_required=False)
  _data_parser(sub)
  s = sub.add_parser("sft", help="supervised fine-tuning; re-running on a workdir resumes it")
  _common(s, config_required=True)
  s = sub.add_parser("rm", help="reward-model training on preference pairs (Bradley-Terry); "
                     "re-running on a workdir resumes it")
  _common(s, config_required=True)
  s = sub.add_parser("grpo", help="GRPO-family RL (generate, score, update); re-running on a "
                     "workdir resumes it")
  _common(s, config_required=True)
  s = sub.add_parser("ppo", help="PPO with a learned critic and GAE (generate, score, values, "
                     "update actor and critic); re-running on a workdir resumes it")
  _common(s, config_required=True)
  s = sub.add_parser("dpo", help="offline preference optimisation (loss=dpo|ipo|kto|orpo|"
                     "simpo) on preference pairs; re-running on a workdir resumes it")
  _common(s, config_required=True)
  _launch_parser(sub)
  s = sub.add_parser("compare", help="final metrics of runs side by side, and a PNG of chosen "
                     "metrics over steps")
  s.add_argument("dirs", nargs="+", metavar="DIR", help="run directories, or experiment roots "
                 "written by `jaxrl launch`")
  s.add_argument("--metrics", help="comma list of metrics (default: loss, reward/mean, kl, "
                 "accuracy, eval/accuracy, those logged)")
  s.add_argument("--out", default="compare.png", metavar="FILE.png",
                 help="plot to write (default compare.png)")
  s = sub.add_parser("plot", help="the standard panels of a run (reward, accuracy, KL, "
                     "entropy, lengths, loss, timing split) as PNGs in DIR/plots")
  s.add_argument("dir", metavar="DIR", help="a run directory (holds metrics.jsonl)")
  s.add_argument("--out", metavar="OUT_DIR", help="where to write (default DIR/plots)")
  return p


def _launch_parser(sub) -> None:
  s = sub.add_parser("launch", help="an experiment: the config's sweep() as runs, each in "
                     "ROOT/<run name>, here (N at a time) or on a TPU VM")
  _common(s, config_required=True)
  s.add_argument("--sweep", action="store_true", help="expand the config file's sweep() "
                 "(without it: one run of the config as it is)")
  s.add_argument("--command", dest="run_command", choices=tuple(TRAINERS),
                 help="trainer each run executes (default: from the config's sections: ppo "
                 "with critic, grpo with rollout, dpo with ref, rm with head, else sft)")
  s.add_argument("--seeds", metavar="SEEDS", help="run each run once per seed (the top-level "
                 "`seed`), e.g. 0-4 or 0,3,7; `jaxrl compare` aggregates them")
  s.add_argument("--parallel", type=int, default=1, metavar="N",
                 help="local runs at a time (default 1: one after another)")
  s.add_argument("--dry-run", action="store_true", help="print the runs and commands (with "
                 "--tpu: the exact gcloud commands); run and write nothing")
  t = s.add_argument_group("TPU VM (tpu/*.sh; create the VM first with tpu/create.sh)")
  t.add_argument("--tpu", metavar="NAME", help="run on this TPU VM, one run after another")
  t.add_argument("--zone")
  t.add_argument("--project", default="")
  t.add_argument("--accelerator-type", default="", metavar="TYPE", help="e.g. v5litepod-8")
  t.add_argument("--workers", type=int, default=0, help="hosts in the slice (instead of "
                 "--accelerator-type)")
  t.add_argument("--log-dir", default="runs/tpu-logs", help="where each worker's log comes "
                 "back to (default runs/tpu-logs)")
  t.add_argument("--no-setup", action="store_true", help="skip tpu/setup.sh (code already "
                 "on the workers)")


def _data_parser(sub) -> None:
  s = sub.add_parser("data", help="data tools: `data export` writes a built-in task as JSONL, "
                     "`data prefs` its preference pairs")
  data_sub = s.add_subparsers(dest="data_command", metavar="<data command>", required=True)
  e = data_sub.add_parser("export", help="write a built-in task's records in the standard "
                          "JSONL format (what your own files must look like)")
  e.add_argument("--task", required=True, help="built-in task name, e.g. addition")
  e.add_argument("--split", default="train", choices=("train", "test"))
  e.add_argument("--n", type=int, required=True, help="number of records")
  e.add_argument("--out", required=True, metavar="FILE.jsonl", help="output file")
  e.add_argument("--format", default="rl", choices=("rl", "sft"),
                 help="rl: {prompt, answer}; sft: {prompt, completion} (default: rl)")
  e.add_argument("--error-rate", type=float, default=0.0,
                 help="sft only: fraction of deliberately wrong completions (default 0)")
  e.add_argument("--error-mode", default="random", choices=ERROR_MODES,
                 help="sft only: random slips on that fraction of all records, or the task's "
                      "systematic mistake (addition: a dropped carry) on that fraction of the "
                      "records where it applies (default: random)")
  e.add_argument("--seed", type=int, default=0)
  f = data_sub.add_parser("prefs", help="write preference pairs {prompt, chosen, rejected} "
                          "from a built-in task (chosen correct, rejected wrong), optionally "
                          "from a biased labeller")
  f.add_argument("--task", required=True, help="built-in task name, e.g. addition")
  f.add_argument("--split", default="train", choices=("train", "test"))
  f.add_argument("--n", type=int, required=True, help="number of pairs")
  f.add_argument("--out", required=True, metavar="FILE.jsonl", help="output file")
  f.add_argument("--bias", default="none", choices=("none", "longer"),
                 help="longer: prefer the longer answer regardless of correctness (a proxy "
                 "to hack, for the reward-hacking demonstration)")
  f.add_argument("--bias-rate", type=float, default=1.0,
                 help="fraction of pairs labelled by the biased labeller (default 1)")
  f.add_argument("--seed", type=int, default=0)


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
  rest, overrides = [], []
  for a in argv:
    (overrides if a.startswith("--config.") else rest).append(a)
  return rest, overrides


def _load(args, overrides, choices=None):
  if args.config is None:
    config = config_lib.base_config()
    config_lib.apply_overrides(config, overrides)
    config_lib.validate(config, choices)
    return config
  return config_lib.load_config(args.config, overrides, choices)


def _model_name(config) -> str:
  """How commands name the model: the preset, or model.hf_path (and whether it is there)."""
  path = config.model.get("hf_path") or ""
  if not path:
    return repr(config.model.preset)
  if os.path.isfile(os.path.join(path, "config.json")):
    return f"{path!r} (config.json)"
  return (f"{config.model.preset!r} (model.hf_path={path!r} is not there yet: shapes from the "
          "preset)")


def cmd_info(args, overrides) -> None:
  import jax

  print(f"python {platform.python_version()} ({sys.executable})")
  for lib in _LIBS:
    try:
      print(f"{lib:18s} {metadata.version(lib)}")
    except metadata.PackageNotFoundError:
      print(f"{lib:18s} not installed")
  from jaxrl import backends
  backend = backends.describe()
  print(f"allocator          {backend['allocator']}")
  print(f"backend            {jax.default_backend()}")
  print(f"attention          {backend['attention']}")
  print(f"dots               {backend['dots']}")
  print(f"processes          {jax.process_index()} of {jax.process_count()}")
  devs = jax.devices()
  kinds = sorted({d.device_kind for d in devs})
  print(f"devices            {len(devs)} ({', '.join(kinds)}); local {jax.local_device_count()}")
  config = _load(args, overrides)
  print(f"mesh               {describe(mesh_from_config(config.mesh))}")


def cmd_model(args, overrides) -> None:
  config = _load(args, overrides)
  cfg = config_lib.model_config(config)
  mesh = mesh_from_config(config.mesh)
  print(f"model {_model_name(config)} ({cfg.num_layers} layers, d={cfg.embed_dim}, "
        f"heads {cfg.num_heads}/{cfg.num_kv_heads} kv, vocab {cfg.vocab_size}, "
        f"params {cfg.param_dtype}, compute {cfg.dtype})")
  print(param_table(cfg, mesh, config.layout))


def cmd_sweep(args, overrides) -> None:
  from jaxrl import launch
  base = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(
      config_lib.split_spec(args.config)[0]))[0])
  plan = []
  # Every run's overrides apply and validate before anything is launched (as jaxrl launch).
  check = ((lambda config: _check_sections(config, args.run_command, args.config))
           if args.run_command in TRAINERS else None)
  seeds = launch.parse_seeds(args.seeds) if args.seeds else None
  for i, (run, extra, _) in enumerate(launch.sweep_items(
      args.config, overrides, choices=_choices(args.run_command), check=check, seeds=seeds)):
    argv = [args.run_command, "--config", args.config, *overrides, *extra]
    workdir = os.path.join(base, f"run{i:03d}")
    if args.run_command not in ("info", "model"):
      argv += ["--workdir", workdir]
    plan.append(argv)
    print(f"[{i}] workdir={workdir} " + " ".join(f"{k}={v}" for k, v in run.items()))
    print("    jaxrl " + " ".join(argv))
  if args.dry_run:
    print(f"{len(plan)} runs (dry run: nothing launched)")
    return
  for i, argv in enumerate(plan):
    print(f"--- run {i + 1}/{len(plan)}", flush=True)
    main(argv)


def _placement(config):
  return make_placement(config.mesh, config.get("placement"))


def cmd_plan(args, overrides) -> None:
  """The trainer's memory plan (its own programs function), optionally checked by compiling
  for a TPU topology (jaxrl.parallel.compile)."""
  from jaxrl.parallel import compile as aot
  from jaxrl.rewards.model import plan_roles
  from jaxrl.train.rundir import infer_command
  command = infer_command(_load(args, overrides).to_dict())
  if command not in TRAINERS:
    raise ConfigError(f"jaxrl plan reads a trainer's config (sft, rm, dpo, grpo, ppo): "
                      f"{args.config} is none of them; plan e.g. configs/grpo_tiny.py.")
  module = trainer(command)
  config = _load(args, overrides, module.CHOICES)
  import jax
  slice_ = config.get("plan", {}).get("topology", "") if jax.default_backend() != "tpu" else ""
  try:
    devices = aot.topology_devices(args.compile or slice_) if args.compile or slice_ else None
  except ConfigError as e:
    if args.compile:
      raise
    raise ConfigError(f"{e} Or plan this machine's devices instead: --config.plan.topology= "
                      "(with XLA_FLAGS=--xla_force_host_platform_device_count=8 for 8 fake "
                      "CPU devices).") from None
  if slice_ and not args.compile:
    print(f"planned for {slice_} (plan.topology): {len(devices)} abstract TPU chips, as there "
          f"is no TPU here (--config.plan.topology= plans this machine's "
          f"{jax.device_count()} {jax.default_backend()} devices instead)")
  if not args.compile:  # traced with the layers scanned, counted as the config's own form (the
    # plans agree to the byte: tests/test_scan.py), in about two thirds of the time at 8B
    config.model.scan_layers = True
  work, programs = module.programs(config, devices=devices)
  cfg = config_lib.model_config(config)
  placement = make_placement(config.mesh, config.get("placement"), devices=devices)
  print(f"{command}: model {_model_name(config)}: {cfg.num_params:,} parameters "
        f"({cfg.param_dtype}; compute {cfg.dtype}; remat {work.remat}; log-prob chunk "
        f"{work.logits_chunk or 'off'})")
  print(f"learner: {describe(placement.learner.mesh)}")
  if work.slots:
    print(f"sampler: {describe(placement.sampler.mesh)}")
  sync_dtype = config.placement.sync_dtype if "placement" in config else ""
  # The roles say what the bytes are; the programs' peak is the verdict (and, when it does not
  # fit, the roles' suggestions say what to change).
  ref_dtype = config.placement.get("ref_dtype", "") if "placement" in config else ""
  roles = memory_plan(cfg, placement, None, workload=work, sync_dtype=sync_dtype,
                      ref_dtype=ref_dtype, reward_models=plan_roles(config))
  print(roles.table())
  plan = plan_programs(programs, config.get("plan"))
  print(plan.table())
  if plan.fits is False:
    roles.device_bytes = plan.device_bytes
    print("\n".join(f"  - {x}" for x in suggest(roles, placement, work, cfg)))
  if args.compile:
    compiled = []
    for p in programs:
      print(f"compiling {p.name} for {args.compile} ...", flush=True)
      compiled.append(aot.compile_program(p))
    print(aot.report(programs, plan.estimates, compiled, aot.chip_of(args.compile))[0])


def cmd_bench(args, overrides) -> None:
  config = _load(args, overrides)
  cfg = config_lib.model_config(config)
  placement = _placement(config)
  _, params = init_params(cfg, placement.learner.mesh, "learner", seed=config.seed)
  sync_dtype = config.placement.sync_dtype if "placement" in config else ""
  med = bench_sync(cfg, placement, params, repeats=args.repeats, dtype=sync_dtype or None)
  mem = memcpy_gb_per_s(med.bytes)
  print(f"{placement.mode}: learner {describe(placement.learner.mesh)} -> sampler "
        f"{describe(placement.sampler.mesh)}")
  print(f"model {config.model.preset!r}, {med.bytes / 2**20:.1f} MiB moved per sync "
        f"({sync_dtype or cfg.param_dtype}), {args.repeats} repeats")
  print(f"sync   median {med.ms:9.2f} ms  {med.gb_per_s:7.2f} GB/s")
  print(f"memcpy same bytes          {mem:7.2f} GB/s  (numpy, one host thread)")
  print(f"sync / memcpy: {med.gb_per_s / mem:.2f}x")
  if cfg.lora_rank:  # LoRA: each RL step moves only the adapters (WeightSync)
    ad = bench_sync(cfg, placement, params, repeats=args.repeats, dtype=sync_dtype or None,
                    adapters_only=True)
    print(f"LoRA r={cfg.lora_rank} ({','.join(cfg.lora_targets)}): adapters only "
          f"{ad.bytes / 2**20:.2f} MiB, median {ad.ms:9.2f} ms with the merge on the sampler, "
          f"against the full sync's {med.bytes / 2**20:.1f} MiB, {med.ms:.2f} ms "
          f"({med.ms / max(ad.ms, 1e-9):.1f}x faster)")


def cmd_convert(args, overrides) -> None:
  from jaxrl.io import hf
  config = _load(args, overrides)
  mesh = mesh_from_config(config.mesh)
  if args.direction == "hf-to-jaxrl":
    if not args.src:
      raise ConfigError("convert hf-to-jaxrl needs --src DIR (a Hugging Face checkpoint).")
    cfg = hf.hf_to_jaxrl(args.src, args.out, mesh, param_dtype=args.param_dtype)
  else:
    if not args.checkpoint:
      raise ConfigError("convert jaxrl-to-hf needs --checkpoint DIR (a jaxrl checkpoint).")
    files = hf.jaxrl_to_hf(args.checkpoint, args.out, mesh, merge=args.merge,
                           max_shard_bytes=int(args.max_shard_mb * 2**20))
    print(f"wrote {len(files)} files: {', '.join(files)}")
    if "adapter_config.json" in files:  # a LoRA checkpoint, exported as a PEFT adapter
      from jaxrl.io import peft
      peft.describe(args.out, out=print)
      return
    cfg = hf.config_from_hf(hf.read_hf_config(args.out))
  print(f"{args.direction}: {cfg.num_params:,} parameters ({cfg.param_dtype}, "
        f"{cfg.num_layers} layers, family {hf.family_for(cfg)}) -> {args.out}  [{describe(mesh)}]")


def cmd_demo(args, overrides) -> None:
  from jaxrl import demo
  if args.config:
    raise ConfigError("jaxrl demo runs the embedded configs (configs/sft_tiny.py, then "
                      "configs/grpo_tiny.py): drop --config; --config.a.b=value overrides apply "
                      "to both.")
  demo.run(args.workdir or "runs/demo", overrides=overrides)


def cmd_data(args, overrides) -> None:
  from jaxrl.data import write_jsonl
  if overrides:
    raise ConfigError(f"jaxrl data takes no --config overrides, got {overrides[0]!r}.")
  task = get_task(args.task)
  if args.data_command == "prefs":
    from jaxrl.data.prefs import fingerprint, task_prefs
    records = task_prefs(task, args.split, args.n, args.seed, bias=args.bias,
                         bias_rate=args.bias_rate)
    n = write_jsonl(args.out, records)
    print(f"wrote {n} preference pairs of task {task.name!r} ({args.split} split, seed "
          f"{args.seed}, bias {args.bias}"
          f"{f' at rate {args.bias_rate}' if args.bias != 'none' else ''}) to {args.out}; "
          f"fingerprint {fingerprint(records)}")
    return
  if args.format == "sft":
    records = task.sft_records(args.split, args.n, args.seed, error_rate=args.error_rate,
                               error_mode=args.error_mode)
  elif args.error_rate or args.error_mode != ERROR_MODES[0]:
    flag = "--error-rate" if args.error_rate else "--error-mode"
    raise ConfigError(f"{flag} applies to --format sft only: drop it or add --format sft.")
  else:
    records = task.records(args.split, args.n, args.seed)
  n = write_jsonl(args.out, records)
  print(f"wrote {n} {args.format} records of task {task.name!r} ({args.split} split, seed "
        f"{args.seed}) to {args.out}")


def _check_sections(config, command: str, spec: str | None) -> None:
  """A trainer command's config has that trainer's sections, no others (else one sentence
  naming the command the config is for)."""
  config_lib.check_sections(config, command, lambda c: trainer(c).default_config().keys(),
                            TRAINERS, spec=config_lib.split_spec(spec)[0] if spec else "")


def cmd_train(args, overrides) -> None:
  """jaxrl sft | rm | grpo | dpo: the trainer's config, checked against its choices, then run."""
  from jaxrl.train import run_trainer
  module = trainer(args.command)

  def load(a, o):
    config = _load(a, o, module.CHOICES)
    _check_sections(config, args.command, a.config)
    return config
  run_trainer(module.run, args, overrides, load)


def cmd_sample(args, overrides) -> None:
  from jaxrl.sampler import command
  command.run(_load(args, overrides, _choices("sample")), prompts_path=args.prompts,
              workdir=args.workdir, n=args.n, checkpoint=args.checkpoint)


def cmd_eval(args, overrides) -> None:
  from jaxrl.evals import command
  command.run(command.load(args.config, overrides), checkpoint=args.checkpoint,
              data=args.data, workdir=args.workdir)


def cmd_launch(args, overrides) -> None:
  from jaxrl import launch
  from jaxrl.plot import compare_table
  spec = args.config
  command = args.run_command or launch.command_of(config_lib.load_config(spec))
  root = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(
      config_lib.split_spec(spec)[0]))[0])
  runs = launch.expand(spec, command=command, root=root, overrides=overrides, sweep=args.sweep,
                       choices=_choices(command),
                       check=lambda config: _check_sections(config, command, spec),
                       seeds=launch.parse_seeds(args.seeds) if args.seeds else None)
  experiment = os.path.basename(root.rstrip("/"))
  print(f"experiment {experiment!r}: {len(runs)} run(s) of `jaxrl {command}` under {root}")
  launch.describe(runs)
  if args.tpu:
    if not args.zone:
      raise ConfigError("jaxrl launch --tpu needs --zone (the TPU VM's zone).")
    cmds = launch.tpu_commands(runs, spec, name=args.tpu, zone=args.zone, experiment=experiment,
                               accelerator_type=args.accelerator_type, workers=args.workers,
                               project=args.project, log_dir=args.log_dir,
                               setup=not args.no_setup, dry_run=args.dry_run)
    if args.dry_run:
      print("dry run: the TPU scripts print their gcloud commands and call nothing")
    raise SystemExit(launch.run_tpu(cmds))
  if "://" in root:
    raise ConfigError(f"--workdir {root}: local runs need a local directory (gs:// workdirs "
                      "are for --tpu, where setup.sh mounts the bucket).")
  if args.dry_run:
    print(f"{len(runs)} run(s) (dry run: nothing launched, nothing written)")
    return
  launch.write_experiment(runs, root, spec)
  results = launch.run_local(runs, parallel=args.parallel)
  failed = [r for r in results if r.returncode]
  print(f"\n{len(results) - len(failed)} of {len(runs)} run(s) finished ok")
  done = [r.workdir for r in runs if os.path.isfile(os.path.join(r.workdir, "metrics.jsonl"))]
  if done:
    table, names = compare_table(done)
    print(table)
    if args.seeds and names:
      _print_spread(done, names)
  if failed or len(results) < len(runs):
    raise SystemExit(1)


def _print_spread(dirs: list[str], names: list[str]) -> None:
  """The runs' spread over seeds: per group of runs that differ only in seed, each metric's
  n, mean, std, median, min and max (jaxrl.plot.aggregate)."""
  from jaxrl.plot import aggregate, aggregate_table
  print("\nover seeds (final values):")
  print(aggregate_table(aggregate(dirs, names), names))


def cmd_compare(args, overrides) -> None:
  from jaxrl.plot import compare_table, group_runs, plot_bands, plot_compare, run_dirs
  if overrides:
    raise ConfigError(f"jaxrl compare takes no --config overrides, got {overrides[0]!r}.")
  dirs = run_dirs(args.dirs)
  metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
  table, names = compare_table(dirs, metrics)
  print(table)
  # Runs that differ only in their seed are aggregated: their spread, and a band plot.
  seeded = any(len(members) > 1 for members in group_runs(dirs).values())
  if seeded and names:
    _print_spread(dirs, names)
  if names:
    plot = plot_bands if seeded else plot_compare
    print(f"plot: {plot(dirs, names, args.out)}")


def cmd_plot(args, overrides) -> None:
  from jaxrl.plot import plot_standard
  if overrides:
    raise ConfigError(f"jaxrl plot takes no --config overrides, got {overrides[0]!r}.")
  if not os.path.isfile(os.path.join(args.dir, "metrics.jsonl")):
    raise ConfigError(f"{args.dir} holds no metrics.jsonl: give a run directory (the --workdir "
                      "of jaxrl sft / grpo).")
  written = plot_standard(args.dir, args.out)
  for panel, path in written.items():
    print(f"{panel:<9} {path}")
  print(f"TensorBoard: tensorboard --logdir {os.path.join(args.dir, 'tb')}")


COMMANDS = {"info": cmd_info, "model": cmd_model, "sweep": cmd_sweep, "plan": cmd_plan,
            "bench": cmd_bench, "convert": cmd_convert, "demo": cmd_demo, "data": cmd_data,
            "sft": cmd_train, "rm": cmd_train, "grpo": cmd_train, "dpo": cmd_train,
            "ppo": cmd_train, "sample": cmd_sample, "eval": cmd_eval, "launch": cmd_launch,
            "compare": cmd_compare, "plot": cmd_plot}


def main(argv: list[str] | None = None) -> None:
  """The command line (the console script, jaxrl.__main__, re-executes on TCMalloc first)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  rest, overrides = _split_overrides(argv)
  parser = _parser()
  args = parser.parse_args(rest)
  if args.command is None:
    parser.print_help()
    raise SystemExit(2)
  try:
    COMMANDS[args.command](args, overrides)
  except ConfigError as e:
    print(f"jaxrl {args.command}: error: {e}", file=sys.stderr)
    raise SystemExit(2) from None


if __name__ == "__main__":  # python -m jaxrl.cli: on TCMalloc too, after this module's imports
  from jaxrl.backends.cpu import allocator  # (python -m jaxrl re-executes before them)
  allocator.ensure_or_exit()
  main()
