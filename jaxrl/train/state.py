"""Train state (one pytree, born sharded) and the one jitted train step every trainer uses.

A trainer supplies only a loss:

    loss_fn(params, batch, key) -> (loss_sum, (weight, metric_sums))

The loss is reported as sum(loss_sum) / sum(weight) over the whole global batch, and gradients
are normalised the same way, so splitting a batch into micro-batches (`accum_steps`) changes
nothing but memory: SFT passes token sums and token counts (a token-level mean, as TRL does),
a pairwise loss passes per-pair sums and the pair count. `metric_sums` are divided by the same
weight.

With LoRA (model.lora.rank > 0) the base weights are frozen: the state's `train_only` names
what trains besides the adapters (a reward model's head), the optimizer state covers only
those parameters, the gradient is taken with respect to them alone, and the frozen base is an
argument of the step that is never donated, so arrays that share it (GRPO's reference, the
base with adapters off) stay valid. The state's params stay one tree, base and adapters, so
checkpoints, resume and the weight sync see the whole model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl import config as config_lib
from jaxrl.backends import compiler_options
from jaxrl.io.hf import load_hf, params_from_config
from jaxrl.io.params import restore_params
from jaxrl.models import ModelConfig, Transformer, abstract_model
from jaxrl.models import lora
from jaxrl.parallel import shard_activations, tree_shardings
from jaxrl.train import rundir


@flax.struct.dataclass
class TrainState:
  params: Any     # nested dict of arrays, learner layout
  opt_state: Any  # optax state; param-shaped leaves share the params' shardings
  step: jax.Array  # int32 [], optimizer updates done
  rng: jax.Array   # uint32 key data; raw data, so orbax saves it like any array
  # None: every parameter trains. A tuple: LoRA, where the adapters train and so do the
  # top-level sub-trees it names (a reward model's head); the rest (the base) is frozen and
  # has no optimizer state. Static: part of the tree's structure, not saved.
  train_only: tuple[str, ...] | None = flax.struct.field(pytree_node=False, default=None)

  def step_key(self) -> jax.Array:
    """This step's key: fold_in(key, step), so no key is reused and resuming replays exactly."""
    return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)


def split_trainable(params, train_only: tuple[str, ...] | None):
  """(trained, frozen) sub-trees of the params: everything and {} when train_only is None,
  else the adapters (and the sub-trees train_only names) and the frozen base."""
  if train_only is None:
    return params, {}
  keep = lambda path: lora.trainable(path, train_only)  # noqa: E731
  return lora.partition(params, keep), lora.partition(params, lambda p: not keep(p))


def train_only_of(cfg: ModelConfig, params) -> tuple[str, ...] | None:
  """What a run of `cfg` trains besides LoRA adapters (TrainState.train_only): None (all of
  it) without LoRA; with LoRA, nothing for a policy, and every top-level sub-tree but the
  decoder ("backbone") for a model wrapping one (a reward model's head)."""
  if not cfg.lora_rank:
    return None
  if "backbone" not in params:
    return ()
  return tuple(str(k) for k in params if k != "backbone")


def state_shardings(abstract: TrainState, param_shd, tx, mesh: Mesh) -> TrainState:
  """Shardings of a TrainState: optimizer moments follow their parameters (the trained ones);
  counters and the key are replicated."""
  replicated = NamedSharding(mesh, P())
  trained_shd, _ = split_trainable(param_shd, abstract.train_only)
  opt_shd = optax.tree_map_params(tx, lambda _, s: s, abstract.opt_state, trained_shd,
                                  transform_non_params=lambda _: replicated)
  return TrainState(params=param_shd, opt_state=opt_shd, step=replicated, rng=replicated,
                    train_only=abstract.train_only)


def new_state(params, tx, rng, train_only: tuple[str, ...] | None) -> TrainState:
  """A fresh TrainState of params: optimizer state for the trained parameters only."""
  trained, _ = split_trainable(params, train_only)
  return TrainState(params=params, opt_state=tx.init(trained), step=jnp.zeros((), jnp.int32),
                    rng=rng, train_only=train_only)


def init_train_state(cfg: ModelConfig, mesh: Mesh, tx, *, seed: int, layout: str = "learner",
                     model=None, params_from: Callable | None = None):
  """(graphdef, state, shardings): the state is born sharded (eval_shape, then a jitted init
  with out_shardings), so no device ever holds a full unsharded copy. `model` is the module
  class to train, built as model(cfg, rngs=...): the Transformer (a policy) by default, whose
  parameters then equal jaxrl.parallel.init_params(cfg, mesh, seed=seed); RewardModel for a
  reward model. params_from(abstract params) -> params: a source of every parameter (a
  checkpoint), used instead of the random init, whose program then never compiles or runs;
  the rest of the state is the same to the bit (the optimizer's state follows the params'
  shapes, not their values)."""
  build = Transformer if model is None else model
  graphdef, shapes, axes = abstract_model(cfg, build)
  param_shd = tree_shardings(shapes, axes, mesh, layout)
  train_only = train_only_of(cfg, shapes)

  def around(params, key):  # the state of these params: the key's stream apart from the init's
    return new_state(params, tx, jax.random.key_data(jax.random.fold_in(key, 1)), train_only)

  def init(key):
    return around(nnx.to_pure_dict(nnx.state(build(cfg, rngs=nnx.Rngs(params=key)))), key)

  key = jax.random.key(seed)
  abstract = jax.eval_shape(init, key)
  shardings = state_shardings(abstract, param_shd, tx, mesh)
  if params_from is None:
    return graphdef, jax.jit(init, out_shardings=shardings)(key), shardings
  params = params_from(_laid_out(shapes, param_shd))
  # Donated: the restored params become the state's, never two copies of them.
  return graphdef, jax.jit(around, out_shardings=shardings, donate_argnums=0)(params, key), \
      shardings


def make_train_step(loss_fn: Callable, tx, schedule, shardings: TrainState, batch_shardings, *,
                    mesh: Mesh, accum_steps: int = 1):
  """One jit: forward, backward, clip, update. The state is donated (updated in place) and
  every output has an explicit sharding, so the layout never drifts between steps.

  Returns step(state, batch) -> (state, metrics) with metrics `loss`, `grad_norm`, `lr` (the
  rate this update used) and the loss's own metrics, as replicated scalars. With LoRA
  (shardings.train_only not None) it is a LoraStep: the same call, over the trained
  parameters only, the frozen base passed beside the state and not donated.
  """
  replicated = NamedSharding(mesh, P())

  def step_body(state: TrainState, batch, loss):
    def grads_and_sums(params, batch, key):
      (loss_sum, (weight, sums)), grads = jax.value_and_grad(loss, has_aux=True)(
          params, batch, key)
      return grads, loss_sum, weight, sums

    key = state.step_key()
    if accum_steps == 1:
      grads, loss_sum, weight, sums = grads_and_sums(state.params, batch, key)
    else:
      # Rows come in units: the batch's shortest leading dimension counts them, and an array
      # with u times as many rows holds u consecutive rows per unit (GRPO's shared-prompt
      # batch: one prompt row and its G completion rows). Unit b*A + i goes to micro-batch i:
      # every device keeps its own rows, no data moves, and a unit is never split.
      units = min(x.shape[0] for x in jax.tree.leaves(batch))

      def split(x):  # [B, ...] -> [A, B/A, ...]
        u = x.shape[0] // units
        x = x.reshape(units // accum_steps, accum_steps, u, *x.shape[1:])
        return jnp.moveaxis(x, 1, 0).reshape(accum_steps, x.shape[0] * u, *x.shape[3:])
      micro = jax.tree.map(split, batch)

      def body(carry, i_mb):
        i, mb = i_mb
        out = grads_and_sums(state.params, mb, jax.random.fold_in(key, i))
        return jax.tree.map(jnp.add, carry, out), None

      zero = jax.eval_shape(grads_and_sums, state.params, jax.tree.map(lambda x: x[0], micro),
                            key)
      zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zero)
      (grads, loss_sum, weight, sums), _ = jax.lax.scan(
          body, zero, (jnp.arange(accum_steps), micro))
    weight = jnp.maximum(weight, 1e-9)  # an all-masked batch gives zero loss, not NaN
    grads = jax.tree.map(lambda g: g / weight, grads)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss_sum / weight, "grad_norm": grad_norm,
               "lr": jnp.asarray(schedule(state.step), jnp.float32),
               **{k: v / weight for k, v in sums.items()}}
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics

  options = compiler_options(mesh.devices.flat)
  if shardings.train_only is None:
    return jax.jit(shard_activations(lambda state, batch: step_body(state, batch, loss_fn), mesh),
                   donate_argnums=0, in_shardings=(shardings, batch_shardings),
                   out_shardings=(shardings, replicated), compiler_options=options)

  def lora_step(state: TrainState, frozen, batch):
    # The gradient reaches only state.params (the trained part); the base enters the loss as
    # a constant, so it has no gradient and no optimizer state.
    return step_body(state, batch,
                     lambda p, b, k: loss_fn(lora.combine(frozen, p), b, k))

  trained_shd, frozen_shd = split_trainable(shardings.params, shardings.train_only)
  state_shd = shardings.replace(params=trained_shd)
  jitted = jax.jit(shard_activations(lora_step, mesh), donate_argnums=0,
                   in_shardings=(state_shd, frozen_shd, batch_shardings),
                   out_shardings=(state_shd, replicated), compiler_options=options)
  return LoraStep(jitted, shardings.train_only)


class LoraStep:
  """A LoRA train step: step(state, batch) -> (state, metrics) as make_train_step's plain
  step, built over `jitted(trained_state, frozen, batch)`, which donates only the trained
  part. `args(state, batch)` are the jitted program's arguments (for the memory plan and
  `jaxrl plan --compile`)."""

  def __init__(self, jitted, train_only: tuple[str, ...]):
    self.jitted, self.train_only = jitted, train_only

  def args(self, state: TrainState, batch):
    trained, frozen = split_trainable(state.params, self.train_only)
    return state.replace(params=trained), frozen, batch

  def __call__(self, state: TrainState, batch):
    trained_state, frozen, batch = self.args(state, batch)
    new, metrics = self.jitted(trained_state, frozen, batch)
    return new.replace(params=lora.combine(frozen, new.params)), metrics

  def lower(self, state: TrainState, batch):
    return self.jitted.lower(*self.args(state, batch))


def put_batch(batch: dict, sharding: NamedSharding) -> dict:
  """A process-local numpy batch -> global arrays sharded over the batch axes. Each process
  passes only its own rows (explicit host-to-device transfer, no gather)."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}



def start_from_hf(config, state: TrainState, mesh: Mesh, layout: str = "learner", *,
                  into: str | None = None) -> TrainState:
  """The state with the params of model.hf_path, when the config names one (the optimizer state
  of a fresh run is zeros either way, so only the params change). `into` names the sub-tree
  the decoder's params go to (a reward model's "backbone"); its other params keep their init,
  and checkpoint tensors it has no place for (an untied lm_head) are dropped. With LoRA the
  checkpoint fills the base and the adapters keep their init (B = 0: the HF model's function)."""
  if not (config.model.get("hf_path") or ""):
    return state
  cfg = config_lib.model_config(config)
  if cfg.lora_rank:
    _, _, params = load_hf(config.model.hf_path, mesh, layout, cfg=lora.base_config(cfg))
  else:
    _, _, params = params_from_config(config, mesh, layout)
  target = state.params if into is None else state.params[into]
  params = lora.combine(lora.as_base(cfg, params, target), lora.split_lora(target)[1])
  return state.replace(params=params if into is None else {**state.params, into: params})


def _laid_out(shapes, shardings):
  """Abstract params (ShapeDtypeStructs) of `shapes` in `shardings`: what restore_params reads
  a checkpoint into."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                      shardings)


def _abstract(tree):
  return _laid_out(tree, jax.tree.map(lambda x: x.sharding, tree))


def _saved_model_config(path: str) -> ModelConfig | None:
  """The ModelConfig of the run a checkpoint belongs to (its DIR/config.json); None when the
  directory records none."""
  run_dir = path.rstrip("/")
  if os.path.basename(run_dir) == "checkpoints":
    run_dir = os.path.dirname(run_dir)
  saved = rundir.read_config(run_dir) if os.path.isdir(run_dir) else None
  if not isinstance(saved, dict) or "model" not in saved:
    return None
  return config_lib.model_config(ml_collections.ConfigDict(saved))


def start_from_checkpoint(cfg: ModelConfig, state: TrainState, path: str, *,
                          into: str | None = None, layout: str = "learner") -> TrainState:
  """The state with init.checkpoint's params (a run directory, e.g. an SFT run) in place of
  its params (or of the sub-tree `into`, a reward model's backbone).

  With LoRA on here (cfg.lora_rank), the checkpoint fills the frozen base and this run's
  adapters keep their init (B = 0), so the run starts from the checkpoint's function. A
  checkpoint that has adapters of its own (a LoRA SFT run) is read with them and merged into
  the base (jaxrl.models.lora.merge_lora): the starting policy, and so the reference, is the
  model that run trained."""
  target = state.params if into is None else state.params[into]
  if not cfg.lora_rank:
    params = restore_params(path, _abstract(target))
  else:
    base, adapters = lora.split_lora(target)
    saved_cfg = _saved_model_config(path)
    mesh = jax.tree.leaves(base)[0].sharding.mesh

    def laid_out(c):  # the abstract params of a model of c, in this run's layout
      _, shapes, axes = abstract_model(c)
      return _laid_out(shapes, tree_shardings(shapes, axes, mesh, layout))
    # A quantised base (model.lora.quantize, here or in the saved run) has other leaves than
    # the plain one: the checkpoint is read in its own structure, merged, then quantised.
    quantised = cfg.lora_quantize or (saved_cfg is not None and saved_cfg.lora_quantize)
    if saved_cfg is None or not saved_cfg.lora_rank:
      plain = restore_params(path, laid_out(lora.base_config(cfg)) if quantised else
                             _abstract(base))
      merged = lora.as_base(cfg, plain, target)
    else:
      saved_base = lora.split_lora(laid_out(saved_cfg))[0] if quantised else _abstract(base)
      saved_adapters = lora.split_lora(laid_out(saved_cfg))[1]
      saved = restore_params(path, lora.combine(saved_base, saved_adapters))
      merged = jax.jit(lambda p: lora.as_base(cfg, lora.merge_lora(saved_cfg, p), base),
                       out_shardings=jax.tree.map(lambda x: x.sharding, base))(saved)
    params = lora.combine(merged, adapters)
  return state.replace(params=params if into is None else {**state.params, into: params})
