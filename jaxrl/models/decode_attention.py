"""The sampler's decode-step attention on CPU as one C++ kernel (decode_attention.cc), called
through XLA's FFI, in place of XLA:CPU's two batched products and masked softmax.

A batch-64 decode step of the bench preset spends about a quarter of its time in attention:
per layer and (slot, KV head), a 2 x 64 x S product for the logits, a masked softmax over
[B, K, G, S], and a 2 x S x 64 product for the values, each its own kernel at ~15 GFLOP/s. The
kernel reads each cached key and value row once, only up to the slot's position, and shares the
(slot, KV head) pairs with XLA's intra-op threads. Its result equals the XLA path's to float
rounding (tests/test_decode_attention.py); the figures are in the README's Benchmarks.

This module also builds and loads the library that holds it and the learner's attention
kernels (learner_attention.cc, jaxrl.models.learner_attention). It is built on first use with
the machine's C++ compiler ($CXX, else g++), against the FFI headers that ship with jaxlib, for
this CPU (-march=native), and cached by source, jaxlib version and CPU under
$JAXRL_KERNEL_CACHE (default ~/.cache/jaxrl/kernels). Where there is no compiler or the build
fails, decoding and the learner keep XLA's attention and one line says why.
JAXRL_CPU_KERNELS=0 keeps XLA's attention too. Nothing changes off CPU, or for dtypes other
than float32.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl.parallel.cpu_kernels import on_cpu

ENV = "JAXRL_CPU_KERNELS"
TARGET = "jaxrl_decode_attention"
HERE = os.path.dirname(os.path.abspath(__file__))
# One library holds jaxrl's CPU attention kernels: this decode step's and the learner's
# full-sequence attention and its gradient (jaxrl.models.learner_attention).
SOURCES = tuple(os.path.join(HERE, f) for f in ("decode_attention.cc", "learner_attention.cc"))
HEADERS = (os.path.join(HERE, "cpu_simd.h"),)
TARGETS = {"jaxrl_decode_attention": "JaxrlDecodeAttention",
           "jaxrl_learner_attention": "JaxrlLearnerAttention",
           "jaxrl_learner_attention_grad": "JaxrlLearnerAttentionGrad"}
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-std=c++17",
         "-shared", "-fPIC", "-w")


def enabled() -> bool:
  """Whether $JAXRL_CPU_KERNELS allows the kernel ("0", "false" or "off" keep XLA's path)."""
  return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _cache_dir() -> str:
  d = os.environ.get("JAXRL_KERNEL_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxrl", "kernels")
  try:
    os.makedirs(d, exist_ok=True)
    if os.access(d, os.W_OK):
      return d
  except OSError:
    pass
  d = os.path.join(tempfile.gettempdir(), f"jaxrl-kernels-{os.getuid()}")
  os.makedirs(d, exist_ok=True)
  return d


def _cpu_id() -> str:
  """What -march=native depends on: the CPU's model and feature flags."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = [l for l in f if l.startswith(("model name", "flags", "Features", "CPU part"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor() or platform.machine()


def build() -> str:
  """The kernels' shared library for this machine, compiled now unless the cache has it.
  Raises RuntimeError with the compiler's message when it cannot be built."""
  cxx = os.environ.get("CXX", "g++")
  sources = []
  for path in SOURCES + HEADERS:
    with open(path, "rb") as f:
      sources.append(f.read())
  import jaxlib  # noqa: PLC0415 (only for its version)
  key = hashlib.sha256(b"\0".join([*sources, jaxlib.__version__.encode(), cxx.encode(),
                                   " ".join(FLAGS).encode(), _cpu_id().encode()]))
  out = os.path.join(_cache_dir(), f"attention-{key.hexdigest()[:16]}.so")
  if os.path.exists(out):
    return out
  if shutil.which(cxx) is None:
    raise RuntimeError(f"no C++ compiler {cxx!r} on PATH (set CXX to one)")
  # Compiled to a private name, then renamed: processes building at once each get a whole file.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
  os.close(fd)
  cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), "-I", HERE, *SOURCES, "-o", tmp]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)
  return out


@functools.cache
def available() -> bool:
  """Whether the kernels are built and registered with XLA for CPU (at most one build per
  process; a failure prints one line to stderr and leaves XLA's attention in place)."""
  if not enabled():
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(build())
    for target, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
  except (RuntimeError, OSError, subprocess.SubprocessError) as e:
    print(f"jaxrl: the CPU attention kernels are unavailable, so decoding and the learner use "
          f"XLA's attention (slower on CPU): {e}", file=sys.stderr)
    return False
  return True


def kernel(q_bkgh, keys_bksh, values_bksh, pos_b):
  """Attention of slot b's queries q_bkgh[b] to its cached positions 0..pos_b[b]: [B, K, G, H]
  float32. Runs on the devices' own shards; see for_mesh for a sharded cache."""
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q_bkgh.shape, jnp.float32),
                          vmap_method="sequential")(
                              q_bkgh, keys_bksh, values_bksh, pos_b.astype(jnp.int32))


def supports(cfg) -> bool:
  """Whether the kernel handles this model config's decoding (float32 compute, head_dim a
  multiple of 8 up to 256)."""
  return (jnp.dtype(cfg.dtype) == jnp.float32 and cfg.head_dim % 8 == 0
          and cfg.head_dim <= 256)


def for_mesh(mesh, cache_spec: P):
  """The kernel as a function of (q [B, K, G, H], keys, values [B, K, S, H], pos [B]) for a
  cache laid out as `cache_spec` on `mesh`, or None where XLA's attention stays: off CPU, with
  JAXRL_CPU_KERNELS=0, or when it could not be built. On a mesh of several devices each device
  runs it on its own slots and KV heads (shard_map), with no communication."""
  if not on_cpu(mesh.devices.flat) or not available():
    return None
  if mesh.devices.size == 1:
    return kernel
  b, k = (tuple(cache_spec) + (None, None))[:2]
  spec4 = P(b, k, None, None)
  return jax.shard_map(kernel, mesh=mesh, in_specs=(spec4, spec4, spec4, P(b)),
                       out_specs=spec4, check_vma=False)
