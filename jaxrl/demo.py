"""The embedded default job behind `make demo` / `jaxrl demo`: the foundation, then SFT.

Until the GRPO demo lands it shows the stack end to end on whatever devices there are:
  1. the tiny model is born sharded on the mesh in the learner layout, its parameter table is
     printed, the weights are moved into the sampler layout (timed, as every RL step will), and a
     batch of prompts is decoded greedily against an explicit KV cache, checked against a
     full-sequence forward;
  2. a short SFT run on the built-in addition task (jaxrl.train.sft), with the held-out
     exact-match accuracy of greedy decoding before and after, and a few answers. Its run
     directory (metrics, TensorBoard, checkpoints) is --workdir, or a temporary one.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import config as config_lib
from jaxrl.data import ByteTokenizer
from jaxrl.models import apply, init_cache
from jaxrl.parallel import (batch_sharding, cache_sharding, describe, init_params,
                            mesh_from_config, param_shardings, param_table)

PROMPTS = ("12+34=", "7+8=", "sort 3142:", "reverse abc:")


def greedy_generate(graphdef, params, cfg, prompts_bt, lengths_b, steps, mesh):
  """Greedy decoding of a right-padded batch: one prefill, then `steps` cached single steps.

  Returns (tokens [B, steps], logits of each chosen step [B, steps, V]). Slot b's first new
  token comes from position lengths_b[b]-1, and its decode positions continue from there.
  """
  B, T = prompts_bt.shape
  max_len = T + steps
  cache_shd = cache_sharding(mesh, cfg, B, max_len)
  cache = jax.device_put(init_cache(cfg, B, max_len), [cache_shd] * cfg.num_layers)
  tok_shd = batch_sharding(mesh, 2, "sampler")

  @jax.jit
  def prefill(params, tokens, lengths, cache):
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits, cache = apply(graphdef, params, tokens, positions, cache=cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return jnp.argmax(last, -1), last, cache

  def step(params, token_b, pos_b, cache):
    logits, cache = apply(graphdef, params, token_b[:, None], pos_b[:, None], cache=cache)
    return jnp.argmax(logits[:, 0], -1), logits[:, 0], cache

  step = jax.jit(step, donate_argnums=3)
  tokens = jax.device_put(prompts_bt, tok_shd)
  lengths = jnp.asarray(lengths_b)
  tok, logit, cache = prefill(params, tokens, lengths, cache)
  out_t, out_l = [tok], [logit]
  for i in range(steps - 1):
    tok, logit, cache = step(params, tok, lengths + i, cache)
    out_t.append(tok)
    out_l.append(logit)
  return np.stack(jax.device_get(out_t), 1), np.stack(jax.device_get(out_l), 1)


def run(config=None, *, steps: int = 12, out=print, sft_steps: int = 300,
        workdir: str | None = None) -> dict:
  """Both parts; `sft_steps=0` runs the foundation part only."""
  result = foundation(config, steps=steps, out=out)
  if sft_steps:
    result["sft"] = sft_demo(sft_steps, workdir=workdir, seed=(config.seed if config else 0),
                             out=out)
  return result


def sft_demo(steps: int, *, workdir: str | None = None, seed: int = 0, out=print) -> dict:
  """A short SFT run on addition; returns its summary with the accuracy before and after."""
  import tempfile

  from jaxrl.train import read_metrics, sft
  c = sft.default_config()
  c.seed = seed
  c.data.update(task="addition", train_examples=20_000)
  c.optim.update(lr=3e-3, warmup_steps=min(50, steps // 4))
  c.train.update(steps=steps, log_every=max(1, steps // 6), save_every=steps)
  c.eval.update(every=steps, examples=128)
  out(f"\n--- SFT: {steps} steps on addition (jaxrl sft --config configs/sft_tiny.py does "
      "1000)")
  with tempfile.TemporaryDirectory() as tmp:
    wd = workdir or tmp
    summary = sft.run(c, wd, out=out)
    metrics = read_metrics(wd)
  before = metrics[0].get("eval/accuracy", 0.0)
  after = summary["eval"].get("eval/accuracy", 0.0)
  out(f"held-out exact match: {before:.1%} untrained -> {after:.1%} after {steps} steps "
      f"({summary['wall_s']:.0f} s)")
  for prompt, completion, answer in summary["samples"][:6]:
    mark = "ok" if completion.strip() == answer else f"wrong, want {answer}"
    out(f"  {prompt!r:>12} -> {completion!r}  ({mark})")
  return {**summary, "accuracy_before": before, "accuracy_after": after}


def foundation(config=None, *, steps: int = 12, out=print) -> dict:
  config = config or config_lib.base_config()
  cfg = config_lib.model_config(config)
  mesh = mesh_from_config(config.mesh)
  out(f"jax {jax.__version__} | {describe(mesh)}")
  out(f"model preset {config.model.preset!r}: {cfg.num_params:,} parameters\n")
  out(param_table(cfg, mesh, "learner"))

  t0 = time.perf_counter()
  graphdef, params = init_params(cfg, mesh, "learner", seed=config.seed)
  jax.block_until_ready(params)
  out(f"\ninit (born sharded, learner layout): {time.perf_counter() - t0:.2f} s")

  # The learner -> sampler move that every RL step makes (one device_put to the new layout).
  target = param_shardings(cfg, mesh, "sampler")
  jax.block_until_ready(jax.device_put(params, target))  # warm-up
  t0 = time.perf_counter()
  sampler_params = jax.block_until_ready(jax.device_put(params, target))
  sync_ms = (time.perf_counter() - t0) * 1e3
  out(f"weight sync learner -> sampler layout: {sync_ms:.2f} ms")

  tok = ByteTokenizer()
  replicas = mesh.shape["data"] * mesh.shape["fsdp"]
  slots = -(-len(PROMPTS) // replicas) * replicas  # the cache shards slots over replicas
  prompts = [PROMPTS[i % len(PROMPTS)] for i in range(slots)]
  ids = [tok.encode(p, bos=True) for p in prompts]
  T = max(map(len, ids))
  batch = np.full((len(ids), T), tok.pad_id, np.int32)
  for b, seq in enumerate(ids):
    batch[b, :len(seq)] = seq
  lengths = np.array([len(s) for s in ids], np.int32)

  t0 = time.perf_counter()
  gen, step_logits = greedy_generate(graphdef, sampler_params, cfg, batch, lengths, steps, mesh)
  gen_s = time.perf_counter() - t0
  out(f"\ngreedy decode, {len(ids)} slots x {steps} tokens (untrained weights, so the text is "
      f"noise): {gen_s:.2f} s including compile")
  for p, g in zip(prompts, gen):
    out(f"  {p!r:>16} -> ids {g.tolist()}  text {tok.decode(g)!r}")

  # Check: the same logits from one full-sequence forward over prompt + generated tokens.
  full = np.full((len(ids), T + steps), tok.pad_id, np.int32)
  for b, seq in enumerate(ids):
    full[b, :len(seq)] = seq
    full[b, len(seq):len(seq) + steps] = gen[b]
  logits, _ = jax.jit(lambda p, t: apply(graphdef, p, t))(params, jnp.asarray(full))
  logits = np.asarray(logits)
  ref = np.stack([logits[b, lengths[b] - 1:lengths[b] - 1 + steps] for b in range(len(ids))])
  diff = float(np.max(np.abs(ref - step_logits)))
  out(f"cached decode vs full forward: max |logit difference| = {diff:.2e}")
  return {"sync_ms": sync_ms, "max_logit_diff": diff, "generated": gen}
