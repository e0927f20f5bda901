"""XManager launch of a jaxrl experiment: one work unit per run of the config's sweep(), each a
`jaxrl <command>` job on a Vertex AI TPU, in its own workdir under --workdir.

    pip install -e '.[xm]'   # in a venv of its own: xmanager pins an old protobuf
    xmanager launch tpu/xm_launch.py -- --config configs/sft_tiny.py --sweep \
        --accelerator-type v5litepod-8 --workdir gs://my-bucket/exp
    python tpu/xm_launch.py --config configs/sft_tiny.py --sweep --accelerator-type v5litepod-8 \
        --workdir gs://my-bucket/exp --print-specs       # the work units as JSON; no xmanager

The runs are the ones `jaxrl launch` expands (jaxrl.launch.expand), and the work units are
plain data built by jaxrl.launch.xm_job_specs (tested without xmanager); only main() below
touches the xm API.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl import launch  # noqa: E402  (after the checkout is on the path)
from jaxrl.errors import ConfigError  # noqa: E402


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, metavar="FILE[:ARG]")
  p.add_argument("--sweep", action="store_true", help="expand the config's sweep()")
  p.add_argument("--command", default="sft", choices=launch.TRAINERS)
  p.add_argument("--workdir", required=True, help="experiment root, e.g. gs://bucket/exp "
                 "(each run writes <root>/<run name>)")
  p.add_argument("--accelerator-type", default="v5litepod-8")
  p.add_argument("--base-image", default="python:3.12")
  p.add_argument("--print-specs", action="store_true",
                 help="print the work units as JSON and launch nothing")
  return p


def specs_from_args(args, overrides) -> list[dict]:
  runs = launch.expand(args.config, command=args.command, root=args.workdir,
                       overrides=overrides, sweep=args.sweep)
  return launch.xm_job_specs(runs, args.config, accelerator_type=args.accelerator_type,
                             experiment=os.path.basename(args.workdir.rstrip("/")))


def main(argv: list[str] | None = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  overrides = [a for a in argv if a.startswith("--config.")]
  args, rest = _parser().parse_known_args([a for a in argv if not a.startswith("--config.")])
  try:
    specs = specs_from_args(args, overrides)
  except ConfigError as e:
    raise SystemExit(f"xm_launch: error: {e}") from None
  if args.print_specs:
    print(json.dumps(specs, indent=2))
    return
  try:
    from absl import flags
    from xmanager import xm, xm_local
  except ImportError:
    raise SystemExit("xm_launch: xmanager is not installed: pip install -e '.[xm]' (in a venv "
                     "of its own), or pass --print-specs to see the work units.") from None
  flags.FLAGS([sys.argv[0], *rest], known_only=True)  # xmanager's own flags, if any

  name = os.path.basename(launch.ROOT)
  with xm_local.create_experiment(experiment_title=specs[0]["name"].split("/")[0]) as exp:
    [executable] = exp.package([xm.python_container(
        executor_spec=xm_local.Vertex.Spec(),
        path=launch.ROOT,
        base_image=args.base_image,
        # The checkout pinned by requirements.lock, with JAX's TPU extra.
        docker_instructions=[f"COPY {name}/ {name}", f"WORKDIR {name}",
                             "RUN python -m pip install -q -c requirements.lock -e . 'jax[tpu]'"],
        entrypoint=xm.ModuleName("jaxrl"))])
    for spec in specs:
      try:
        requirements = xm.JobRequirements(
            {xm.ResourceType[k]: v for k, v in spec["requirements"].items()})
      except KeyError as e:
        raise SystemExit(f"xm_launch: this xmanager has no resource {e}: it cannot request "
                         f"{spec['accelerator_type']}.") from None
      exp.add(xm.Job(executable=executable, executor=xm_local.Vertex(requirements=requirements),
                     args=spec["args"][1:], env_vars=spec["env"]))
      print(f"work unit {spec['name']}: {' '.join(spec['args'])}")


if __name__ == "__main__":
  main()
