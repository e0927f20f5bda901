"""jaxrl's TPU backend: splash attention (attention.py) for the learner's full-sequence
attention, forward and gradient. jaxrl.backends asks it on TPU devices only (real chips, or a
topology's abstract devices when `jaxrl plan --compile` compiles for one on a CPU machine).

  JAXRL_TPU_ATTENTION=splash|xla   the learner's attention (default: xla)
  JAXRL_TPU_PAGED=pallas|xla       the paged KV cache's decode attention (default: pallas, the
                                   Pallas TPU paged attention kernel, paged.py; xla: the
                                   gather path)
  JAXRL_TPU_COLLECTIVE_MATMUL=off|on
                                   XLA's windowed einsum (collective matmul) for the FSDP
                                   all-gathers of learner programs (default: off, see
                                   compiler_options)

Splash is opt-in until it has been timed on a TPU and the memory plan is recalibrated for it:
compiled for a v5e-8, Qwen3-0.6B's GRPO train step held 10.77 GiB per chip with splash
against 10.65 with XLA's attention (whose TPU compiler already fuses the masked softmax into
online-softmax calls), and the plan, within 15% of the XLA-attention step, came out 34% under
the splash one (docs/guides/kernels.md). Decoding over the dense cache keeps XLA's attention
on TPU; over the paged cache (rollout.kv_cache=paged) it runs the paged attention kernel.
"""

from __future__ import annotations

import functools
import os

from jaxrl.backends.sharded import per_device, per_device_paged
from jaxrl.backends.tpu import paged
from jaxrl.backends.tpu.attention import splash_attention, takes
from jaxrl.errors import check_choice

ENV = "JAXRL_TPU_ATTENTION"
CHOICES = ("splash", "xla")
COLLECTIVE_MATMUL_ENV = "JAXRL_TPU_COLLECTIVE_MATMUL"
PAGED_ENV = "JAXRL_TPU_PAGED"


def paged_choice() -> str:
  """The paged cache's decode attention JAXRL_TPU_PAGED names (default pallas)."""
  return check_choice(PAGED_ENV, os.environ.get(PAGED_ENV, "pallas").strip().lower(),
                      ("pallas", "xla"))


def paged_decode_kernel(mesh, cache_spec, *, interpret: bool = False):
  """The Pallas TPU paged attention kernel for the paged cache's decode step on `mesh` (slots
  and KV heads laid out as the sampler's dense `cache_spec` would be), per device under
  shard_map; None with JAXRL_TPU_PAGED=xla. The kernel returns None (XLA's gather path) for
  calls paged.takes refuses (head_dim not a multiple of 128) and where the mesh's axes do not
  divide the slots or KV heads. interpret: Pallas's TPU interpreter (tests on CPU devices)."""
  if paged_choice() == "xla":
    return None
  return per_device_paged(functools.partial(paged.paged_decode, interpret=interpret), mesh,
                          cache_spec, takes=lambda q, keys: paged.takes(q.shape[-1], q.dtype))


def choice() -> str:
  """The learner attention JAXRL_TPU_ATTENTION names (default xla: see the module doc)."""
  value = os.environ.get(ENV, "xla").strip().lower()
  return check_choice(ENV, value, CHOICES)


def attention_kernel(mesh, *, batch, kv_heads, interpret: bool = False):
  """Splash attention for the full-sequence calls of programs on `mesh` (rows over the `batch`
  mesh axes, KV heads over `kv_heads`), per device under shard_map, with
  JAXRL_TPU_ATTENTION=splash; else None. The kernel returns None (XLA's attention) for a call
  whose mask the model gives only as an array (jaxrl.models.attention.Causal is None: the
  cached forwards), under one kv block of keys (attention.takes), and where the mesh's axes
  do not divide the rows or KV heads. interpret: run the kernel in Pallas's interpreter
  (tests on CPU devices)."""
  if choice() == "xla":
    return None
  run = per_device(functools.partial(splash_attention, interpret=interpret), mesh,
                   batch=batch, kv_heads=kv_heads)

  def kernel(q_btkgh, keys_bksh, values_bksh, mask_bts, causal=None):
    del mask_bts  # the same mask, by structure in `causal`
    if causal is None or not takes(q_btkgh.shape[1], keys_bksh.shape[2]):
      return None
    return run(q_btkgh, keys_bksh, values_bksh, causal.q_segment_ids, causal.kv_segment_ids)

  return kernel


def collective_matmul() -> str:
  """Whether learner programs let XLA decompose FSDP all-gathers into windowed einsums
  (JAXRL_TPU_COLLECTIVE_MATMUL, default off: see compiler_options)."""
  value = os.environ.get(COLLECTIVE_MATMUL_ENV, "off").strip().lower()
  return check_choice(COLLECTIVE_MATMUL_ENV, value, ("off", "on"))


def compiler_options(program: str) -> dict | None:
  """libtpu options for a learner program: the windowed einsum for all-gathers off.

  Why: XLA:TPU rewrites each FSDP-gathered weight's matmul into a loop of collective permutes
  (a collective matmul) whose output buffer it allocates with an operand-free AllocateBuffer
  call, and its scheduler placed those allocations early: compiled for v5e:2x4, Qwen3-0.6B's
  SFT step (8 x 2,048 rows per chip, remat full) held every layer's recomputed MLP and
  q/k/v outputs from the end of the forward to that layer's backward, 0.31 GiB per layer
  where remat saves 32 MiB, and the step grew from 5.41 GiB of temporaries at 2 layers to
  6.66 at 6. With the windowed einsum off it held 5.18 GiB at 6 layers (docs/guides/scale.md
  has the figures). The plain all-gather it falls back to is still asynchronous and overlapped
  by XLA's latency-hiding scheduler; what the collective matmul would save in time has not been
  measured on a TPU, so JAXRL_TPU_COLLECTIVE_MATMUL=on brings it back.

  The same for the backward's reduce-scatters of FSDP gradients: on v6e (where libtpu turns
  that windowed einsum on) the same SFT step held 0.63 GiB more per layer than on v5e (4.44 GiB
  at 2 layers, 6.96 at 6); with it off too, 4.22 at 6 layers (docs/guides/scale.md)."""
  if program == "learner" and collective_matmul() == "off":
    return {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
            "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}
  return None


def describe() -> dict[str, str]:
  """The attention and dot kernels this process runs on TPU, for run records."""
  attention = ("splash (pallas tpu) for the learner's causal full-sequence attention; xla for "
               "dense-cache decoding and cached forwards" if choice() == "splash" else
               f"xla ({ENV}=xla)")
  attention += ("; pallas tpu paged attention for paged-cache decoding (head_dim % 128 == 0)"
                if paged_choice() == "pallas" else f"; xla paged gather ({PAGED_ENV}=xla)")
  return {"attention": attention, "dots": "xla",
          "collective_matmul": f"{collective_matmul()} ({COLLECTIVE_MATMUL_ENV})"}
