"""A real-size row compiled with its layers unrolled and scanned (model.scan_layers), back to back.

    nice python benchmarks/scan_compile.py --only qwen3:4b,grpo,v5e
    nice python benchmarks/scan_compile.py --only qwen3:8b,grpo,v6e

Each program of the row (benchmarks/scale.py's configs and TPU topologies, `jaxrl plan
--compile`'s machinery: abstract arguments only) is compiled twice in one process, the model's
layers unrolled then scanned, and one JSON line per program and form is appended to
benchmarks/results/scan_compile.jsonl: the seconds to build the programs (tracing, the memory
plan) and to compile each, and XLA's memory_analysis. benchmarks/README.md and
docs/guides/scale.md quote the latest lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import scale  # noqa: E402
from jaxrl.parallel import compile as aot  # noqa: E402
from jaxrl.parallel.plan import estimate  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "scan_compile.jsonl")
GIB = 1 << 30


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", required=True, help="a row such as qwen3:4b,grpo,v5e")
  args = ap.parse_args()
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
  for scan in (False, True):
    config, module, chip = scale.load(args.only)
    config.model.scan_layers = scan
    devices = aot.topology_devices(scale.TOPOLOGY[chip])
    t = time.perf_counter()
    _, programs = module.programs(config, devices=devices)
    built = time.perf_counter() - t
    print(f"{args.only} scan_layers={scan}: programs built in {built:.1f} s", flush=True)
    for p in programs:
      e = estimate(p)
      x = aot.compile_program(p)
      line = {"row": args.only, "scan_layers": scan, "program": p.name,
              "date": datetime.date.today().isoformat(), "commit": commit,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "built_s": round(built, 1), "compile_s": round(x.compile_s, 1),
              "xla_gib": round(x.bytes / GIB, 3), "temp_gib": round(x.temp / GIB, 3),
              "plan_gib": round(e.program_peak / GIB, 3), "oom": x.oom}
      print(json.dumps(line), flush=True)
      with open(RESULTS, "a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
  main()
