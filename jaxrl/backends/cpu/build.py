"""Builds and loads the library that holds jaxrl's CPU attention kernels (csrc/: the sampler's
decode step, decode_attention.cc; the learner's full-sequence attention and its gradient,
learner_attention.cc) and registers them with XLA for CPU.

It is built on first use with the machine's C++ compiler ($CXX, else g++), against the FFI
headers that ship with jaxlib, for this CPU (-march=native), and cached by source, jaxlib
version and CPU under $JAXRL_KERNEL_CACHE (default ~/.cache/jaxrl/kernels). Where there is no
compiler or the build fails, decoding and the learner keep XLA's attention and one line says
why. JAXRL_CPU_KERNELS=0 keeps XLA's attention too.
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

ENV = "JAXRL_CPU_KERNELS"
CACHE_ENV = "JAXRL_KERNEL_CACHE"
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = tuple(os.path.join(CSRC, f) for f in ("decode_attention.cc", "learner_attention.cc"))
HEADERS = (os.path.join(CSRC, "cpu_simd.h"),)
TARGETS = {"jaxrl_decode_attention": "JaxrlDecodeAttention",
           "jaxrl_learner_attention": "JaxrlLearnerAttention",
           "jaxrl_learner_attention_grad": "JaxrlLearnerAttentionGrad"}
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-std=c++17",
         "-shared", "-fPIC", "-w")


def enabled() -> bool:
  """Whether $JAXRL_CPU_KERNELS allows the kernels ("0", "false" or "off" keep XLA's path)."""
  return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def _cache_dir() -> str:
  d = os.environ.get(CACHE_ENV) or os.path.join(
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
  cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), "-I", CSRC, *SOURCES, "-o", tmp]
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
def library() -> tuple[str | None, str]:
  """(the library's path, "") once the kernels are built and registered with XLA for CPU, or
  (None, why not). At most one build per process; a failure prints one line to stderr and
  leaves XLA's attention in place. The reason is kept for the run's record
  (jaxrl.backends.describe)."""
  if not enabled():
    return None, f"{ENV}={os.environ.get(ENV)}"
  try:
    path = build()
    lib = ctypes.cdll.LoadLibrary(path)
    for target, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                  platform="cpu")
  except (RuntimeError, OSError, subprocess.SubprocessError) as e:
    print(f"jaxrl: the CPU attention kernels are unavailable, so decoding and the learner use "
          f"XLA's attention (slower on CPU): {e}", file=sys.stderr)
    return None, str(e)
  return path, ""


def available() -> bool:
  """Whether the kernels are built and registered (see library)."""
  return library()[0] is not None
