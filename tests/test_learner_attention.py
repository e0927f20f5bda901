"""The learner's CPU attention kernels (jaxrl/backends/cpu/csrc/learner_attention.cc), forward and
gradient, against XLA's attention: alone, sharded over the fake devices, and inside the model's
full-sequence forward and a train step's gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.backends.cpu import attention as cpu_attention
from jaxrl.backends.cpu import build
from jaxrl.models import apply, attention, get_preset
from jaxrl.models.attention import xla_attention
from jaxrl.parallel import get_rules, init_params, make_mesh
from jaxrl.parallel.layouts import shard_activations


def _inputs(B, T, K, G, Tp, H, seed=0):
  """q, keys, values, a grouped-GRPO-like mask (some prompt positions padding, then causal over
  the completion) with one position that sees no key, and a cotangent for the output."""
  rng = np.random.default_rng(seed)
  S = Tp + T
  q = rng.standard_normal((B, T, K, G, H), np.float32)
  keys = rng.standard_normal((B, K, S, H), np.float32)
  values = rng.standard_normal((B, K, S, H), np.float32)
  valid = rng.random((B, Tp)) < 0.7
  causal = np.arange(T)[:, None] >= np.arange(T)[None, :]
  mask = np.concatenate([np.broadcast_to(valid[:, None], (B, T, Tp)),
                         np.broadcast_to(causal, (B, T, T))], axis=2)
  mask[0, T // 2] = False
  cot = rng.standard_normal(q.shape, np.float32)
  return q, keys, values, mask, cot


def _learner_kernel(mesh):
  """The kernel the learner layout's programs get on `mesh` (what shard_activations asks)."""
  rules = get_rules("learner")
  return attention.attention_kernel(mesh, batch=rules["batch"], kv_heads=rules["kv_heads"])


def _value_and_grads(fn, q, keys, values, mask, cot):
  def loss(q, k, v):
    out = fn(q, k, v, mask)
    return jnp.sum(out * cot), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      q, keys, values)
  return [np.asarray(x) for x in (out, *grads)]


def test_kernels_build_on_this_machine():
  assert build.available(), "see the stderr line above for the build error"


@pytest.mark.parametrize("T,K,G,Tp,H", [(13, 2, 2, 5, 64), (9, 1, 4, 0, 128), (7, 3, 1, 4, 8),
                                        (21, 2, 3, 11, 16)])
def test_forward_and_gradients_equal_xla(T, K, G, Tp, H):
  assert build.available()
  args = _inputs(5, T, K, G, Tp, H)
  got = _value_and_grads(cpu_attention.learner, *args)
  want = _value_and_grads(xla_attention, *args)
  for name, g, w in zip(("out", "d_q", "d_keys", "d_values"), got, want):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=name)
  # The position with no key attends uniformly and passes no gradient to q; a kernel that
  # ignored the mask would do neither.
  q, keys, values, mask, _ = args
  np.testing.assert_allclose(got[0][0, T // 2], np.broadcast_to(
      values[0].mean(axis=1)[:, None], got[0][0, T // 2].shape), rtol=1e-5, atol=1e-6)
  assert np.all(got[1][0, T // 2] == 0)


def test_sharded_kernel_runs_per_device(devices):
  mesh = make_mesh(1, 4, 2)  # rows over fsdp, KV heads over tensor
  fn = _learner_kernel(mesh)
  assert fn is not None
  q, keys, values, mask, cot = _inputs(8, 11, 2, 2, 6, 64)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
  q_spec, kv_spec = P("fsdp", None, "tensor", None, None), P("fsdp", "tensor", None, None)
  args = (put(q, q_spec), put(keys, kv_spec), put(values, kv_spec), put(mask, P("fsdp")),
          put(cot, q_spec))
  grad = jax.jit(jax.grad(lambda q, k, v, m, c: jnp.sum(fn(q, k, v, m) * c), argnums=(0, 1, 2)))
  hlo = grad.lower(*args).compile().as_text()
  assert "jaxrl_learner_attention_grad" in hlo
  assert not any(c in hlo for c in ("all-gather", "all-reduce", "all-to-all"))
  got = _value_and_grads(fn, *args)
  want = _value_and_grads(xla_attention, q, keys, values, mask, cot)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
  # Six rows do not split over 4 devices: the model keeps XLA's attention (None).
  assert fn(q[:6], keys[:6], values[:6], mask[:6]) is None


def test_model_forward_and_gradients_equal_xla(devices):
  """The bench preset's full forward (packed segments included) and its parameter gradients,
  traced as the learner traces them, with the kernels and with XLA's attention."""
  mesh = make_mesh(1, 8, 1)
  cfg = get_preset("bench").replace(num_layers=2)
  graphdef, params = init_params(cfg, mesh)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (8, 24)), jnp.int32)
  segments = jnp.asarray(np.repeat([[0] * 10 + [1] * 14], 8, axis=0), jnp.int32)

  def loss(p):
    logits, _ = apply(graphdef, p, tokens[:, :-1], segment_ids_bt=segments[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)), logits

  def run(kernel):
    fn = shard_activations(jax.value_and_grad(loss, has_aux=True), mesh)
    if kernel:
      hlo = jax.jit(fn).lower(params).compile().as_text()
      assert "jaxrl_learner_attention" in hlo and "jaxrl_learner_attention_grad" in hlo
      return jax.jit(fn)(params)
    with attention.tracing():  # no kernel: XLA's attention
      return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (l1, logits1), g1 = run(True)
  (l0, logits0), g0 = run(False)
  np.testing.assert_allclose(np.asarray(logits1), np.asarray(logits0), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=2e-5)


def test_switched_off_or_bf16_keeps_xla_attention(monkeypatch, devices):
  mesh = make_mesh(1, 8, 1)
  build.library.cache_clear()
  try:
    monkeypatch.setenv("JAXRL_CPU_KERNELS", "0")
    assert _learner_kernel(mesh) is None
  finally:
    build.library.cache_clear()
  monkeypatch.delenv("JAXRL_CPU_KERNELS")
  cfg = get_preset("bench").replace(num_layers=1, dtype="bfloat16")
  assert not cpu_attention.handles_learner(cfg.dtype, cfg.head_dim)
  graphdef, params = init_params(cfg, mesh)
  tokens = jnp.zeros((8, 8), jnp.int32)
  fn = shard_activations(lambda p: apply(graphdef, p, tokens)[0], mesh)
  assert "jaxrl_learner_attention" not in jax.jit(fn).lower(params).compile().as_text()
