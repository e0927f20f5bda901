"""The learner's XLA:CPU dot-kernel choice (jaxrl/backends/cpu/dots.py)."""

import types

import numpy as np
import pytest

from jaxrl import backends
from jaxrl.backends.cpu import dots
from jaxrl.config import base_config, model_config
from jaxrl.errors import ConfigError
from jaxrl.models import apply, token_logprobs
from jaxrl.parallel import batch_sharding, make_mesh
from jaxrl.train import init_train_state, make_optimizer, make_train_step, optim_section

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})


def test_auto_uses_eigen_dots_on_x86_without_avx512_only(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  assert dots.choose("auto", machine="x86_64", flags=AVX2) == "eigen"
  assert dots.choose("auto", machine="x86_64", flags=AVX2 | {"avx512f"}) == "ynnpack"
  assert dots.choose("auto", machine="aarch64", flags=frozenset({"asimd"})) == "ynnpack"
  # No /proc/cpuinfo to read: keep XLA's default.
  assert dots.choose("auto", machine="x86_64", flags=frozenset()) == "ynnpack"
  assert dots.choose(" Eigen ", machine="x86_64", flags=AVX2 | {"avx512f"}) == "eigen"
  assert dots.choose("ynnpack", machine="x86_64", flags=AVX2) == "ynnpack"
  # XLA capped below AVX-512 (make test-isa's emulated AVX2 machine): auto chooses as there.
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=8")
  assert dots.choose("auto", machine="x86_64", flags=AVX2 | {"avx512f"}) == "eigen"
  assert dots.choose("ynnpack", machine="x86_64", flags=AVX2 | {"avx512f"}) == "ynnpack"
  assert not dots.below_avx512("--xla_cpu_max_isa=AVX512")


def test_a_bad_setting_names_the_variable(monkeypatch):
  monkeypatch.setenv(dots.ENV, "mkl")
  with pytest.raises(ConfigError, match=r"JAXRL_CPU_DOTS='mkl' is not valid: choose one of "
                                        r"ynnpack, eigen, auto"):
    backends.compiler_options([types.SimpleNamespace(platform="cpu")])


def test_the_default_is_auto(monkeypatch):
  monkeypatch.delenv(dots.ENV, raising=False)
  monkeypatch.setenv("XLA_FLAGS", "")
  assert dots.choose(machine="x86_64", flags=AVX2) == "eigen"
  assert dots.choose(machine="x86_64", flags=AVX2 | {"avx512f"}) == "ynnpack"


def test_options_apply_to_cpu_devices_only(monkeypatch):
  monkeypatch.setenv(dots.ENV, "eigen")
  cpu, gpu = types.SimpleNamespace(platform="cpu"), types.SimpleNamespace(platform="gpu")
  assert backends.compiler_options([cpu, cpu]) == dots.EIGEN_DOTS
  assert backends.compiler_options([gpu]) is None
  assert backends.on_cpu([cpu, cpu]) and not backends.on_cpu([cpu, gpu])
  monkeypatch.setenv(dots.ENV, "ynnpack")
  assert backends.compiler_options([cpu]) is None
  # The sampler's one-slot decode steps take Eigen dots whatever the learner's choice.
  assert backends.compiler_options([cpu], "decode_one_slot") == dots.EIGEN_DOTS
  assert backends.compiler_options([gpu], "decode_one_slot") is None


def _loss_fn(graphdef):
  def loss_fn(params, batch, key):
    logits, _ = apply(graphdef, params, batch["inputs"])
    logp, _ = token_logprobs(logits, batch["targets"])
    return -logp.sum(), (np.float32(logp.size), {})
  return loss_fn


@pytest.mark.parametrize("setting,ynn", [("eigen", False), ("ynnpack", True)])
def test_the_train_step_compiles_with_the_chosen_kernels(devices, monkeypatch, setting, ynn):
  monkeypatch.setenv(dots.ENV, setting)
  cfg = model_config(base_config())
  mesh = make_mesh()
  tx, schedule = make_optimizer(optim_section(lr=1e-3, warmup_steps=2), 10)
  graphdef, state, shardings = init_train_state(cfg, mesh, tx, seed=0)
  shd = batch_sharding(mesh, 2)
  step = make_train_step(_loss_fn(graphdef), tx, schedule, shardings, shd, mesh=mesh)
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(3, 200, (16, 12)).astype(np.int32) for k in ("inputs", "targets")}
  hlo = step.lower(state, batch).compile().as_text()
  assert ("__ynn_fusion" in hlo) == ynn
  if not ynn:  # the products are still there, as XLA's own dots
    assert " dot(" in hlo or "dot_general" in hlo
