"""Train state (one pytree, born sharded) and the one jitted train step every trainer uses.

A trainer supplies only a loss:

    loss_fn(params, batch, key) -> (loss_sum, (weight, metric_sums))

The loss is reported as sum(loss_sum) / sum(weight) over the whole global batch, and gradients
are normalised the same way, so splitting a batch into micro-batches (`accum_steps`) changes
nothing but memory: SFT passes token sums and token counts (a token-level mean, as TRL does),
a pairwise loss passes per-pair sums and the pair count. `metric_sums` are divided by the same
weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.backends import compiler_options
from jaxrl.io.hf import params_from_config
from jaxrl.models import ModelConfig, Transformer, abstract_model
from jaxrl.parallel import shard_activations, tree_shardings


@flax.struct.dataclass
class TrainState:
  params: Any     # nested dict of arrays, learner layout
  opt_state: Any  # optax state; param-shaped leaves share the params' shardings
  step: jax.Array  # int32 [], optimizer updates done
  rng: jax.Array   # uint32 key data; raw data, so orbax saves it like any array

  def step_key(self) -> jax.Array:
    """This step's key: fold_in(key, step), so no key is reused and resuming replays exactly."""
    return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)


def state_shardings(abstract: TrainState, param_shd, tx, mesh: Mesh) -> TrainState:
  """Shardings of a TrainState: optimizer moments follow their parameters; counters and the
  key are replicated."""
  replicated = NamedSharding(mesh, P())
  opt_shd = optax.tree_map_params(tx, lambda _, s: s, abstract.opt_state, param_shd,
                                  transform_non_params=lambda _: replicated)
  return TrainState(params=param_shd, opt_state=opt_shd, step=replicated, rng=replicated)


def init_train_state(cfg: ModelConfig, mesh: Mesh, tx, *, seed: int, layout: str = "learner",
                     model=None):
  """(graphdef, state, shardings): the state is born sharded (eval_shape, then a jitted init
  with out_shardings), so no device ever holds a full unsharded copy. `model` is the module
  class to train, built as model(cfg, rngs=...): the Transformer (a policy) by default, whose
  parameters then equal jaxrl.parallel.init_params(cfg, mesh, seed=seed); RewardModel for a
  reward model."""
  build = Transformer if model is None else model
  graphdef, shapes, axes = abstract_model(cfg, build)
  param_shd = tree_shardings(shapes, axes, mesh, layout)

  def init(key):
    params = nnx.to_pure_dict(nnx.state(build(cfg, rngs=nnx.Rngs(params=key))))
    rng = jax.random.key_data(jax.random.fold_in(key, 1))  # a stream apart from the init's
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32),
                      rng=rng)

  key = jax.random.key(seed)
  abstract = jax.eval_shape(init, key)
  shardings = state_shardings(abstract, param_shd, tx, mesh)
  state = jax.jit(init, out_shardings=shardings)(key)
  return graphdef, state, shardings


def make_train_step(loss_fn: Callable, tx, schedule, shardings: TrainState, batch_shardings, *,
                    mesh: Mesh, accum_steps: int = 1):
  """One jit: forward, backward, clip, update. The state is donated (updated in place) and
  every output has an explicit sharding, so the layout never drifts between steps.

  Returns step(state, batch) -> (state, metrics) with metrics `loss`, `grad_norm`, `lr` (the
  rate this update used) and the loss's own metrics, as replicated scalars.
  """
  replicated = NamedSharding(mesh, P())

  def grads_and_sums(params, batch, key):
    (loss_sum, (weight, sums)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch, key)
    return grads, loss_sum, weight, sums

  def step_fn(state: TrainState, batch):
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
    new = TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=state.rng)
    return new, metrics

  return jax.jit(shard_activations(step_fn, mesh), donate_argnums=0,
                 in_shardings=(shardings, batch_shardings),
                 out_shardings=(shardings, replicated),
                 compiler_options=compiler_options(mesh.devices.flat))


def put_batch(batch: dict, sharding: NamedSharding) -> dict:
  """A process-local numpy batch -> global arrays sharded over the batch axes. Each process
  passes only its own rows (explicit host-to-device transfer, no gather)."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}



def start_from_hf(config, state: TrainState, mesh: Mesh, layout: str = "learner", *,
                  into: str | None = None) -> TrainState:
  """The state with the params of model.hf_path, when the config names one (the optimizer state
  of a fresh run is zeros either way, so only the params change). `into` names the sub-tree
  the decoder's params go to (a reward model's "backbone"); its other params keep their init,
  and checkpoint tensors it has no place for (an untied lm_head) are dropped."""
  if not (config.model.get("hf_path") or ""):
    return state
  _, _, params = params_from_config(config, mesh, layout)
  if into is None:
    return state.replace(params=params)
  target = state.params[into]
  return state.replace(params={**state.params, into: {k: params[k] for k in target}})
