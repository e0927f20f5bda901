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
        "floor_flops": aot.roofline_flops(p, len(devices)),
        "seconds": x.seconds(c, aot.roofline_flops(p, len(devices))),
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


def decode_counts(row: str, unrolled=(), out=print) -> dict:
  """How XLA's cost analysis counts the row's decode steps, beside the floor a step cannot beat
  (the chip's shard of the sampler's weights and of the KV cache read once: bytes / HBM
  bandwidth). Compiled: the decode program as the run has it (a loop of
  rollout.steps_per_call steps) and with 2 steps, whose figures must be the same if the loop's
  body is counted once whatever its trip count; with 1 step (no loop left); and with each of
  `unrolled` steps written out one after another (Engine's scan unroll), where every step is
  counted. One step's estimate is the loop's body: the run's program counted once."""
  from jaxrl.parallel.plan import abstract_bytes
  config, module, chip = load(row)
  devices = aot.topology_devices(TOPOLOGY[chip])
  c = aot.chip_of(TOPOLOGY[chip])
  k_run = int(config.rollout.steps_per_call)
  record = {"row": row, "topology": TOPOLOGY[chip], "date": datetime.date.today().isoformat(),
            "slots": int(config.rollout.slots), "steps_per_call": k_run, "compiled": {}}
  for name, k, unroll in ([("loop", k_run, False), ("loop", 2, False), ("loop", 1, False)] +
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
  body = record["compiled"][f"loop {k_run}"]
  record["step_s"] = max(body["flops"] / c.bf16_flops, body["bytes_accessed"] / c.hbm_bytes_per_s)
  record["floor_s"] = (record["weight_bytes"] + record["kv_bytes"]) / c.hbm_bytes_per_s
  return record


class _Figures:  # what run_peaks reads of a compiled program
  def __init__(self, q):
    self.bytes = q["xla_bytes"]


def read_results() -> dict[str, dict]:
  if not os.path.isfile(RESULTS):
    return {}
  with open(RESULTS) as f:
    return {r["row"]: r for r in map(json.loads, filter(str.strip, f))}


def render(results: dict[str, dict], plans: dict[str, float] | None = None) -> str:
  plans = plans or {}
  lines = ["| config | slice | remat, accum | compiled GiB per chip | fits | train step s | "
           "MFU | decode step s | decode tok/s per chip |",
           "|---|---|---|---:|---|---:|---:|---:|---:|"]
  for row in all_rows():
    fam, arg = row.split(":", 1)
    chip = arg.split(",")[2]
    r = results.get(row)
    name = f"`{fam}.py:{arg}`"
    if r is None:
      lines.append(f"| {name} | {_slice(chip)} | | not compiled yet | - | | | | |")
      continue
    c = aot.chip_of(TOPOLOGY[chip])
    progs = {p["name"]: p for p in r["programs"]}
    for p in progs.values():  # the roofline from the recorded figures (see Compiled.seconds)
      floor = p.get("floor_flops", p["model_flops"] / r["chips"] *
                    (4 / 3 if p["kind"] == "train" and r["remat"] == "full" else 1))
      p["seconds"] = max(max(p["flops_xla"], floor) / c.bf16_flops,
                         p["bytes_accessed"] / c.hbm_bytes_per_s)
    train = progs["train step"]
    if train.get("oom"):
      lines.append(f"| {name} | {_slice(chip)} ({r['chips']} chips) | {r['remat']}, "
                   f"{r['accum_steps']} | > {train['xla']['temp'] / GIB:.2f} (temporaries alone; "
                   "the compiler ran out of HBM) | **no** | | | | |")
      continue
    mfu = train["model_flops"] / r["chips"] / train["seconds"] / c.bf16_flops
    dec = progs.get("decode steps")
    steps = dec["tokens"] // max(1, _slots(r)) if dec else 0
    dec_s = f"{dec['seconds'] / steps:.5f}" if dec else "-"
    dec_tps = f"{dec['tokens'] / dec['seconds'] / r['chips']:,.0f}" if dec else "-"
    lines.append(f"| {name} | {_slice(chip)} ({r['chips']} chips) | {r['remat']}, {r['accum_steps']} "
                 f"| {r['xla_peak'] / GIB:.2f} | {'yes' if r['fits'] else '**no**'} | "
                 f"{train['seconds']:.3f} | {100 * mfu:.0f}% | {dec_s} | {dec_tps} |")
  return "\n".join(lines)


def _slice(chip: str) -> str:
  """The slice's name: v5e -> v5e-8, v5e-4 as it is."""
  return chip if "-" in chip else f"{chip}-8"


def _slots(r) -> int:
  config, _, _ = load(r["row"])
  return int(config.rollout.slots)


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
  ap.add_argument("--decode-counts", default="", metavar="STEPS",
                  help="compile each GRPO row's decode program as a loop of steps_per_call, 2 "
                       "and 1 steps, and unrolled at STEPS (e.g. 2,8; 0: none), into "
                       "results/decode_counts.jsonl")
  args = ap.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.decode_counts:
    unrolled = tuple(int(k) for k in args.decode_counts.split(",") if k.strip() != "0")
    rows = args.only or [r for r in all_rows() if ",grpo," in r]
    for row in rows:
      record = decode_counts(row, unrolled)
      with open(DECODE_COUNTS, "a") as f:
        f.write(json.dumps(record) + "\n")
      print(f"{row}: one decode step in the loop {record['step_s'] * 1e3:.3f} ms by XLA's count, "
            f"floor {record['floor_s'] * 1e3:.3f} ms", flush=True)
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
