"""The learner's reference log-prob forward on a long-tailed rollout, padded against packed
(algo.pack_completions), compiled for a TPU slice by libtpu's compiler (no TPU needed).

    .venv/bin/python benchmarks/pack_tpu.py [--config configs/gsm8k_qwen3.py:grpo]
        [--topology v5e:2x4]

The step is the config's (gsm8k_qwen3.py:grpo: Qwen3-0.6B, 32 prompts x 8 completions, up to
512 new tokens after a 256-token prompt, bf16 compute, chunked log-probs, 8 chips). Completion
lengths are drawn (seed 0) from a long tail: log-normal with median MEDIAN tokens and sigma
SIGMA, capped at max_new_tokens, plus a TAIL share forced to the cap (answers that never stop).
Both forms are the trainer's own program ("logprob forward", grpo.programs; the reference's
forward, which the update's forward and backward follow shape for shape), compiled with the
same arguments but the batch: the padded batch [N, Tc] against the packed rows
(jaxrl.algorithms.grpo.batch.pack_completions of that draw, in the program's micro-batches).

Prints per form the positions the forward runs (prompts once per group, plus completion rows x
width), XLA's peak bytes per chip (memory_analysis) and its flops and bytes accessed per chip
(cost_analysis, which counts a loop's body once: one micro-batch, one log-prob chunk, alike
for both forms), and the roofline seconds per chip from the model FLOPs (jaxrl.models.flops
over the positions run, attention over every (query, key) pair a row's mask spans) and XLA's
bytes. Packed rows take XLA's attention where the padded rows may take the TPU kernel
(printed: the backend's choice).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from jaxrl import config as config_lib  # noqa: E402
from jaxrl.backends import tpu as tpu_backend  # noqa: E402
from jaxrl.models.flops import forward_flops  # noqa: E402
from jaxrl.parallel import compile as aot  # noqa: E402
from jaxrl.train import programs as pg  # noqa: E402
from jaxrl.algorithms import grpo  # noqa: E402
from jaxrl.algorithms.grpo.batch import pack_completions  # noqa: E402
from jaxrl.algorithms.grpo.programs import programs as grpo_programs  # noqa: E402
from jaxrl.algorithms.grpo.update import logprob_micro_batches  # noqa: E402

MEDIAN, SIGMA, TAIL = 160, 0.6, 0.05
GIB = 1 << 30


def draw_lengths(n: int, cap: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  lengths = np.minimum(np.round(MEDIAN * np.exp(SIGMA * rng.standard_normal(n))), cap)
  lengths[rng.random(n) < TAIL] = cap
  return np.maximum(lengths, 1).astype(np.int32)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/gsm8k_qwen3.py:grpo")
  p.add_argument("--topology", default="v5e:2x4")
  args = p.parse_args()
  config = config_lib.load_config(os.path.join(ROOT, args.config), choices=grpo.CHOICES)
  cfg = config_lib.model_config(config)
  devices = aot.topology_devices(args.topology)
  chip = aot.chip_of(args.topology)
  _, programs = grpo_programs(config, devices=devices)
  fwd = next(x for x in programs if x.name.startswith("logprob forward"))
  params, batch = fwd.args
  (P, Tp), (N, Tc) = batch["prompt"].shape, batch["completion"].shape
  G, W = N // P, Tc - 1
  lengths = draw_lengths(N, Tc)
  micro = logprob_micro_batches(config)
  host = {"prompt": np.zeros((P, Tp), np.int32), "prompt_len": np.full((P, 1), Tp, np.int32),
          "completion": np.zeros((N, Tc), np.int32), "completion_len": lengths}
  packed_host = pack_completions(host, group=G, pad_id=0, parts=micro)
  R = packed_host["pack_tokens"].shape[0]
  shd = batch["completion"].sharding
  packed = {**batch, **{k: pg.spec(v.shape, "int32", shd) for k, v in packed_host.items()
                        if k.startswith("pack_")}}
  q = np.percentile(lengths, [50, 90])
  print(f"{args.config} on {args.topology} ({len(devices)} chips, {chip.name}): {P} prompts x "
        f"{G}, prompt {Tp}, completions up to {Tc}: lengths median {q[0]:.0f}, 90th "
        f"percentile {q[1]:.0f}, {np.mean(lengths == Tc):.1%} at the cap, mean "
        f"{lengths.mean():.0f}; {micro} micro-batch(es); TPU attention "
        f"{tpu_backend.choice()}", flush=True)
  forms = {
      # padded: N rows of Tc - 1 positions, each attending to its prompt and causally
      "padded": (P * Tp + N * W, P * Tp * (Tp + 1) / 2 + N * (W * Tp + W * (W + 1) / 2),
                 fwd),
      # packed: R rows of W positions, XLA's dense attention over each row's prompt + row
      "packed": (P * Tp + R * W, P * Tp * (Tp + 1) / 2 + R * W * (Tp + W),
                 dataclasses.replace(fwd, args=(params, packed))),
  }
  useful = lengths.sum() - N
  print(f"completion positions: padded {N} x {W} = {N * W}, packed {R} x {W} = {R * W} "
        f"({R // P} rows per prompt), of which real {useful}", flush=True)
  for name, (tokens, pairs, program) in forms.items():
    x = aot.compile_program(program)
    model = forward_flops(cfg, tokens=tokens, pairs=pairs) / len(devices)
    seconds = max(model / chip.bf16_flops, x.bytes_accessed / chip.hbm_bytes_per_s)
    print(f"{name:7s} positions {tokens:>8,d}  XLA peak {x.bytes / GIB:6.2f} GiB/chip  "
          f"XLA flops {x.flops / 1e12:7.2f} T  bytes {x.bytes_accessed / GIB:7.2f} GiB  "
          f"model FLOPs {model / 1e12:7.2f} T/chip  roofline {seconds * 1e3:7.1f} ms/chip  "
          f"(compiled in {x.compile_s:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
