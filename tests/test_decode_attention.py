"""The CPU decode-attention kernel (jaxrl/backends/cpu/csrc/decode_attention.cc) against XLA's
attention, alone, sharded over the fake devices, and inside the sampler's decode step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.backends.cpu import attention as cpu_attention
from jaxrl.backends.cpu import build
from jaxrl.models import attention, get_preset
from jaxrl.models.attention import xla_decode_attention
from jaxrl.parallel import init_params, make_mesh
from jaxrl.sampler import Engine, SamplingParams, generate


def _inputs(B, K, G, S, H, pos, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, K, G, H), np.float32)
  keys = rng.standard_normal((B, K, S, H), np.float32)
  values = rng.standard_normal((B, K, S, H), np.float32)
  return q, keys, values, np.asarray(pos, np.int32)


def test_kernel_builds_on_this_machine():
  # The CI machine has a C++ compiler: the kernel must build there, not fall back silently.
  assert build.available(), "see the stderr line above for the build error"


@pytest.mark.parametrize("K,G,S,H", [(2, 2, 80, 64), (1, 7, 33, 128), (3, 1, 5, 8)])
def test_kernel_equals_xla_attention(K, G, S, H):
  B = 6
  # Positions: the first, the middle, the last, past the end (an idle slot: all S), negative
  # (XLA's masked softmax is uniform over all S there) and one more.
  pos = [0, S // 2, S - 1, S + 7, -1, 3 % S]
  q, keys, values, pos_b = _inputs(B, K, G, S, H, pos)
  got = np.asarray(jax.jit(cpu_attention.decode)(q, keys, values, pos_b))
  want = np.asarray(jax.jit(xla_decode_attention)(q, keys, values, pos_b))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  # Position 0 attends to the first value only; a kernel that ignored positions would not.
  np.testing.assert_allclose(got[0], np.broadcast_to(values[0, :, :1], got[0].shape), rtol=1e-6)


def test_kernel_on_a_sharded_cache_runs_per_device(devices):
  mesh = make_mesh(1, 4, 2)  # slots over fsdp, KV heads over tensor
  spec = P("fsdp", "tensor", None, None)
  fn = attention.decode_kernel(mesh, spec)
  assert fn is not None
  q, keys, values, pos_b = _inputs(8, 2, 2, 24, 64, [0, 5, 23, 30, 11, 12, 1, 22])
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
  args = (put(q, spec), put(keys, spec), put(values, spec), put(pos_b, P("fsdp")))
  jitted = jax.jit(fn)
  hlo = jitted.lower(*args).compile().as_text()
  assert "jaxrl_decode_attention" in hlo
  assert not any(c in hlo for c in ("all-gather", "all-reduce", "all-to-all"))
  got = np.asarray(jitted(*args))
  want = np.asarray(xla_decode_attention(q, keys, values, pos_b))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_sampler_decodes_with_the_kernel_and_samples_as_xla_does(devices):
  mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  cfg = get_preset("tiny-qwen2")
  graphdef, params = init_params(cfg, mesh, "sampler", seed=0)
  params = dict(params, embed=params["embed"] * 5.0)  # spread the logits: no near-ties
  sp = SamplingParams(temperature=1.0, max_new_tokens=12, eos_id=None)
  with_kernel = Engine(graphdef, cfg, mesh, sampling=sp)
  with_xla = Engine(graphdef, cfg, mesh, sampling=sp)
  with_xla._attention_kernel = lambda state: None
  prompts = [[1, 40, 41, 42], [1, 50], [1, 7, 8, 9, 10, 11, 12]]
  state = with_kernel.init_decode_state(4, 32)
  key = jax.random.key(0)
  assert "jaxrl_decode_attention" in with_kernel._steps.lower(
      params, state, key, steps=2).as_text()
  assert "jaxrl_decode_attention" not in with_xla._steps.lower(
      params, state, key, steps=2).as_text()
  a = generate(with_kernel, params, prompts, n=2, slots=4, steps_per_call=4)
  b = generate(with_xla, params, prompts, n=2, slots=4, steps_per_call=4)
  np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
  np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-5)


def test_no_compiler_or_switched_off_keeps_xla_attention(monkeypatch, capsys):
  build.library.cache_clear()
  try:
    monkeypatch.setenv("JAXRL_CPU_KERNELS", "0")
    assert not build.available()
    build.library.cache_clear()
    monkeypatch.delenv("JAXRL_CPU_KERNELS")
    monkeypatch.setenv("CXX", "no-such-compiler-jaxrl")
    assert not build.available()
    err = capsys.readouterr().err
    assert "no C++ compiler 'no-such-compiler-jaxrl'" in err and "XLA's attention" in err
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    assert attention.decode_kernel(mesh, P()) is None
  finally:
    build.library.cache_clear()
