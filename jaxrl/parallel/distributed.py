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

import itertools
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


# Host-side agreement. A decision every process must make alike (a stop request, process 0's
# newest weights version) goes through jax.distributed's coordination service, the key-value
# store the processes already share, never through a device program: a collective over devices
# that another thread's programs also use (async GRPO's producer on the sampler's devices, the
# learner on its own) would have to be launched in the same order on every process, and two
# threads give no such order. (On CPU even disjoint device sets are not enough: there async
# GRPO's two threads take turns, jaxrl/algorithms/grpo/producer.py "Taking turns".)
# How long a process waits for another's key: a backstop only (the coordination service ends the
# job when a process stops heartbeating), long enough for a first step's compiles on a pod.
HOST_AGREE_TIMEOUT_S = 24 * 3600
_KEEP_KEYS = 1024  # process 0's agreed values kept in the store (the others lag by one call)
_channels: dict[str, int] = {}  # name -> instances made in this process (the same everywhere)


def _channel(name: str):
  """(client, key prefix) of a new agreement channel. Every process makes its channels in the
  same order, so the n-th channel of a name has the same prefix everywhere."""
  from jax._src import distributed as jax_distributed  # the store's client: no public alias
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("host agreement across processes needs jax.distributed.initialize "
                       "(jaxrl.parallel.distributed.initialize) to have run first")
  _channels[name] = _channels.get(name, 0) + 1
  return client, f"jaxrl/{name}/{_channels[name]}"


def _get(client, key: str) -> str:
  try:
    return client.blocking_key_value_get(key, HOST_AGREE_TIMEOUT_S * 1000)
  except jax.errors.JaxRuntimeError as e:
    raise RuntimeError(f"process {jax.process_index()} waited {HOST_AGREE_TIMEOUT_S} s for "
                       f"another process's {key!r}: that process has stopped or hung; look "
                       "at its log") from e


def process_zero_value(name: str):
  """`agree(x) -> int`: process 0's integer x, the same on every process (process 0 writes
  it to the coordination service, the others read it). Every process must call it the same
  number of times, in the same order; it runs no device program, so any thread may call it
  (see "Host-side agreement" above). One process: x."""
  if jax.process_count() == 1:
    return int
  client, prefix = _channel(name)
  calls = itertools.count()

  def agree(x: int) -> int:
    n = next(calls)
    if jax.process_index() != 0:
      return int(_get(client, f"{prefix}/{n}"))
    client.key_value_set(f"{prefix}/{n}", str(int(x)))
    if n >= _KEEP_KEYS:
      client.key_value_delete(f"{prefix}/{n - _KEEP_KEYS}")
    return int(x)

  return agree


def any_process(name: str):
  """`any_(flag) -> bool`: whether any process's flag is set, the same answer on every
  process, through the coordination service (each writes its flag, then reads every one).
  Called the same number of times on every process; no device program. One process: flag."""
  if jax.process_count() == 1:
    return bool
  client, prefix = _channel(name)
  calls = itertools.count()
  me, count = jax.process_index(), jax.process_count()

  def any_(flag: bool) -> bool:
    n = next(calls)
    client.key_value_set(f"{prefix}/{n}/{me}", "1" if flag else "0")
    out = [_get(client, f"{prefix}/{n}/{i}") == "1" for i in range(count)]
    if n >= 2:  # every process read call n-2's keys before it wrote call n-1's, read here
      client.key_value_delete(f"{prefix}/{n - 2}/{me}")
    return any(out)

  return any_
