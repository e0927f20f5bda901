"""The `jaxrl` console script: parses, dispatches, and turns ConfigError into one clear line.

    jaxrl <command> --config configs/<file>.py[:arg] [--config.a.b=value ...] --workdir DIR

The logic lives in importable modules (a notebook calls them directly); this file only parses.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata

from jaxrl.errors import ConfigError

_LIBS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "ml-collections",
         "numpy", "tokenizers", "safetensors")


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
  s = sub.add_parser("sample", help="completions for a JSONL file of prompts, printed and "
                     "written to DIR/completions.jsonl")
  _common(s, config_required=True)
  s.add_argument("--prompts", required=True, metavar="FILE", help='JSONL, {"prompt": ...} a line')
  s.add_argument("--n", type=int, default=None, help="samples per prompt (default: sampling.n)")
  s.add_argument("--checkpoint", metavar="DIR", help="checkpoint to sample from (not yet)")
  s = sub.add_parser("demo", help="the embedded default job (runs with no arguments)")
  _common(s, config_required=False)
  return p


def _split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
  rest, overrides = [], []
  for a in argv:
    (overrides if a.startswith("--config.") else rest).append(a)
  return rest, overrides


def _load(args, overrides):
  from jaxrl import config as config_lib
  if args.config is None:
    config = config_lib.base_config()
    config_lib.apply_overrides(config, overrides)
    config_lib.validate(config)
    return config
  return config_lib.load_config(args.config, overrides)


def cmd_info(args, overrides) -> None:
  import jax

  from jaxrl.parallel import describe, mesh_from_config
  print(f"python {platform.python_version()} ({sys.executable})")
  for lib in _LIBS:
    try:
      print(f"{lib:18s} {metadata.version(lib)}")
    except metadata.PackageNotFoundError:
      print(f"{lib:18s} not installed")
  print(f"backend            {jax.default_backend()}")
  print(f"processes          {jax.process_index()} of {jax.process_count()}")
  devs = jax.devices()
  kinds = sorted({d.device_kind for d in devs})
  print(f"devices            {len(devs)} ({', '.join(kinds)}); local {jax.local_device_count()}")
  config = _load(args, overrides)
  print(f"mesh               {describe(mesh_from_config(config.mesh))}")


def cmd_model(args, overrides) -> None:
  from jaxrl import config as config_lib
  from jaxrl.parallel import mesh_from_config, param_table
  config = _load(args, overrides)
  cfg = config_lib.model_config(config)
  mesh = mesh_from_config(config.mesh)
  print(f"model preset {config.model.preset!r} ({cfg.num_layers} layers, d={cfg.embed_dim}, "
        f"heads {cfg.num_heads}/{cfg.num_kv_heads} kv, vocab {cfg.vocab_size}, "
        f"params {cfg.param_dtype}, compute {cfg.dtype})")
  print(param_table(cfg, mesh, config.layout))


def cmd_sweep(args, overrides) -> None:
  from jaxrl import config as config_lib
  runs = config_lib.load_sweep(args.config)
  base = args.workdir or os.path.join("runs", os.path.splitext(os.path.basename(
      config_lib.split_spec(args.config)[0]))[0])
  plan = []
  for i, run in enumerate(runs):
    # Each run's overrides must apply and validate before anything is launched.
    config_lib.load_config(args.config, [*overrides, *(f"{k}={v}" for k, v in run.items())])
    argv = [args.run_command, "--config", args.config, *overrides,
            *(f"--config.{k}={v}" for k, v in run.items())]
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


def cmd_demo(args, overrides) -> None:
  from jaxrl import demo
  demo.run(_load(args, overrides))


def cmd_sample(args, overrides) -> None:
  from jaxrl.sampler import command
  command.run(_load(args, overrides), prompts_path=args.prompts, workdir=args.workdir, n=args.n,
              checkpoint=args.checkpoint)


COMMANDS = {"info": cmd_info, "model": cmd_model, "sweep": cmd_sweep, "demo": cmd_demo}
COMMANDS["sample"] = cmd_sample


def main(argv: list[str] | None = None) -> None:
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


if __name__ == "__main__":
  main()
