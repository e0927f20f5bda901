"""Multi-host start-up: jax.distributed.initialize when the environment or config asks for it.

Every process runs the same program (JAX's multi-controller runtime). It must run before
anything touches a device, so commands call it first.

    distributed.coordinator_address  "host:port" of process 0 ("" = not set)
    distributed.num_processes        0 = not set
    distributed.process_id           -1 = not set
    distributed.auto                 True: let JAX detect the cluster (TPU pods, SLURM, ...)

With none of these set, the environment still asks when JAX_COORDINATOR_ADDRESS is set, or on a
TPU pod slice (TPU_WORKER_HOSTNAMES names more than one worker, or MEGASCALE_COORDINATOR_ADDRESS
is set), or when JAXRL_DISTRIBUTED=auto (tpu/run.sh sets it on slices of more than one worker,
where the TPU VM's ssh environment names no peers); then JAX reads the rest from the
environment or the TPU metadata.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxrl.errors import ConfigError


def distributed_section():
  import ml_collections
  return ml_collections.ConfigDict(dict(coordinator_address="", num_processes=0, process_id=-1,
                                        auto=False))


def environment_asks() -> bool:
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return bool(os.environ.get("JAX_COORDINATOR_ADDRESS") or "," in hosts
              or os.environ.get("JAXRL_DISTRIBUTED") == "auto"
              or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def maybe_initialize(section=None) -> bool:
  """Initializes the multi-controller runtime if asked; returns whether it did."""
  if jax.distributed.is_initialized():
    return True
  s = section if section is not None else distributed_section()
  explicit = bool(s.coordinator_address) or s.num_processes > 0 or s.process_id >= 0
  if not (explicit or s.auto or environment_asks()):
    return False
  kwargs = {}
  if explicit:
    missing = [k for k, bad in (("coordinator_address", not s.coordinator_address),
                                ("num_processes", s.num_processes <= 0),
                                ("process_id", s.process_id < 0)) if bad]
    if missing:
      raise ConfigError(f"distributed.{missing[0]} is not set: multi-host runs given "
                        "explicitly need distributed.coordinator_address, num_processes and "
                        "process_id together (or distributed.auto=true on a TPU pod).")
    if not 0 <= s.process_id < s.num_processes:
      raise ConfigError(f"distributed.process_id={s.process_id} is outside 0.."
                        f"{s.num_processes - 1}: give each process its own id below "
                        "distributed.num_processes.")
    kwargs = dict(coordinator_address=s.coordinator_address, num_processes=s.num_processes,
                  process_id=s.process_id)
  # CPU processes need a collectives backend to form one mesh; accelerators ignore this.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**kwargs)
  return True


def to_host(tree):
  """The numpy value of every jax.Array in `tree`, the same on every process.

  One process: `jax.device_get`. On a multi-process mesh an array whose shards live on other
  processes' devices (a sampler's per-slot outputs, a learner's per-row logprobs) cannot be
  fetched that way; it is all-gathered across processes instead, so that every process sees the
  whole value and makes the same host-side decisions (which slots to refill, the rewards, the
  advantages), as the multi-controller runtime needs. Replicated arrays are read locally."""
  if jax.process_count() == 1:
    return jax.device_get(tree)

  def get(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(get, tree)


def global_array(x, sharding):
  """A global array from data every process holds in full (each takes its own shards)."""
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def process_zero_value(mesh):
  """`agree(x) -> int`: process 0's integer x, the same on every process, by one collective
  over `mesh`'s devices only (each process fills its own shards; process 0's value wins). A
  thread that runs programs on those devices alone (async GRPO's producer, on the sampler's)
  can call it without ordering against another thread's programs on other devices, which
  `multihost_utils.broadcast_one_to_all` (over every device) would need."""
  devices = mesh.devices.reshape(-1)
  flat = jax.sharding.Mesh(devices, ("all",))
  sharded = jax.sharding.NamedSharding(flat, jax.sharding.PartitionSpec("all"))
  reduce = jax.jit(lambda a: a.max(), out_shardings=jax.sharding.NamedSharding(
      flat, jax.sharding.PartitionSpec()))

  def agree(x: int) -> int:
    mine = np.int32(x if jax.process_index() == 0 else np.iinfo(np.int32).min)
    shards = jax.make_array_from_callback((len(devices),), sharded,
                                          lambda idx: np.full((1,), mine, np.int32))
    return int(reduce(shards))

  return agree
