"""Held-out evaluation: teacher-forced loss, and exact match of greedy decoding on a task.

The greedy decoder is one jit (prefill, then a lax.scan of cached single-token steps), compiled
once per run and called at every eval. It runs on the learner's params in the learner layout,
so evaluating needs no weight sync into the sampler and no sampler KV cache.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.data.hf_tokenizer import eos_ids
from jaxrl.data.prompts import render_prompt
from jaxrl.models import apply, init_cache
from jaxrl.parallel import batch_sharding, cache_sharding, shard_activations
from jaxrl.parallel.distributed import global_array


def make_greedy_decoder(graphdef, cfg, mesh, *, batch: int, prompt_len: int, max_new: int):
  """decode(params, tokens [B, T] right-padded, lengths [B]) -> new tokens [B, max_new].

  Slot b's first new token is predicted at position lengths[b]-1, and each later token is fed
  at the next position, overwriting the padding the prefill wrote there before it is attended.
  The result is replicated, so every process can read it.
  """
  max_len = prompt_len + max_new
  cache_shd = cache_sharding(mesh, cfg, batch, max_len, layout="learner")
  replicated = NamedSharding(mesh, P())

  def decode(params, tokens_bt, lengths_b):
    cache = [jax.lax.with_sharding_constraint(c, cache_shd)
             for c in init_cache(cfg, batch, max_len)]
    positions = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
    logits, cache = apply(graphdef, params, tokens_bt, positions, cache=cache)
    last = jnp.take_along_axis(logits, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    first = jnp.argmax(last, -1).astype(jnp.int32)

    def body(carry, i):
      tok_b, cache = carry
      logits, cache = apply(graphdef, params, tok_b[:, None], (lengths_b + i)[:, None],
                            cache=cache)
      return (jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache), tok_b

    (last_tok, _), toks = jax.lax.scan(body, (first, cache), jnp.arange(max_new - 1))
    return jnp.concatenate([toks.T, last_tok[:, None]], axis=1)  # [B, max_new]

  return jax.jit(decode, out_shardings=replicated)


def encode_prompt(tokenizer, record: dict, data_cfg=None) -> list[int]:
  """The token ids of a held-out record's prompt: the one place evaluation encodes a prompt
  (greedy exact match and jaxrl.evals), the same way GRPO's rollouts encode theirs
  (jaxrl.data.prompts.render_prompt: the chat template for an instruct checkpoint, per the
  config's data section `data_cfg`; bos + text for the byte tokenizer)."""
  return render_prompt(record, tokenizer, data_cfg)


class GreedyDecoder:
  """Greedy completions (text) of fixed prompts, `batch` rows per call of one jitted decoder
  (make_greedy_decoder) on the learner's params in the learner layout."""

  def __init__(self, graphdef, cfg, mesh, tokenizer, ids: list[list[int]], *, batch: int,
               max_new: int):
    self.tokenizer, self.count = tokenizer, len(ids)
    replicas = mesh.shape["data"] * mesh.shape["fsdp"]
    self.batch = -(-batch // replicas) * replicas  # the cache shards slots over replicas
    self.prompt_len = max(map(len, ids))
    n_pad = -(-len(ids) // self.batch) * self.batch
    self.tokens = np.full((n_pad, self.prompt_len), tokenizer.pad_id, np.int32)
    self.lengths = np.ones((n_pad,), np.int32)  # padded rows decode garbage, never scored
    for i, seq in enumerate(ids):
      self.tokens[i, :len(seq)] = seq
      self.lengths[i] = len(seq)
    self.decode = make_greedy_decoder(graphdef, cfg, mesh, batch=self.batch,
                                      prompt_len=self.prompt_len, max_new=max_new)
    self.tok_shd = batch_sharding(mesh, 2, "learner")
    self.len_shd = batch_sharding(mesh, 1, "learner")

  def token_ids(self, params) -> list[np.ndarray]:
    """Each prompt's new tokens, cut before the first eos."""
    out = []
    for s in range(0, len(self.tokens), self.batch):
      new = self.decode(params, global_array(self.tokens[s:s + self.batch], self.tok_shd),
                        global_array(self.lengths[s:s + self.batch], self.len_shd))
      for row in np.asarray(new):
        eos = np.flatnonzero(np.isin(row, eos_ids(self.tokenizer)))
        out.append(row[:eos[0]] if len(eos) else row)
    return out[:self.count]

  def __call__(self, params) -> list[str]:
    return [self.tokenizer.decode(row) for row in self.token_ids(params)]


class ExactMatch:
  """Greedy-decodes `prompts` and scores each completion with `check(completion, answer)`."""

  def __init__(self, graphdef, cfg, mesh, tokenizer, records, check, *, batch: int,
               max_new: int, data_cfg=None):
    self.tokenizer, self.check, self.records = tokenizer, check, list(records)
    self.samples: list[tuple[str, str, str]] = []  # (prompt, completion, answer) of the last eval
    self.greedy = GreedyDecoder(graphdef, cfg, mesh, tokenizer,
                                [encode_prompt(tokenizer, r, data_cfg) for r in self.records],
                                batch=batch, max_new=max_new)

  def completions(self, params) -> list[str]:
    return self.greedy(params)

  def __call__(self, params) -> dict[str, float]:
    comps = self.completions(params)
    scores = [self.check(c, r["answer"]) for c, r in zip(comps, self.records)]
    self.samples = [(r["prompt"], c, r["answer"]) for c, r in zip(comps[:8], self.records)]
    return {"eval/accuracy": float(np.mean(scores))}


def make_eval_loss(loss_fn, mesh):
  """eval_loss(params, batches) -> sum(loss_sum) / sum(weight) over fixed held-out batches."""
  replicated = NamedSharding(mesh, P())

  @jax.jit
  @functools.partial(shard_activations, mesh=mesh)
  def sums(params, batch):
    loss_sum, (weight, _) = loss_fn(params, batch, None)  # no key: no dropout at eval
    return jax.lax.with_sharding_constraint(jnp.stack([loss_sum, weight]), replicated)

  def eval_loss(params, batches) -> float:
    total = np.zeros(2)
    for b in batches:
      total += np.asarray(sums(params, b))
    return float(total[0] / max(total[1], 1e-9))

  return eval_loss
