"""placement.ref_dtype: the frozen reference stored in bfloat16 beside fp32 master weights gives
the same log-probs where the compute dtype is bfloat16, at half the reference's bytes, and the
plan counts it so."""

import os

import jax
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.models import get_preset
from jaxrl.parallel import make_mesh
from jaxrl.parallel import compile as aot
from jaxrl.parallel.plan import estimate
from jaxrl.algorithms import grpo
from jaxrl.algorithms.grpo.trainer import reference_copy
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.train.state import init_train_state

BF16_COMPUTE = ["model.dtype=bfloat16", "model.param_dtype=float32"]


def _config(repo_root, *overrides):
  return config_lib.load_config(os.path.join(repo_root, "configs/grpo_tiny.py"),
                                list(overrides), grpo.CHOICES)


def test_a_bfloat16_reference_gives_the_same_logprobs(devices):
  """fp32 master weights, bf16 compute: every forward casts each weight to bf16 first, so the
  reference stored in bf16 gives bit-identical log-probs and entropies, on the same shardings,
  at half the bytes."""
  cfg = get_preset("tiny").replace(dtype="bfloat16", param_dtype="float32")
  mesh = make_mesh()
  tx, _ = make_optimizer(optim_section(lr=1e-3), 10)
  graphdef, state, _ = init_train_state(cfg, mesh, tx, seed=0)
  ref32, ref16 = reference_copy(state.params, ""), reference_copy(state.params, "bfloat16")
  assert {x.dtype for x in jax.tree.leaves(ref16)} == {np.dtype("bfloat16")}
  for a, b in zip(jax.tree.leaves(ref32), jax.tree.leaves(ref16)):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim) and a.nbytes == 2 * b.nbytes
  rng = np.random.default_rng(0)
  seq = rng.integers(3, cfg.vocab_size, size=(8, 17)).astype(np.int32)
  pos = np.broadcast_to(np.arange(16, dtype=np.int32), (8, 16)).copy()
  logprobs = grpo.make_logprobs_fn(graphdef, 1.0)
  lp32, ent32 = logprobs(ref32, seq[:, :-1], seq[:, 1:], pos)
  lp16, ent16 = logprobs(ref16, seq[:, :-1], seq[:, 1:], pos)
  np.testing.assert_array_equal(np.asarray(lp16), np.asarray(lp32))
  np.testing.assert_array_equal(np.asarray(ent16), np.asarray(ent32))
  # The same reference in fp32 compute would differ (the check can fail): bf16 storage is exact
  # only because the forward rounds every weight to bf16 anyway.
  g32 = grpo.make_logprobs_fn(init_train_state(cfg.replace(dtype="float32"), mesh, tx,
                                               seed=0)[0], 1.0)
  assert not np.array_equal(np.asarray(g32(ref16, seq[:, :-1], seq[:, 1:], pos)[0]),
                            np.asarray(g32(ref32, seq[:, :-1], seq[:, 1:], pos)[0]))


def test_the_plan_counts_a_bfloat16_reference_at_half_its_bytes(repo_root, devices):
  """The reference's bytes resident beside the train step halve, and its log-prob forward
  (the reference alone runs it: old log-probs from the update) takes the bf16 params as its
  argument, as XLA counts it too; the run's peak falls by what XLA's falls (CPU).
  Not asserted: the plan's peak against XLA:CPU's with bf16 compute, which follows the host's
  ISA (within 15% on the AVX-512 CPUs; 28% under with either reference on an AVX2-only AMD Zen
  2, where XLA keeps fp32 twins of the bf16 temporaries, 2026-12-06). The plan is for TPU: at
  Qwen3-0.6B's size compiled for v5e-8 the forward is 7.24 GiB planned against 7.11 compiled
  (docs/guides/scale.md), and tests/test_plan.py checks fp32 runs against XLA:CPU."""
  _, fp32 = grpo.programs(_config(repo_root, *BF16_COMPUTE))
  _, bf16 = grpo.programs(_config(repo_root, *BF16_COMPUTE, "placement.ref_dtype=bfloat16"))
  ref32 = fp32[0].resident["reference params"]
  assert bf16[0].resident["reference params"] == ref32 // 2
  assert {x.dtype for x in jax.tree.leaves(bf16[1].args[0])} == {np.dtype("bfloat16")}
  e32, e16 = estimate(fp32[1]), estimate(bf16[1])
  assert e32.argument - e16.argument == ref32 // 2
  peaks = []
  for programs in (fp32, bf16):
    compiled = [aot.compile_program(p) for p in programs]
    peaks.append(aot.run_peaks(programs, [estimate(p) for p in programs], compiled))
  assert compiled[1].argument == e16.argument
  (plan32, xla32), (plan16, xla16) = peaks
  assert xla16 < xla32 and plan32 - plan16 == pytest.approx(xla32 - xla16, rel=0.15), peaks


def test_a_bfloat16_reference_with_lora_is_refused_in_one_sentence(repo_root, devices):
  config = _config(repo_root, "model.lora.rank=4", "placement.ref_dtype=bfloat16")
  with pytest.raises(ConfigError, match=r"placement.ref_dtype='bfloat16' .* with LoRA the "
                                        r"reference is the policy's own frozen base"):
    grpo.programs(config)
  with pytest.raises(ConfigError, match="placement.ref_dtype"):
    _config(repo_root, "placement.ref_dtype=float16")
