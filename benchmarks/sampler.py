"""The rollout engine against its baselines, side by side, in one run.

    .venv/bin/python benchmarks/sampler.py --hf-python /tmp/peer/bin/python  # all four sections
    .venv/bin/python benchmarks/sampler.py --hf-python /tmp/peer/bin/python --quick \
        --skip naive,cb,group,attention   # engine against HF generate at batch 1 and 16 only

Model: the `bench` preset (Qwen2-style, 4,487,424 parameters, fp32, random weights), the shape
of the sampler issue's HF transformers peer anchor. Figures count generated tokens only;
compile time is excluded (one warm-up call each), and each figure is the best of --repeats runs.

1. New tokens/s for prompt 16 and exactly 128 new tokens at batch 1, 16, 64, temperature 1.0:
   this engine (rollout driver: prefill, insert, k decode steps per jitted scan) against a naive
   loop that recomputes the whole sequence without a cache for each new token (one jitted
   forward + sample per token), and against HF transformers `generate` on the same model sizes
   and the same prompts. HF runs in this invocation: --hf-python PY starts
   benchmarks/peers/hf_generate.py under PY (a separate venv with torch and transformers, never
   a jaxrl dependency: python3.11 -m venv /tmp/peer && /tmp/peer/bin/pip install torch==2.13.0
   transformers), and its timed calls alternate with the engine's, call by call, so both are
   measured in the same minutes of a shared machine whose speed drifts by up to 1.5x over a day.
   Without --hf-python the table has jaxrl's figures alone: a ratio to HF figures measured in
   another hour or on another CPU would say more about the machine than about the engine. Each
   side uses its default threads (jax's pool; torch's OpenMP, one per core). On a loaded
   machine torch's OpenMP barriers stall far more than jax's pool, so read the ratio only from
   a run whose load average at start is low.
2. Static vs continuous batching on long-tailed lengths: stop ids make completion lengths
   roughly geometric (mean ~30 tokens, capped at 256), so a static batch waits for its longest.
3. Group insert: n = 8 samples of long prompts, prefilled once per prompt (group insert) vs once
   per sample.
4. Decode attention: the GRPO anchor's rollout with XLA's attention and with jaxrl's CPU kernel
   (jaxrl/backends/cpu/attention.py), alternating call by call.

The mesh is one CPU device (jax's intra-op threads use both cores): on 2 cores, splitting a
4.5M model over fake devices only adds collectives.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import apply, get_preset
from jaxrl.parallel import init_params, make_mesh
from jaxrl.sampler import Engine, SamplingParams, generate, sample_logits, token_keys

TARGET = {1: 5.0, 16: 1.5, 64: 1.0}  # required multiple of HF generate's rate
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "hf_generate.py")


def _prompts(batch, length, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(3, 259, size=(batch, length)).tolist()


def _best(fn, repeats):
  fn()  # compile / warm up
  best = None
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    best = dt if best is None or dt < best else best
  return best, out


class HFPeer:
  """HF generate in its own interpreter (benchmarks/peers/hf_generate.py), kept up for the
  whole table so each of its timed calls can sit between two of the engine's."""

  def __init__(self, python, cfg):
    if cfg.dtype != "float32" or not cfg.qkv_bias or cfg.qk_norm or cfg.rope_scaling is not None:
      raise SystemExit(f"the HF peer builds a Qwen2 model in fp32; the bench preset is {cfg}")
    spec = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.mlp_dim, "tie_word_embeddings": cfg.tie_embeddings,
            "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.norm_eps}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    env.pop("XLA_FLAGS", None)
    # torch runs on glibc malloc, as it does by default (grpo_step.py's TRL peer does the same).
    preload = [x for x in env.pop("LD_PRELOAD", "").split(":") if x and "tcmalloc" not in x]
    if preload:
      env["LD_PRELOAD"] = ":".join(preload)
    self.python = python
    # stderr goes to a file: a pipe nobody reads could fill with warnings and stall the peer.
    self.stderr = tempfile.TemporaryFile("w+")
    try:
      self.proc = subprocess.Popen([python, PEER, json.dumps(spec)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                   env=env)
    except OSError as e:
      raise SystemExit(f"--hf-python {python}: cannot run it ({e}).") from None
    self.info = self._read()
    if self.info["params"] != cfg.num_params:
      raise SystemExit(f"the HF peer built {self.info['params']:,} parameters and the bench "
                       f"preset has {cfg.num_params:,}: the two models differ")

  def _read(self):
    line = self.proc.stdout.readline()
    if not line:
      self.proc.wait()
      self.stderr.seek(0)
      tail = self.stderr.read()[-2000:]
      raise SystemExit(
          f"benchmarks/peers/hf_generate.py failed under {self.python} (exit "
          f"{self.proc.returncode}). It needs torch and transformers there: python3.11 -m venv "
          f"/tmp/peer && /tmp/peer/bin/pip install torch==2.13.0 transformers. Its last "
          f"output:\n{tail}")
    return json.loads(line)

  def generate(self, prompts, new):
    """One HF generate call on `prompts` for exactly `new` tokens: its seconds (timed in the
    peer, around generate alone) and the number of new tokens it made."""
    self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
    self.proc.stdin.flush()
    out = self._read()
    return out["seconds"], out["tokens"]

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()
    self.stderr.close()


def naive_loop(graphdef, params, cfg, prompts, new, temperature, *, timed_steps=None):
  """Recompute without a cache: a full forward over a fixed [B, prompt + new] buffer per token
  (fixed so it compiles once), sampling at `temperature` with the same keys.

  Every step is the same fixed-shape forward, so its rate does not change along the sequence;
  `timed_steps` runs only the first that many steps (the caller scales the rate accordingly).
  """
  B, T = len(prompts), len(prompts[0])
  S = T + new
  sp = SamplingParams(temperature=temperature, max_new_tokens=new, eos_id=None)
  key = jax.random.key(0)
  samples = jnp.arange(B, dtype=jnp.int32)

  @jax.jit
  def step(params, seq, n):
    logits, _ = apply(graphdef, params, seq)
    last = jnp.take(logits, n - 1, axis=1)
    tok, _ = sample_logits(last, token_keys(key, samples, jnp.full((B,), n - T)), sp)
    return seq.at[:, n].set(tok)

  def run():
    seq = jnp.zeros((B, S), jnp.int32).at[:, :T].set(jnp.asarray(prompts, jnp.int32))
    for n in range(T, T + (timed_steps or new)):
      seq = step(params, seq, n)
    return jax.block_until_ready(seq)

  return run


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--batches", default="1,16,64")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--steps-per-call", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--skip", default="",
                 help="comma list of sections to skip: naive,cb,group,attention")
  p.add_argument("--attention-pairs", type=int, default=10)
  p.add_argument("--hf-python", default=None,
                 help="an interpreter with torch and transformers: also time HF generate on "
                      "section 1's shapes, alternating with the engine, in this run")
  args = p.parse_args()
  batches = [1, 16] if args.quick else [int(b) for b in args.batches.split(",")]
  skip = set(args.skip.split(","))
  mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  cfg = get_preset("bench")
  # Started first so that a peer that cannot run fails before minutes of timing, not after.
  hf = HFPeer(args.hf_python, cfg) if args.hf_python else None
  graphdef, params = init_params(cfg, mesh, "sampler", seed=0)
  print(f"jax {jax.__version__} | 1 CPU device, {os.cpu_count()} cores | preset bench "
        f"({cfg.num_params:,} params, fp32) | steps per call {args.steps_per_call} | "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} | load average at start "
        f"{os.getloadavg()[0]:.1f}")
  if hf:
    i = hf.info
    print(f"HF generate: torch {i['torch']}, transformers {i['transformers']}, {i['threads']} "
          f"threads, {i['attention']} attention, {i['params']:,} params, under {args.hf_python}")

  # ---- 1. engine vs naive vs HF
  prompt_len, new = 16, 128
  sp = SamplingParams(temperature=1.0, max_new_tokens=new, eos_id=None)
  engine = Engine(graphdef, cfg, mesh, sampling=sp)
  print(f"\n1. prompt {prompt_len}, exactly {new} new tokens, temperature 1.0 (new tokens/s)")
  print(f"{'batch':>5} {'engine':>9} {'naive':>9} {'HF generate':>12} {'engine/naive':>13} "
        f"{'engine/HF':>10} {'target':>7}")
  for B in batches:
    prompts = _prompts(B, prompt_len)

    def run_engine():
      return generate(engine, params, prompts, n=1, slots=B, steps_per_call=args.steps_per_call,
                      max_prompt_len=prompt_len)

    # The engine's calls and HF's alternate, one each per repeat, after one warm-up each.
    run_engine()
    if hf:
      hf.generate(prompts, new)
    dt = dt_hf = float("inf")
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      r = run_engine()
      dt = min(dt, time.perf_counter() - t0)
      assert int(r.lengths.sum()) == B * new
      if hf:
        seconds, tokens = hf.generate(prompts, new)
        assert tokens == B * new, (tokens, B * new)
        dt_hf = min(dt_hf, seconds)
    ours = B * new / dt
    if "naive" in skip:
      naive = float("nan")
    else:
      # The naive loop takes minutes at batch 16 and 64 on 2 cores: time 16 of its 128 identical
      # fixed-shape steps there.
      steps = new if B == 1 else 16
      dtn, _ = _best(naive_loop(graphdef, params, cfg, prompts, new, 1.0, timed_steps=steps), 1)
      naive = B * steps / dtn
    hf_s, ratio_hf = ("-", "-") if not hf else (f"{B * new / dt_hf:.0f}",
                                                f"{ours * dt_hf / (B * new):.2f}x")
    target = f"{TARGET[B]:.1f}x" if B in TARGET else "-"
    naive_s, ratio_naive = ("-", "-") if naive != naive else (f"{naive:.0f}",
                                                              f"{ours / naive:.1f}x")
    print(f"{B:5d} {ours:9.0f} {naive_s:>9} {hf_s:>12} {ratio_naive:>13} {ratio_hf:>10} "
          f"{target:>7}", flush=True)
  if hf:
    hf.close()  # its memory and threads are not the later sections' business
  else:
    print("engine/HF needs HF generate measured in this run: pass --hf-python PY, an "
          "interpreter with torch and transformers (see the module docstring)")

  # ---- 2. static vs continuous batching on long-tailed lengths
  if "cb" not in skip:
    num, slots, max_new = 128, 16, 256
    stops = tuple(range(3, 512, 32))  # 16 of 512 ids: ~3% stop chance per token
    sp_tail = SamplingParams(temperature=1.0, max_new_tokens=max_new, eos_id=None,
                             stop_ids=stops)
    eng_tail = Engine(graphdef, cfg, mesh, sampling=sp_tail)
    prompts = _prompts(num, prompt_len, seed=1)
    res = {}
    for mode in ("static", "continuous"):
      def run_mode():
        return generate(eng_tail, params, prompts, n=1, slots=slots,
                        steps_per_call=8, continuous=mode == "continuous")
      dt, r = _best(run_mode, max(1, args.repeats - 1))
      res[mode] = (int(r.lengths.sum()) / dt, r)
    lengths = res["static"][1].lengths
    print(f"\n2. {num} samples on {slots} slots, long-tailed lengths (mean {lengths.mean():.0f}, "
          f"median {np.median(lengths):.0f}, p95 {np.percentile(lengths, 95):.0f}, max "
          f"{lengths.max()}), 8 steps per call")
    print(f"{'batching':>10} {'tokens/s':>9} {'slot util':>10} {'decode steps':>13} "
          f"{'prefill calls':>14} {'prefill s':>10} {'decode s':>9}")
    for mode, (tps, r) in res.items():
      st = r.stats
      print(f"{mode:>10} {tps:9.0f} {st['slot_utilisation']:10.2f} {st['decode_steps']:13d} "
            f"{st['prefill_calls']:14d} {st['prefill_s']:10.2f} {st['decode_s']:9.2f}")
    assert (res["static"][1].completion_ids == res["continuous"][1].completion_ids).all()
    print(f"continuous / static: {res['continuous'][0] / res['static'][0]:.2f}x (target 1.5x); "
          "both return identical samples")

  # ---- 3. group insert
  if "group" not in skip:
    G, num_prompts, plen = 8, 8, 512
    sp_g = SamplingParams(temperature=1.0, max_new_tokens=16, eos_id=None)
    eng_g = Engine(graphdef, cfg, mesh, sampling=sp_g)
    prompts = _prompts(num_prompts, plen, seed=2)
    res = {}
    for share in (True, False):
      def run_share():
        return generate(eng_g, params, prompts, n=G, slots=64, steps_per_call=16,
                        share_prefix=share)
      _, r = _best(run_share, max(1, args.repeats - 1))
      res[share] = r
    print(f"\n3. {num_prompts} prompts x {plen} tokens, n = {G} samples each, 64 slots")
    print(f"{'prefill':>16} {'prompt rows':>12} {'prompt tokens':>14} {'prefill s':>10}")
    for share, name in ((False, "once per sample"), (True, "group insert")):
      st = res[share].stats
      print(f"{name:>16} {st['prefill_prompts']:12d} {st['prefill_tokens']:14d} "
            f"{st['prefill_s']:10.3f}")
    a, b = res[False].stats, res[True].stats
    print(f"group insert cuts prefill work {a['prefill_tokens'] / b['prefill_tokens']:.0f}x "
          f"(tokens) and prefill time {a['prefill_s'] / b['prefill_s']:.1f}x; samples identical: "
          f"{bool((res[True].completion_ids == res[False].completion_ids).all())}")

  # ---- 4. decode attention: XLA's against jaxrl's CPU kernel (backends/cpu/csrc/)
  if "attention" not in skip:
    attention_ab(graphdef, params, cfg, mesh, args.attention_pairs)


def attention_ab(graphdef, params, cfg, mesh, pairs):
  """The GRPO anchor's rollout (8 prompts x 8 samples, exactly 64 tokens, 64 slots, 16 steps
  per call) with XLA's decode attention and with the CPU kernel, the two alternating call by
  call in this process (the machine's speed drifts between runs)."""
  from jaxrl.backends.cpu import build

  if not build.available():
    print("\n4. decode attention: the CPU kernel is unavailable here (see above); skipped")
    return
  sp = SamplingParams(temperature=1.0, max_new_tokens=64, eos_id=None)
  kernel = Engine(graphdef, cfg, mesh, sampling=sp)
  xla = Engine(graphdef, cfg, mesh, sampling=sp)
  xla._attention_kernel = lambda state: None  # XLA's batched products and masked softmax
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, 259, size=int(rng.integers(10, 20))).tolist() for _ in range(8)]
  runs = {}
  for name, engine in (("xla", xla), ("kernel", kernel)):
    runs[name] = functools.partial(generate, engine, params, prompts, n=8, slots=64,
                                   steps_per_call=16, max_prompt_len=32)
  out = {name: run() for name, run in runs.items()}  # compiles
  times = {name: [] for name in runs}
  for _ in range(pairs):
    for name, run in runs.items():
      t0 = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - t0)
  same = float((out["xla"].completion_ids == out["kernel"].completion_ids).mean())
  print(f"\n4. decode attention on the GRPO anchor's rollout (8 prompts x 8, exactly 64 tokens, "
        f"64 slots), {pairs} alternating pairs, ms per rollout")
  print(f"{'attention':>10} {'median':>8} {'min':>8} {'max':>8}")
  for name, ts in times.items():
    ms = np.asarray(ts) * 1e3
    print(f"{name:>10} {np.median(ms):8.0f} {ms.min():8.0f} {ms.max():8.0f}")
  ratio = np.median(times["xla"]) / np.median(times["kernel"])
  print(f"kernel: {ratio:.2f}x XLA's rollout speed; tokens equal to XLA's: {same:.4f}")


if __name__ == "__main__":
  main()
