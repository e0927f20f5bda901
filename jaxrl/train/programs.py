"""A trainer's programs without data or weights: abstract train states and batches laid out on
a mesh (real devices, or a TPU topology's abstract ones), so `jaxrl plan` can estimate each
program and `jaxrl plan --compile` can compile it. Nothing here allocates.

Each trainer's own `programs(config, devices=None)` (sft, rm, dpo, grpo) builds its Workload
and Programs with these helpers, from the same loss and step builders its run uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl import config as config_lib
from jaxrl.models import abstract_model, lora
from jaxrl.parallel import shard_activations, tree_shardings
from jaxrl.parallel.mesh import make_mesh
from jaxrl.parallel.plan import Program, residual_bytes
from jaxrl.train.state import (LoraStep, make_train_step, new_state, split_trainable,
                               state_shardings, train_only_of)


def spec(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def learner_mesh(config, devices=None):
  """The mesh of config.mesh over `devices` (default: this process's)."""
  m = config.mesh
  return make_mesh(m.data, m.fsdp, m.tensor, devices=devices)


def model_knobs(config) -> dict:
  """The model's remat policy and log-prob chunk (positions per chunk; 0 when off) as the
  model reads them (ModelConfig.remat, .chunked_logits)."""
  cfg = config_lib.model_config(config)
  return {"remat": getattr(cfg, "remat", "none"),
          "logits_chunk": cfg.logits_chunk if getattr(cfg, "chunked_logits", False) else 0}


def abstract_state(cfg, mesh, tx, *, layout: str, model=None):
  """(graphdef, state, shardings): a TrainState of ShapeDtypeStructs in the layout's shardings,
  as init_train_state would build it, without building it."""
  graphdef, shapes, axes = abstract_model(cfg, model)
  param_shd = tree_shardings(shapes, axes, mesh, layout)
  train_only = train_only_of(cfg, shapes)

  def init():
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return new_state(params, tx, jax.random.key_data(jax.random.key(0)), train_only)

  abstract = jax.eval_shape(init)
  shardings = state_shardings(abstract, param_shd, tx, mesh)
  state = jax.tree.map(lambda a, s: spec(a.shape, a.dtype, s), abstract, shardings)
  return graphdef, state, shardings


def params_of(graphdef_shapes_axes, mesh, layout: str):
  """Abstract params (ShapeDtypeStructs with shardings) of (graphdef, shapes, axes)."""
  _, shapes, axes = graphdef_shapes_axes
  shd = tree_shardings(shapes, axes, mesh, layout)
  return jax.tree.map(lambda s, d: spec(s.shape, s.dtype, d), shapes, shd)


def plain_graphdef(cfg, model=None):
  """The graphdef of the model without remat: its residuals per block are one block's
  activations (Program.layer_bytes)."""
  return abstract_model(cfg.replace(remat="none"), model)[0]


def layer_bytes(fn, params, batch, *, layers: int, mesh, depth: int | None = None) -> int:
  """Bytes per device of one decoder block's activations for fn(params, batch) (a loss or
  log-probs over the batch, on a graphdef without remat): its backward's residuals over the
  `layers` blocks, the rows split over the mesh's batch axes. `depth`: the blocks of each model
  in fn, for residual_bytes to trace two of them and extrapolate (default `layers`, one model;
  0 traces every block, for models of different depths)."""
  ways = mesh.shape["data"] * mesh.shape["fsdp"]
  def loss(p, b, key):
    del key
    out = fn(p, b)
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(out.astype(jnp.float32)), None
  depth = layers if depth is None else depth
  return residual_bytes(shard_activations(loss, mesh), params, batch, ways=ways,
                        depth=depth) // layers


def micro_batch(batch, accum_steps: int):
  """The abstract first micro-batch of a batch (rows / accum_steps of every leaf)."""
  def cut(x):
    return jax.ShapeDtypeStruct((x.shape[0] // accum_steps, *x.shape[1:]), x.dtype,
                                sharding=x.sharding)
  return jax.tree.map(cut, batch)


def frozen_base_loss(loss_fn, train_only):
  """loss_fn over the whole params with the frozen base behind stop_gradient: its vjp keeps
  only what the trained parameters' gradients need, as the LoRA step's does."""
  def loss(params, batch, key):
    trained, frozen = split_trainable(params, train_only)
    return loss_fn(lora.combine(jax.lax.stop_gradient(frozen), trained), batch, key)
  return loss


def train_program(loss_fn, tx, schedule, state, shardings, batch, *, mesh, accum_steps: int,
                  resident: dict | None = None, flops: float = 0.0, tokens: int = 0,
                  seq_len: int = 0, vocab: int = 0, logits_chunk: int = 0,
                  plain_loss=None, cfg=None, name: str = "train step") -> Program:
  """The trainer's jitted train step (make_train_step, as its run builds it) over abstract
  arguments; its loss traced over one micro-batch for the backward's residuals. With LoRA the
  program is the step over (trained state, frozen base, batch): the gradients and optimizer
  state it counts are the adapters', and the base is an argument once, never donated."""
  batch_shd = jax.tree.map(lambda x: x.sharding, batch)
  step = make_train_step(loss_fn, tx, schedule, shardings, batch_shd, mesh=mesh,
                         accum_steps=accum_steps)
  args, loss = (state, batch), loss_fn
  if isinstance(step, LoraStep):
    step, args = step.jitted, step.args(state, batch)
    loss = frozen_base_loss(loss_fn, state.train_only)
  micro = micro_batch(batch, accum_steps)
  rows = max(x.sharding.shard_shape(x.shape)[0] for x in jax.tree.leaves(micro)
             if len(x.shape) >= 2)
  remat = getattr(cfg, "remat", "none") if cfg is not None else "none"
  per_layer = 0
  if remat != "none" and plain_loss is not None:
    per_layer = layer_bytes(lambda p, b: plain_loss(p, b, None)[0], state.params, micro,
                            layers=cfg.num_layers, mesh=mesh)
  return Program(name, step, args, "train", resident=dict(resident or {}),
                 loss=(shard_activations(loss, mesh), state.params, micro), donated=(0,),
                 flops=flops, tokens=tokens, rows=rows, seq_len=seq_len, vocab=vocab,
                 logits_chunk=logits_chunk, layer_bytes=per_layer, remat=remat,
                 accum_steps=accum_steps, depth=cfg.num_layers if cfg is not None else 0)


def forward_program(name: str, fn, args, *, kind: str = "forward", resident=None,
                    flops: float = 0.0, tokens: int = 0, rows: int = 0, seq_len: int = 0,
                    vocab: int = 0, logits_chunk: int = 0, donated=(), plain_fn=None,
                    cfg=None, mesh=None) -> Program:
  """A program without a gradient; `plain_fn(params, batch)`, the same forward without remat,
  gives one block's activations (a learner forward's working set)."""
  per_layer = 0
  if plain_fn is not None:
    per_layer = layer_bytes(plain_fn, args[0], args[1], layers=cfg.num_layers, mesh=mesh)
  return Program(name, fn, tuple(args), kind, resident=dict(resident or {}), donated=donated,
                 flops=flops, tokens=tokens, rows=rows, seq_len=seq_len, vocab=vocab,
                 logits_chunk=logits_chunk, layer_bytes=per_layer)
