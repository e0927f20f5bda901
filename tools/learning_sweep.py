"""The learning tests' bars over the float roundings of the CPUs CI can land on: runs the tests
marked `learning` (those that take the `bars` fixture, tests/conftest.py) once per cell of ISA
level x learner dot kernel x seed, and tabulates every recorded figure beside its bar.

    .venv/bin/python tools/learning_sweep.py --isa native,AVX --dots eigen,ynnpack \\
        --seeds 0-2 --out runs/learning_sweep

A cell is one pytest session (`-m learning -n 2`) under XLA_FLAGS=--xla_cpu_max_isa=ISA (none
for `native`: the machine's own), JAXRL_CPU_DOTS=DOTS and JAXRL_LEARN_SEED=SEED (the seed of
the learning runs and of the shared runs they start from). Figures come back as junit-XML
properties; each cell's XML is kept in OUT (a finished cell is not re-run), and the table,
each test's bars, a line per cell (the lines in its docstring) and each figure's worst cell,
is printed and written to OUT/table.md. -k and other arguments after `--` reach pytest.

--xla_cpu_max_isa caps XLA's own code generation (elementwise fusions, Eigen dots) below the
machine's ISA, so an AVX-512 machine reproduces an AVX2 one's rounding (and `auto` dots then
choose Eigen, as an AVX2 machine does); YNNPACK's dot kernels pick their ISA themselves. No
flag lifts a machine above its own ISA: an AVX-512 cell needs an AVX-512 machine.
"""

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def seeds_of(text: str) -> list[int]:
  out = []
  for part in text.split(","):
    lo, _, hi = part.partition("-")
    out += list(range(int(lo), int(hi or lo) + 1))
  return out


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      lines = f.read().splitlines()
  except OSError:
    return "unknown CPU"
  name = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "?")
  flags = next((set(x.split(":", 1)[1].split()) for x in lines if x.startswith("flags")), set())
  isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "below AVX2"
  return f"{name} ({isa}{', AMX' if 'amx_tile' in flags else ''})"


def run_cell(isa: str, dots: str, seed: int, xml: str, extra: list[str]) -> float:
  """Runs one cell's pytest session into `xml`; its wall seconds."""
  env = dict(os.environ, JAXRL_CPU_DOTS=dots, JAXRL_LEARN_SEED=str(seed))
  env.pop("XLA_FLAGS", None)
  if isa != "native":
    env["XLA_FLAGS"] = f"--xla_cpu_max_isa={isa}"
  cmd = [sys.executable, "-m", "pytest", "-q", "-m", "learning", "-n", "2", "--dist",
         "worksteal", "-p", "no:cacheprovider", f"--junitxml={xml}.part", *extra]
  t0 = time.perf_counter()
  res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
  tail = res.stdout.strip().splitlines()[-1:] or ["(no output)"]
  print(f"    pytest exit {res.returncode}: {tail[0]}", flush=True)
  if not os.path.exists(f"{xml}.part"):
    raise SystemExit(f"pytest wrote no junit XML for this cell:\n{res.stdout[-3000:]}")
  os.replace(f"{xml}.part", xml)
  return time.perf_counter() - t0


def read_cell(xml: str) -> dict[str, tuple[str, dict[str, str]]]:
  """{test name: (outcome, {figure: "value op bar"})} of one cell's junit XML."""
  out = {}
  for case in ET.parse(xml).getroot().iter("testcase"):
    name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
    outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
               else "skipped" if case.find("skipped") is not None else "passed")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    out[name] = (outcome, props)
  return out


def table(cells: dict[tuple, dict]) -> str:
  """One block per test: its bars, a line per cell (in the order run) with each figure and the
  bars it misses, then each figure's worst cell and margin. The cell lines are the ones in the
  tests' docstrings."""
  tests: dict[str, dict] = {}
  for cell, results in cells.items():
    for test, (outcome, props) in results.items():
      if props:
        tests.setdefault(test, {})[cell] = (outcome, {k: v.split() for k, v in props.items()})
  lines = []
  for test, by_cell in sorted(tests.items()):
    first = next(iter(by_cell.values()))[1]  # every cell records the same figures and bars
    lines.append(f"{test}: {len(by_cell)} cells; bars: " + "; ".join(
        f"{n} {op} {float(bar):g}" for n, (_, op, bar) in first.items()))
    lines.append("  cells (ISA dots seed: " + "; ".join(first) + "):")
    for (isa, dots, seed), (outcome, figs) in by_cell.items():
      missed = [n for n, (v, op, b) in figs.items()
                if not (float(v) > float(b) if op == ">" else float(v) < float(b))]
      lines.append(f"  {isa} {dots} {seed}: " + ", ".join(f"{float(v):+.3f}" for v, _, _ in
                                                         figs.values())
                   + (f"  (misses: {', '.join(missed)})" if missed else "")
                   + ("" if outcome == "passed" or missed else f"  (test {outcome})"))
    for n, (_, op, bar) in first.items():
      cell, worst = (min if op == ">" else max)(
          ((c, float(f[n][0])) for c, (_, f) in by_cell.items()), key=lambda r: r[1])
      lines.append(f"  worst {n}: {worst:+.3f} ({' '.join(map(str, cell))}); bar {op} "
                   f"{float(bar):g}, margin {abs(worst - float(bar)):.3f}")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--isa", default="native,AVX2", help="XLA ISA caps, e.g. native,AVX2,AVX")
  ap.add_argument("--dots", default="eigen,ynnpack")
  ap.add_argument("--seeds", default="0-2")
  ap.add_argument("--out", default="runs/learning_sweep")
  args, extra = ap.parse_known_args(argv)
  extra = [a for a in extra if a != "--"]
  os.makedirs(args.out, exist_ok=True)
  cells = [(i, d, s) for s in seeds_of(args.seeds) for i in args.isa.split(",")
           for d in args.dots.split(",")]
  print(f"{len(cells)} cells on {cpu_name()}", flush=True)
  results = {}
  for n, (isa, dots, seed) in enumerate(cells, 1):
    xml = os.path.join(args.out, f"{isa}-{dots}-seed{seed}.xml")
    if not os.path.exists(xml):
      print(f"[{n}/{len(cells)}] isa {isa}, dots {dots}, seed {seed}", flush=True)
      print(f"    {run_cell(isa, dots, seed, xml, extra):.0f} s", flush=True)
    results[(isa, dots, seed)] = read_cell(xml)
  text = f"# learning bars over {len(cells)} cells on {cpu_name()}\n\n" + table(results)
  with open(os.path.join(args.out, "table.md"), "w") as f:
    f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
