"""Compile a trainer's programs ahead of time for a TPU topology on the machine at hand.

    jaxrl plan --config configs/qwen3.py:0.6b-grpo-v5e --compile v5e:2x4

With libtpu installed (`pip install "jax[tpu]"`; it coexists with the CPU backend),
jax.experimental.topologies gives a TPU slice's devices without the chips, and
jax.jit(f).lower(abstract args).compile() compiles for them, as MaxText's train_compile.py
does. Arguments are jax.ShapeDtypeStructs carrying their shardings (jaxrl.train.programs), so
nothing is allocated and an 8B model compiles on a laptop.

Per program, per chip:
- bytes: XLA's memory_analysis(), summed as XLA's own peak for one execution: arguments +
  outputs - aliased (the donated state, counted once) + temporaries. Generated code is
  reported apart (it lives in the program's own memory, a few MiB).
- seconds: a roofline from XLA's cost_analysis(): max(flops / peak bf16 FLOP/s, bytes accessed
  / HBM bandwidth). XLA counts a loop's body once, whatever its trip count (the micro-batch
  scan, the chunked log-probs, the decode steps), so for a program with a loop (`loops`, its
  while ops) the figure is one trip's, not the program's. Its own `optimal_seconds` came out
  negative for the learner programs on libtpu 0.0.50, so it is not used.
- cycles: the whole program by the TPU compiler's own cost model. libtpu writes
  `estimated_cycles` on each op of the compiled module; summed over the entry computation and
  each loop's body times its trip count (estimated_cycles below), at the chip's clock, they
  give `estimated_s`, which counts every trip of every loop. The asynchronous copies that
  bring weights into VMEM carry no cycles (they overlap the ops), nor does a Pallas call.
Chip figures (Google Cloud TPU docs, docs.cloud.google.com/tpu/docs/v5e, /v5p-training, /v6e):
v5e 197 TFLOP/s bf16, 16 GB HBM at 819 GB/s; v5p 459 TFLOP/s, 95 GB at 2,765 GB/s; v6e 918
TFLOP/s, 32 GB at 1,638 GB/s. Clocks, from the peak and the matrix units: v5e 1.5 GHz (4 MXUs
of 128 x 128), v5p 1.75 GHz (2 TensorCores of 4). v6e's page gives 2 MXUs of 256 x 256, which
would need 3.5 GHz for 918 TFLOP/s, and at 3.5 GHz libtpu's estimate of a 4,096^3 bf16 matmul
would run at 174% of the peak: its cost model counts 4 such units' throughput per cycle, so
1.75 GHz is used (that matmul then at 87% of the peak; v5e's at 97%, v5p's at 96%).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import time

import jax

from jaxrl import backends
from jaxrl.errors import ConfigError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  hbm_gib: float
  bf16_flops: float  # peak FLOP/s
  hbm_bytes_per_s: float
  clock_hz: float  # what libtpu's estimated_cycles count (see above)


CHIPS = {
    "v5e": Chip("v5e", 16, 197e12, 819e9, 1.5e9),
    "v5p": Chip("v5p", 95, 459e12, 2765e9, 1.75e9),
    "v6e": Chip("v6e", 32, 918e12, 1638e9, 1.75e9),
}
INSTALL = ('compiling for a TPU needs libtpu on this machine: pip install "jax[tpu]==<your jax '
           'version>" (or pip install -e ".[test]", which pins it); it coexists with the CPU '
           'backend.')


def chip_of(topology: str) -> Chip:
  """The Chip of a topology name such as "v5e:2x4" or "v5p:2x2x1"."""
  kind = topology.split(":")[0].lower().removeprefix("tpu").removeprefix("-")
  kind = {"v5litepod": "v5e", "v5lite": "v5e"}.get(kind, kind)
  if kind not in CHIPS:
    raise ConfigError(f"--compile {topology!r}: unknown chip {kind!r}; name one of "
                      f"{', '.join(CHIPS)} with a topology, e.g. v5e:2x4, v5p:2x2x1, v6e:2x4.")
  return CHIPS[kind]


def topology_devices(topology: str) -> list:
  """The abstract TPU devices of a topology ("v5e:2x4"), with no TPU attached."""
  chip_of(topology)
  try:
    import libtpu  # noqa: F401  (only to say how to install it when it is missing)
  except ImportError:
    raise ConfigError(INSTALL) from None
  from jax.experimental import topologies
  # libtpu takes a lock file per process; a compile-only client needs no chip, so let several
  # processes (pytest's workers, two `jaxrl plan --compile`) load it at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  backends.quiet_libtpu_off_tpu()
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
  except Exception as e:  # libtpu's error for a bad shape is a long RuntimeError
    raise ConfigError(f"--compile {topology!r}: libtpu does not know this topology "
                      f"({str(e).splitlines()[0][:160]}); use e.g. v5e:2x2, v5e:2x4, v5p:2x2x1, "
                      "v6e:2x4.") from None
  return list(desc.devices)


@dataclasses.dataclass
class Compiled:
  """XLA's figures for one program on one chip."""
  name: str
  argument: int
  output: int
  alias: int
  temp: int
  code: int
  flops: float
  bytes_accessed: float
  compile_s: float
  # The TPU compiler refuses a program whose temporaries exceed the chip's HBM
  # (CompileTimeHbmOom): then only `temp` (its figure, the arguments not counted) is known.
  oom: bool = False
  # The compiled module's while loops: XLA's cost analysis counted each one's body once.
  loops: int = 0
  # libtpu's estimated cycles of the whole program, every trip of every loop (0 off TPU).
  cycles: int = 0

  @property
  def bytes(self) -> int:
    """XLA's peak for one execution: arguments + outputs - aliased + temporaries."""
    return self.argument + self.output - self.alias + self.temp

  def seconds(self, chip: Chip) -> float:
    """The roofline of XLA's counts: whichever of compute and HBM traffic takes longer at the
    chip's peak (one trip of each loop: see `loops`)."""
    return max(self.flops / chip.bf16_flops, self.bytes_accessed / chip.hbm_bytes_per_s)

  def estimated_s(self, chip: Chip) -> float | None:
    """The TPU compiler's estimate of one execution, every loop trip counted (None off TPU)."""
    return self.cycles / chip.clock_hz if self.cycles else None


def estimated_cycles(hlo: str) -> tuple[int, collections.Counter]:
  """(total, by kind): the `estimated_cycles` libtpu writes on the ops of a compiled module's
  text, summed over the entry computation and the bodies of its loops, and per kind of op
  (opcode, jax op name, shape). A loop's body counts its trip count times: the constant its
  condition compares the counter with (jax's scans and fori_loops count up from 0); a loop's
  condition is left out. (0 for a module without estimates: a CPU or GPU compile.)"""
  if '"estimated_cycles"' not in hlo:
    return 0, collections.Counter()
  comps, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
    if head:
      name = "ENTRY" if line.startswith("ENTRY") else head.group(1)
      comps[name] = []
    elif name and line.startswith("  "):
      comps[name].append(line)
  by_kind = collections.Counter()

  def walk(comp, times):
    for line in comps[comp]:
      m = re.match(r"\s+(?:ROOT )?%\S+ = (.*?) ([a-z][a-z0-9\-_]*)\(", line)
      if not m:
        continue
      if m.group(2) == "while":
        cond = "\n".join(comps[re.search(r"condition=%([\w.\-]+)", line).group(1)])
        n = re.findall(r"s32\[\]\S* constant\((\d+)\)", cond)
        if len(n) != 1 or "direction=LT" not in cond:
          raise ValueError(f"a loop whose trip count this does not read: {line[:200]}")
        walk(re.search(r"body=%([\w.\-]+)", line).group(1), times * int(n[0]))
        continue
      cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
      if cycles:
        op = re.search(r'op_name="([^"]*)"', line)
        op = re.sub(r"\.\d+", "", op.group(1).split("eval_jaxpr/")[-1]) if op else ""
        by_kind[f"{m.group(2)} {op} {m.group(1).split('{')[0]}"] += times * int(cycles.group(1))

  if "ENTRY" in comps:
    walk("ENTRY", 1)
  return sum(by_kind.values()), by_kind


def compile_program(program) -> Compiled:
  """Lowers and compiles a jaxrl.parallel.plan.Program for its (abstract) devices."""
  t0 = time.perf_counter()
  try:
    compiled = program.fn.lower(*program.args).compile()
  except jax.errors.JaxRuntimeError as e:
    found = re.search(r"CompileTimeHbmOom.*?temporaries \(([\d.]+)G\)", str(e))
    if not found:
      raise
    return Compiled(program.name, 0, 0, 0, int(float(found.group(1)) * GIB), 0, 0.0, 0.0,
                    time.perf_counter() - t0, oom=True)
  dt = time.perf_counter() - t0
  m = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  hlo = compiled.as_text()
  return Compiled(program.name, int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                  int(m.alias_size_in_bytes), int(m.temp_size_in_bytes),
                  int(getattr(m, "generated_code_size_in_bytes", 0) or 0),
                  float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)), dt,
                  loops=sum(" while(" in line for line in hlo.splitlines()),
                  cycles=estimated_cycles(hlo)[0])


def xla_peak(estimates, compiled) -> tuple[str, int]:
  """(name, bytes) of the compiled program with the largest peak per device: its XLA bytes plus
  what stays resident beside it (the plan's `resident`)."""
  return max(((c.name, c.bytes + e.resident) for e, c in zip(estimates, compiled)),
             key=lambda named: named[1])


def run_peaks(programs, estimates, compiled) -> tuple[int, int]:
  """(the plan's, XLA's) peak per device over a run's programs: each program's bytes plus what
  stays resident beside it, the largest of them."""
  return max(e.peak for e in estimates), xla_peak(estimates, compiled)[1]


def report(programs, estimates, compiled, chip: Chip | None) -> tuple[str, bool | None]:
  """The table `jaxrl plan --compile` prints, and whether the run fits the chip's HBM (the
  largest compiled program plus what stays resident beside it)."""
  w = max(len(p.name) for p in programs)
  head = (f"  {'program':<{w}}  {'plan GiB':>9}  {'XLA GiB':>8}  {'plan/XLA':>8}  "
          f"{'+resident':>9}  {'peak GiB':>8}  {'XLA s':>10}  {'model TFLOP':>11}")
  lines = ["compiled per chip (XLA: arguments + outputs - aliased + temporaries; peak adds "
           "what stays resident beside the program):", head]
  peak = 0
  for p, e, c in zip(programs, estimates, compiled):
    total = c.bytes + e.resident
    peak = max(peak, total)
    secs = "-"
    if chip and c.cycles:  # the compiler's estimate, every loop trip counted
      secs = f"{c.estimated_s(chip):.4f} "
    elif chip:
      secs = f"{c.seconds(chip):.4f}" + ("*" if c.loops else " ")
    lines.append(f"  {p.name:<{w}}  {e.program_peak / GIB:>9.3f}  {c.bytes / GIB:>8.3f}  "
                 f"{e.program_peak / max(c.bytes, 1):>8.2f}  {e.resident / GIB:>9.3f}  "
                 f"{total / GIB:>8.3f}  {secs:>10}  {p.flops / 1e12:>11.3f}")
  fits = None
  if chip is not None:
    fits = peak <= chip.hbm_gib * GIB
    if any(c.cycles for c in compiled):
      lines.append("  XLA s: the TPU compiler's estimate of one execution (its ops' estimated "
                   "cycles, each loop's body times its trip count, at the chip's clock)")
    if any(c.loops and not c.cycles for c in compiled):
      lines.append("  * no cycle estimates: a roofline of XLA's counts, where a loop's body "
                   "counts once: one trip's figure, not the program's")
    lines.append(f"  {chip.name} HBM {chip.hbm_gib:g} GiB per chip: the largest peak "
                 f"{peak / GIB:.3f} GiB {'fits' if fits else 'does NOT fit'}")
  return "\n".join(lines), fits
