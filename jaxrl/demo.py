"""The embedded default job behind `make demo` / `jaxrl demo`.

Until the GRPO demo lands it shows the foundation end to end: the tiny model is born sharded
on the mesh in the learner layout, its parameter table is printed, the weights are moved into
the sampler layout (timed, as every RL step will), and a batch of prompts is decoded greedily by the
sampler engine (jaxrl.sampler). Its logprobs and tokens are then checked against a
full-sequence forward without a cache.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import config as config_lib
from jaxrl.data import ByteTokenizer
from jaxrl.models import apply, token_logprobs
from jaxrl.parallel import describe, init_params, mesh_from_config, param_shardings, param_table
from jaxrl.sampler import Engine, SamplingParams, generate

PROMPTS = ("12+34=", "7+8=", "sort 3142:", "reverse abc:")


def run(config=None, *, steps: int = 12, out=print) -> dict:
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

  # Greedy decoding with the sampler engine: prefill, insert, then decode steps in one scan.
  engine = Engine(graphdef, cfg, mesh,
                  sampling=SamplingParams(greedy=True, max_new_tokens=steps, eos_id=None))
  t0 = time.perf_counter()
  rollout = generate(engine, sampler_params, ids, n=1, slots=slots, steps_per_call=steps)
  gen_s = time.perf_counter() - t0
  gen = rollout.completion_ids
  out(f"\ngreedy decode, {len(ids)} slots x {steps} tokens (untrained weights, so the text is "
      f"noise): {gen_s:.2f} s including compile")
  for p, g in zip(prompts, gen):
    out(f"  {p!r:>16} -> ids {g.tolist()}  text {tok.decode(g)!r}")

  # Check: the sampler's logprobs and greedy tokens against one full-sequence forward (no cache)
  # over prompt + generated tokens.
  T = max(map(len, ids))
  full = np.full((len(ids), T + steps), tok.pad_id, np.int32)
  for b, seq in enumerate(ids):
    full[b, :len(seq)] = seq
    full[b, len(seq):len(seq) + steps] = gen[b]
  logits, _ = jax.jit(lambda p, t: apply(graphdef, p, t))(params, jnp.asarray(full))
  logits = np.asarray(logits)
  ref = np.stack([logits[b, len(ids[b]) - 1:len(ids[b]) - 1 + steps] for b in range(len(ids))])
  ref_logp, _ = token_logprobs(jnp.asarray(ref), jnp.asarray(gen))
  diff = float(np.max(np.abs(np.asarray(ref_logp) - rollout.logprobs)))
  argmax_ok = bool((ref.argmax(-1) == gen).all())
  out(f"cached decode vs full forward: max |logprob difference| = {diff:.2e}; greedy tokens "
      f"{'equal' if argmax_ok else 'differ from'} the full forward's argmax")
  return {"sync_ms": sync_ms, "max_logprob_diff": diff, "argmax_ok": argmax_ok, "generated": gen}
