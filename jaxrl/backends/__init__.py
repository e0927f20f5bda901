"""Backends: what runs under jaxrl's two seams on each platform, and the record of what ran.

The model calls one attention function (jaxrl.models.attention), which takes a kernel from
here when a program is traced for a mesh; every learner and decode program compiles with the
options from `compiler_options`. Each asks the backend of the devices' platform:

  cpu     jaxrl.backends.cpu: C++ attention kernels, the dot-kernel choice, TCMalloc
  tpu     jaxrl.backends.tpu: splash attention for the learner (Pallas, Mosaic; opt-in), paged
          attention for the paged cache's decode step
  gpu     jaxrl.backends.gpu: flash attention for the learner (Pallas Triton; cuDNN opt-in),
          paged attention for the paged cache's decode step
  others  XLA's own attention and compile options

A backend is a package beside cpu/ and one branch in each function below; jaxrl.models.llama
does not change. The TPU and GPU kernels take the mask by structure (causal within segments,
jaxrl.models.attention.Causal), the CPU's as a dense array. describe() says what this process
chose, and every run records it (jaxrl.train.rundir).
"""

from __future__ import annotations

import glob
import os
import sys

# No jax and no backend module at the top: `import jaxrl` and the console script's allocator
# re-exec (jaxrl.__main__) read this package before jax loads; each function imports the
# backend it asks.


def platform_of(devices) -> str:
  """"cpu", "tpu" or "gpu" when every device is of that platform (a topology's abstract TPU
  devices count as "tpu"), else "other"."""
  kinds = {d.platform for d in devices}
  kinds = {"gpu" if k in ("gpu", "cuda", "rocm") else k for k in kinds}
  return kinds.pop() if len(kinds) == 1 and kinds <= {"cpu", "tpu", "gpu"} else "other"


def on_cpu(devices) -> bool:
  """Whether every device is a CPU device (the CPU backend's programs run there only)."""
  return all(d.platform == "cpu" for d in devices)


def attention_kernel(mesh, *, batch, kv_heads):
  """A kernel for the full-sequence attention of programs traced on `mesh`, whose rows are split
  over the `batch` mesh axes and KV heads over `kv_heads` (a layout's rules), or None: XLA's
  attention. The kernel is a differentiable function of (q [B, T, K, G, H], keys and values
  [B, K, S, H], mask [B, T, S]) that returns [B, T, K, G, H], or None for inputs it leaves to
  XLA. The kernel also takes `causal`, what the mask is made of (jaxrl.models.attention.Causal,
  or None), which the TPU and GPU kernels need."""
  platform = platform_of(mesh.devices.flat)
  if platform in ("cpu", "tpu", "gpu"):
    from jaxrl.backends import cpu, gpu, tpu
    backend = {"cpu": cpu, "tpu": tpu, "gpu": gpu}[platform]
    return backend.attention_kernel(mesh, batch=batch, kv_heads=kv_heads)
  return None


def decode_kernel(mesh, cache_spec):
  """A kernel for the decode step's attention to a KV cache laid out as `cache_spec` on `mesh`,
  or None: XLA's attention. The kernel is a function of (q [B, K, G, H], keys and values
  [B, K, S, H], positions [B]) that returns [B, K, G, H], or None for inputs it leaves to
  XLA."""
  if on_cpu(mesh.devices.flat):
    from jaxrl.backends import cpu
    return cpu.decode_kernel(mesh, cache_spec)
  return None


def joins_decode_weights(devices) -> bool:
  """Whether a decode step on `devices` computes q, k and v with one product against their
  weights joined (jaxrl.models.llama.Attention._fused_qkv), and the MLP's gate and up with
  another: on CPU only, where XLA's per-kernel cost made the joined products win (bench preset,
  batch 64: 7.2 -> 6.6 ms per step). Inside the decode scan XLA:TPU stacked gate and up again
  on every step (docs/guides/kernels.md has the figures). On TPU the q, k, v join is a copy of
  each layer's q, k and v weights into a new layout on every decode call (the k and v weights
  [D, K, H], tiled (2, 128) for K = 2 per chip, are re-tiled to join them): compiled for
  v5e:2x4, the compiler's own estimate (`estimated_cycles` of each op) of a one-step decode
  call's ops went from 2.97 to 1.61 ms without it (Qwen3-0.6B, batch 64) and from 13.2 to
  8.2 ms (Qwen3-8B). GPU has not been measured and takes one product per weight, as
  the full-sequence forward does."""
  return platform_of(devices) == "cpu"


def decode_on_matrix_unit(devices) -> bool:
  """Whether a decode step on `devices` moves two lane-bound steps to the matrix unit: the
  draw's block sums (jaxrl.sampler.sampling.sample_logits with mxu=True, which also skips a
  pass over the vocabulary) and the rotary embedding's half swap (a product with a permutation
  matrix, jaxrl.models.llama.rotate). Both exact up to the block sums' order of addition. On
  TPU only: compiled for v5e:2x4 (Qwen3-0.6B, batch 64, the compiler's estimate) the draw went
  from 207 to 104 us per step and the swap saved ~4 us per layer, its slices and concatenate
  fused into the projections' products; on CPU each product does ~100x the work it replaces,
  and GPU has not been measured."""
  return platform_of(devices) == "tpu"


def heads_major_projections(devices) -> bool:
  """Whether the sampler on `devices` stores each layer's q, k and v weights heads-major,
  [heads, H, D] (jaxrl.models.llama.heads_major_projections, made by Engine.decode_params once
  per weight sync). On TPU only: stored [D, heads, H], XLA:TPU copied them into a D-minor
  layout for the products on every decode step; compiled for v5e:2x4 (Qwen3-0.6B, batch 64,
  8 steps per call, the compiler's estimate) the step went from 1.77 to 1.63 ms. On CPU the
  [D, heads, H] form is what its dot kernels read best, and GPU has not been measured."""
  return platform_of(devices) == "tpu"


def writes_cache_per_head(devices) -> bool:
  """Whether a decode step writes its new keys and values into the dense cache [B, K, S, H] as
  one row of H per (slot, KV head), the KV heads a batching dimension of the scatter
  (jaxrl.models.llama._write_positions), rather than one [K, H] window per slot. On TPU only:
  for the [K, H] window XLA:TPU laid the cache out S-major ([B, S, K, H] in memory) and copied
  each layer's keys and values into attention's [B, K, S, H] on every step wherever a chip holds
  more than one KV head. Compiled for v5e:2x4 (Qwen3-0.6B, 64 slots, 4 KV heads per chip, a loop
  of 8 decode steps), XLA's count of one step went from 22.8 to 5.1 GB (27.8 to 6.2 ms at the
  HBM bandwidth; the floor, weights and cache read once, is 3.0 ms) and the temporaries from
  2.09 to 0.23 GB; Qwen3-8B and Llama-3.1-8B lose every cache-sized copy too. On CPU the [K, H]
  window is the measured form, and GPU has not been measured."""
  return platform_of(devices) == "tpu"


def paged_decode_kernel(mesh, cache_spec):
  """A kernel for the decode step's attention over a paged KV cache (jaxrl.sampler.paged) on
  `mesh`, for a sampler whose dense cache would be laid out as `cache_spec` [B, K, W, H] (slots
  over its first axes, KV heads over its second), or None: XLA's gather path. The kernel is a
  function of (q [B, K, G, H], key and value pools [K, N, P, H], page tables [B, n], positions
  [B]) that returns [B, K, G, H], or None for inputs it leaves to XLA. TPU: Pallas TPU paged
  attention; GPU: Pallas (Triton) paged attention; CPU and others: none (the gather path)."""
  platform = platform_of(mesh.devices.flat)
  if platform == "tpu":
    from jaxrl.backends import tpu
    return tpu.paged_decode_kernel(mesh, cache_spec)
  if platform == "gpu":
    from jaxrl.backends import gpu
    return gpu.paged_decode_kernel(mesh, cache_spec)
  return None


def compiler_options(devices, program: str = "learner") -> dict | None:
  """The `compiler_options` for a program on `devices`: "learner" (train steps, batched log-prob,
  reference and reward forwards) or "decode_one_slot" (the sampler's decode steps where each
  device holds one slot). None: XLA's defaults. `devices` may be a one-pass iterator (a mesh's
  `devices.flat`): it is read into a list first, since each check below walks it."""
  devices = list(devices)
  if on_cpu(devices):
    from jaxrl.backends import cpu
    return cpu.compiler_options(program)
  if all(d.platform == "tpu" for d in devices):
    from jaxrl.backends import tpu
    return tpu.compiler_options(program)
  return None


def tpu_here() -> bool:
  """Whether this machine has a TPU chip: a /dev/accel* or /dev/vfio device (how TPU VMs
  expose chips) or a PCI device of Google's vendor id (0x1ae0), read without loading libtpu."""
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return True
  for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(path) as f:
        if f.read().strip() == "0x1ae0":
          return True
    except OSError:
      pass
  return False


def accelerator_here() -> bool:
  """A TPU chip (tpu_here) or a GPU (NVIDIA's /dev/nvidiactl, AMD's /dev/kfd) on this
  machine."""
  return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd") or tpu_here()


def cpu_only_without_accelerators() -> None:
  """At `import jaxrl` (so in the console script too), before jax starts a backend: on a
  machine with neither a TPU nor a GPU, JAX_PLATFORMS=cpu. Otherwise jax loads libtpu (the
  test extra installs it for `jaxrl plan --compile`) only to find no chip, and libtpu printed
  three lines of errors before every command's and notebook's output. A JAX_PLATFORMS of the
  user's own is kept; --compile still loads libtpu for its topology."""
  if "JAX_PLATFORMS" in os.environ or accelerator_here():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  if "jax" in sys.modules:  # imported, but no backend started yet: the config read the env
    sys.modules["jax"].config.update("jax_platforms", "cpu")


def quiet_libtpu_off_tpu() -> None:
  """Before libtpu starts a compile-only client (abstract TPU devices for `jaxrl plan` and
  --compile) on a machine with no TPU: off a TPU VM its start-up looks for this host's slice
  in the cloud metadata and printed three lines of errors before every plan; naming one quiets
  it. Any valid type does: the devices are the topology's (v5p:4x4x4, v5e:16x16 and two
  v5e:4x4 slices give the same chips with or without these)."""
  if not tpu_here():
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")


def describe() -> dict:
  """What this process runs on: the platform, the allocator, the attention and the dot kernels,
  each with why. Every run dir's config.json and summary.json carry it under "backend"."""
  # Imported here, not above: `python -m jaxrl.backends.cpu.allocator` runs that module as
  # __main__, and Python warns when a parent package has imported it first.
  import jax
  from jaxrl.backends import cpu, gpu, tpu
  from jaxrl.backends.cpu import allocator  # noqa: PLC0415
  platform = jax.default_backend()
  # The device count too: `jaxrl compare` keeps runs on 1 and on 8 devices apart.
  out = {"platform": platform, "devices": jax.device_count(), "allocator": allocator.describe()}
  if platform == "cpu":
    return {**out, **cpu.describe()}
  if platform == "tpu":
    return {**out, **tpu.describe()}
  if platform in ("gpu", "cuda", "rocm"):
    return {**out, **gpu.describe()}
  return {**out, "attention": "xla", "dots": "xla"}
