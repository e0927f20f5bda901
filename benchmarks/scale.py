"""Compile the ready-made real-model configs for their TPU slices and write the docs table.

    nice python benchmarks/scale.py                 # every row not yet in the results, in order
    python benchmarks/scale.py --only qwen3:0.6b,grpo,v5e
    python benchmarks/scale.py --render             # docs/guides/scale.md from the results only

Each row is one config (configs/<family>.py:MODEL,TRAINER,CHIP) compiled for its 8-chip slice
(v5e:2x4, v5p:2x2x1 (v5p-8 is 4 chips of 2 cores), v6e:2x4) with `jaxrl plan --compile`'s
machinery (jaxrl.parallel.compile): every program the trainer runs, abstract arguments only.
Results append to benchmarks/results/scale.jsonl (one JSON line per row, so a long run can
stop and resume); the table says "fits" only for rows the compiler has seen. Most important
rows first (Qwen3-0.6B and 8B). Compiling a 0.6B model's train step took ~10 min on the
2-core machine of 2026-12-02 (shared), an 8B one longer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxrl import config as config_lib  # noqa: E402
from jaxrl.backends import tpu as tpu_backend  # noqa: E402
from jaxrl.parallel import compile as aot  # noqa: E402
from jaxrl.parallel.plan import estimate  # noqa: E402

TOPOLOGY = {"v5e": "v5e:2x4", "v5p": "v5p:2x2x1", "v6e": "v6e:2x4",
            "v5e-4": "v5e:2x2"}  # a 4-chip v5e slice: LoRA rows only (LORA_ROWS)
SLICES = ("v5e", "v5p", "v6e")  # every family config is compiled for these 8-chip slices
FAMILIES = {"qwen3": ("0.6b", "1.7b", "4b", "8b"), "qwen2p5": ("1.5b", "7b"),
            "llama3": ("3.2-1b", "3.2-3b", "3.1-8b")}
PRIORITY = ["qwen3:0.6b,grpo,v5e", "qwen3:8b,sft,v5p", "qwen3:0.6b,sft,v5e",
            "qwen3:8b,sft,v5e", "qwen3:8b,grpo,v5p"]
# The LoRA / QLoRA variants (docs/guides/lora.md), after the full fine-tunes.
LORA_ROWS = ["qwen3:8b,grpo,v5e,lora", "qwen3:8b,grpo,v5e,qlora", "llama3:3.1-8b,grpo,v5e,qlora",
             "qwen3:4b,grpo,v5e-4,qlora"]
RESULTS = os.path.join(ROOT, "benchmarks", "results", "scale.jsonl")
# The decode steps counted whole (--decode-counts): one JSON line per GRPO row.
DECODE_COUNTS = os.path.join(ROOT, "benchmarks", "results", "decode_counts.jsonl")
TRAIN_COUNTS = os.path.join(ROOT, "benchmarks", "results", "train_counts.jsonl")
DOC = os.path.join(ROOT, "docs", "guides", "scale.md")
GIB = 1 << 30


def all_rows() -> list[str]:
  rows = list(PRIORITY)
  for fam, models in FAMILIES.items():
    for model in models:
      for trainer in ("grpo", "sft"):
        for chip in SLICES:
          row = f"{fam}:{model},{trainer},{chip}"
          if row not in rows:
            rows.append(row)
  return rows + LORA_ROWS


def load(row: str):
  fam, arg = row.split(":", 1)
  trainer = arg.split(",")[1]
  from jaxrl import cli
  module = cli.trainer(trainer)
  config = config_lib.load_config(os.path.join(ROOT, "configs", f"{fam}.py:{arg}"),
                                  choices=module.CHOICES)
  return config, module, arg.split(",")[2]


def measure(row: str, out=print) -> dict:
  config, module, chip = load(row)
  devices = aot.topology_devices(TOPOLOGY[chip])
  work, programs = module.programs(config, devices=devices)
  estimates = [estimate(p) for p in programs]
  record = {"row": row, "topology": TOPOLOGY[chip], "chips": len(devices),
            "remat": work.remat, "accum_steps": int(config.optim.accum_steps),
            "logits_chunk": work.logits_chunk, "date": datetime.date.today().isoformat(),
            # GRPO's reference dtype and sampler mesh (rows without them: "" and the family
            # default, data=auto x tensor=2)
            **({"ref_dtype": config.placement.get("ref_dtype", ""),
                "sampler_mesh": [int(config.placement.sampler_mesh.data),
                                 int(config.placement.sampler_mesh.tensor)]}
               if "placement" in config and work.slots else {}),
            # The learner's attention on TPU (JAXRL_TPU_ATTENTION); rows without it: xla.
            "attention": tpu_backend.choice(),
            # Whether XLA's collective matmul ran for the FSDP all-gathers
            # (JAXRL_TPU_COLLECTIVE_MATMUL); rows without it: on (libtpu's default then).
            "collective_matmul": tpu_backend.collective_matmul(),
            # The learner programs' libtpu options exactly (rows without it: the all-gather's
            # windowed einsum alone was off under collective_matmul=off).
            "learner_options": tpu_backend.compiler_options("learner") or {},
            "programs": []}
  c = aot.chip_of(TOPOLOGY[chip])
  for p, e in zip(programs, estimates):
    out(f"  {row}: compiling {p.name} (plan {e.program_peak / GIB:.2f} GiB + resident "
        f"{e.resident / GIB:.2f}) ...", flush=True)
    x = aot.compile_program(p)
    record["programs"].append({
        "name": p.name, "kind": p.kind, "plan_bytes": e.program_peak, "resident": e.resident,
        "xla_bytes": x.bytes, "xla": {"argument": x.argument, "output": x.output,
                                      "alias": x.alias, "temp": x.temp, "code": x.code},
        "flops_xla": x.flops, "bytes_accessed": x.bytes_accessed,
        "loops": x.loops, "seconds": x.seconds(c), "cycles": x.cycles,
        "model_flops": p.flops, "tokens": p.tokens, "compile_s": round(x.compile_s, 1),
        "oom": x.oom})
    if x.oom:  # the compiler's own verdict: it does not fit; the rest need not compile
      out(f"  {row}: {p.name}: the TPU compiler ran out of HBM (temporaries "
          f"{x.temp / GIB:.2f} GiB alone)", flush=True)
      break
    out(f"  {row}: {p.name}: XLA {x.bytes / GIB:.2f} GiB, roofline "
        f"{record['programs'][-1]['seconds']:.4f} s, "
        f"compiled in {x.compile_s:.0f} s", flush=True)
  figures = [_Figures(q) for q in record["programs"]]
  plan, xla = aot.run_peaks(programs[:len(figures)], estimates[:len(figures)], figures)
  record.update(plan_peak=plan, xla_peak=xla, hbm=int(c.hbm_gib * GIB),
                fits=bool(xla <= c.hbm_gib * GIB) and not any(
                    q["oom"] for q in record["programs"]))
  return record


def decode_counts(row: str, unrolled=(), checks: bool = False, out=print) -> dict:
  """One decode step of the row by XLA's count, beside the floor a step cannot beat (the chip's
  shard of the sampler's weights and of the KV cache at its full length read once: bytes / HBM
  bandwidth). Compiled: the decode program as the run has it (a loop of
  rollout.steps_per_call steps), whose cost analysis counts the loop's body once, whatever its
  trip count: that is one step. With `checks`, also a loop of 2 steps (the same figures if the
  body is counted once) and 1 step (no loop left), and with each of `unrolled` steps written
  out one after another (Engine's scan unroll), where every step is counted."""
  from jaxrl.parallel.plan import abstract_bytes
  config, module, chip = load(row)
  devices = aot.topology_devices(TOPOLOGY[chip])
  k_run = int(config.rollout.steps_per_call)
  record = {"row": row, "topology": TOPOLOGY[chip], "date": datetime.date.today().isoformat(),
            "slots": int(config.rollout.slots), "steps_per_call": k_run, "compiled": {}}
  loops = [k_run, 2, 1] if checks or unrolled else [k_run]
  for name, k, unroll in ([("loop", k, False) for k in loops] +
                          [("unrolled", k, True) for k in unrolled]):
    config.rollout.steps_per_call = k
    _, programs = module.programs(config, devices=devices, unroll_decode=unroll)
    p = next(p for p in programs if p.name == "decode steps")
    x = aot.compile_program(p)
    record["weight_bytes"] = abstract_bytes(p.args[0])  # per chip, as the kv_bytes
    record["kv_bytes"] = abstract_bytes(p.args[1])
    record["compiled"][f"{name} {k}"] = {"flops": x.flops, "bytes_accessed": x.bytes_accessed,
                                         "temp": x.temp, "model_flops": p.flops,
                                         "compile_s": round(x.compile_s, 1)}
    out(f"  {row}: {name}, {k} steps: {x.bytes_accessed / 1e9:.3f} GB accessed, "
        f"{x.flops / 1e9:.1f} GFLOP, temp {x.temp / 1e9:.2f} GB, compiled in "
        f"{x.compile_s:.0f} s", flush=True)
  return record


def train_counts(row: str, accums, out=print) -> dict:
  """The row's train step at its global batch in each of `accums` micro-batches, compiled
  with the layers scanned (minutes, not the unrolled model's up to 18): XLA's cost analysis
  counts the micro-batch loop's body (one micro-batch) once, so its figures fall with more
  micro-batches while the work is the same; libtpu's estimated cycles, each loop's body times
  its trip count (jaxrl.parallel.compile.estimated_cycles), should not."""
  config, module, chip = load(row)
  config.model.scan_layers = True
  devices = aot.topology_devices(TOPOLOGY[chip])
  c = aot.chip_of(TOPOLOGY[chip])
  record = {"row": row, "topology": TOPOLOGY[chip], "date": datetime.date.today().isoformat(),
            "scan_layers": True, "compiled": {}}
  for accum in accums:
    config.optim.accum_steps = accum
    _, programs = module.programs(config, devices=devices)
    x = aot.compile_program(programs[0])
    record["compiled"][str(accum)] = {
        "model_flops": programs[0].flops / len(devices),  # per chip: GRPO's shared-prompt
        # layout needs whole groups per micro-batch, and without it each row feeds its prompt
        "width": programs[0].seq_len, "flops": x.flops, "bytes_accessed": x.bytes_accessed,
        "loops": x.loops,
        "cycles": x.cycles, "estimated_s": x.estimated_s(c), "temp": x.temp, "oom": x.oom,
        "compile_s": round(x.compile_s, 1)}
    out(f"  {row}: {accum} micro-batches: XLA {x.flops / 1e12:.2f} TFLOP / "
        f"{x.bytes_accessed / 1e9:.1f} GB (a loop's body once), estimated "
        f"{(x.estimated_s(c) or 0):.3f} s (every trip), compiled in {x.compile_s:.0f} s",
        flush=True)
  return record


class _Figures:  # what run_peaks reads of a compiled program
  def __init__(self, q):
    self.bytes = q["xla_bytes"]


def read_results() -> dict[str, dict]:
  if not os.path.isfile(RESULTS):
    return {}
  with open(RESULTS) as f:
    return {r["row"]: r for r in map(json.loads, filter(str.strip, f))}


def read_decode_counts() -> dict[str, dict]:
  """The latest decode_counts record of each row."""
  if not os.path.isfile(DECODE_COUNTS):
    return {}
  with open(DECODE_COUNTS) as f:
    return {r["row"]: r for r in map(json.loads, filter(str.strip, f))}


def train_figures(r: dict) -> dict | None:
  """The train step's seconds per chip: `floor`, what it cannot beat (its model FLOPs at the
  chip's peak; its arguments, the parameters and optimizer state, read once from HBM), and
  `xla`, libtpu's estimate of the whole step (its ops' cycles, each loop's body times its trip
  count) where the compile recorded `cycles`, else the roofline of XLA's counts (max of flops
  at peak and bytes at the HBM bandwidth) only if the step has no loop (XLA counts a loop's
  body once, whatever its trip count; rows compiled before `loops` was recorded count as
  having one): None otherwise. None for a row the compiler refused."""
  train = next(p for p in r["programs"] if p["kind"] == "train")
  if train.get("oom"):
    return None
  c = aot.chip_of(r["topology"])
  # (With LoRA the model FLOPs are two forwards', not three: jaxrl.models.flops.train_flops.)
  floor = max(train["model_flops"] / r["chips"] / c.bf16_flops,
              train["xla"]["argument"] / c.hbm_bytes_per_s)
  if train.get("cycles"):
    xla = train["cycles"] / c.clock_hz
  elif train.get("loops") == 0:
    xla = max(train["flops_xla"] / c.bf16_flops, train["bytes_accessed"] / c.hbm_bytes_per_s)
  else:
    xla = None
  return {"floor": floor, "xla": xla,
          "model_flops": train["model_flops"] / r["chips"]}


def decode_figures(d: dict) -> dict:
  """One decode step's seconds per chip from a decode_counts record: `xla` (the run's loop, its
  body counted once: one step) and `floor` (weights and the full-length KV cache read once)."""
  c = aot.chip_of(d["topology"])
  body = d["compiled"][f"loop {d['steps_per_call']}"]
  return {"xla": max(body["flops"] / c.bf16_flops, body["bytes_accessed"] / c.hbm_bytes_per_s),
          "floor": (d["weight_bytes"] + d["kv_bytes"]) / c.hbm_bytes_per_s}


def below_floor(results: dict[str, dict], counts: dict[str, dict]) -> list[str]:
  """Every estimate of the recorded rows that is faster than its physical floor: a bug."""
  bad = []
  for row, r in results.items():
    t = train_figures(r)
    if t and t["xla"] is not None and t["xla"] < t["floor"]:
      bad.append(f"{row}: train step {t['xla']:.4f} s < floor {t['floor']:.4f} s")
  for row, d in counts.items():
    x = decode_figures(d)
    if x["xla"] < x["floor"]:
      bad.append(f"{row}: decode step {x['xla'] * 1e3:.3f} ms < floor {x['floor'] * 1e3:.3f} ms")
  return bad


def render(results: dict[str, dict], counts: dict[str, dict] | None = None) -> str:
  counts = read_decode_counts() if counts is None else counts
  lines = ["| config | slice | remat, accum | compiled GiB per chip | fits | train step s, XLA "
           "| floor | x floor | MFU | decode step ms, XLA | floor | x floor | decode tok/s per "
           "chip |", "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for row in all_rows():
    fam, arg = row.split(":", 1)
    chip = arg.split(",")[2]
    r = results.get(row)
    name = f"`{fam}.py:{arg}`"
    if r is None:
      lines.append(f"| {name} | {_slice(chip)} | | not compiled yet | - |" + " |" * 8)
      continue
    t = train_figures(r)
    if t is None:
      train = next(p for p in r["programs"] if p["kind"] == "train")
      lines.append(f"| {name} | {_slice(chip)} ({r['chips']} chips) | {r['remat']}, "
                   f"{r['accum_steps']} | > {train['xla']['temp'] / GIB:.2f} (temporaries alone; "
                   "the compiler ran out of HBM) | **no** |" + " |" * 8)
      continue
    c = aot.chip_of(r["topology"])
    if t["xla"] is None:
      train = f"loop counted once | {t['floor']:.3f} | - | -"
    else:
      mfu = t["model_flops"] / t["xla"] / c.bf16_flops
      train = (f"{t['xla']:.3f} | {t['floor']:.3f} | {t['xla'] / t['floor']:.2f} | "
               f"{100 * mfu:.0f}%")
    d = counts.get(row)
    if d is not None:
      x = decode_figures(d)
      decode = (f"{x['xla'] * 1e3:.2f} | {x['floor'] * 1e3:.2f} | {x['xla'] / x['floor']:.2f} | "
                f"{d['slots'] / r['chips'] / x['xla']:,.0f}")
    elif any(p["name"] == "decode steps" for p in r["programs"]):
      decode = "not recompiled | | |"
    else:
      decode = "- | - | - | -"
    lines.append(f"| {name} | {_slice(chip)} ({r['chips']} chips) | {r['remat']}, "
                 f"{r['accum_steps']} | {r['xla_peak'] / GIB:.2f} | "
                 f"{'yes' if r['fits'] else '**no**'} | {train} | {decode} |")
  return "\n".join(lines)


def _slice(chip: str) -> str:
  """The slice's name: v5e -> v5e-8, v5e-4 as it is."""
  return chip if "-" in chip else f"{chip}-8"


def write_doc(table: str) -> None:
  with open(DOC) as f:
    text = f.read()
  start, end = "<!-- scale-table -->", "<!-- /scale-table -->"
  i, j = text.index(start) + len(start), text.index(end)
  with open(DOC, "w") as f:
    f.write(text[:i] + "\n" + table + "\n" + text[j:])


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", action="append", help="a row such as qwen3:0.6b,grpo,v5e")
  ap.add_argument("--render", action="store_true", help="only rewrite the docs table")
  ap.add_argument("--decode-counts", nargs="?", const="", default=None, metavar="STEPS",
                  help="compile each GRPO row's decode program as the run's loop into "
                       "results/decode_counts.jsonl; with STEPS (e.g. 2,8) also as loops of 2 "
                       "and 1 steps and unrolled at STEPS, to check the count")
  ap.add_argument("--train-counts", default="", metavar="ACCUMS",
                  help="compile each --only row's train step, layers scanned, in each of "
                       "ACCUMS (e.g. 1,2,4) micro-batches into results/train_counts.jsonl")
  args = ap.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.train_counts:
    for row in args.only:
      record = train_counts(row, [int(k) for k in args.train_counts.split(",")])
      with open(TRAIN_COUNTS, "a") as f:
        f.write(json.dumps(record) + "\n")
    return
  if args.decode_counts is not None:
    unrolled = tuple(int(k) for k in args.decode_counts.split(",") if k.strip())
    rows = args.only or [r for r in all_rows() if ",grpo," in r]
    for row in rows:
      record = decode_counts(row, unrolled)
      with open(DECODE_COUNTS, "a") as f:
        f.write(json.dumps(record) + "\n")
      x = decode_figures(record)
      print(f"{row}: one decode step in the loop {x['xla'] * 1e3:.3f} ms by XLA's count, "
            f"floor {x['floor'] * 1e3:.3f} ms", flush=True)
      write_doc(render(read_results()))
    return
  results = read_results()
  if not args.render:
    todo = args.only or [r for r in all_rows() if r not in results]
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    for row in todo:
      t0 = time.time()
      print(f"{row}: start", flush=True)
      record = measure(row)
      with open(RESULTS, "a") as f:
        f.write(json.dumps(record) + "\n")
      results[row] = record
      print(f"{row}: XLA peak {record['xla_peak'] / GIB:.2f} GiB per chip "
            f"({'fits' if record['fits'] else 'does NOT fit'}); plan "
            f"{record['plan_peak'] / GIB:.2f}; {time.time() - t0:.0f} s", flush=True)
      write_doc(render(results))
  write_doc(render(results))


if __name__ == "__main__":
  main()
