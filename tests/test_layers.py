"""Golden values for RoPE (with and without Llama-3 scaling) and RMSNorm; the SwiGLU backward.

Expected numbers are written out as literals, worked by hand from the formulas in the comments;
they do not come from the code under test.
"""

import math

import jax.numpy as jnp
import numpy as np

from jaxrl.models import RopeScaling, apply_rope, rope_inv_freq
from jaxrl.models.llama import RMSNorm


def test_rope_inv_freq_plain():
  # inv_freq_i = theta^(-2i/H): H=4, theta=10000 -> [1, 10000^-0.5] = [1, 0.01]
  np.testing.assert_allclose(rope_inv_freq(4, 10_000.0), [1.0, 0.01], rtol=1e-6)
  # H=8, theta=1e6 -> [1, 1e6^-0.25, 1e6^-0.5, 1e6^-0.75]
  np.testing.assert_allclose(rope_inv_freq(8, 1e6), [1.0, 0.031622777, 0.001, 3.1622777e-05],
                             rtol=1e-6)


def test_rope_rotation_golden():
  # Position 1, H=4, theta=10000: cos/sin of [1, 0.01] rotate halves (x1, x2) = ([1,2], [3,4]):
  #   out = [x1*cos - x2*sin, x2*cos + x1*sin]
  #   [1*cos1 - 3*sin1, 2*cos.01 - 4*sin.01, 3*cos1 + 1*sin1, 4*cos.01 + 2*sin.01]
  x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
  out = apply_rope(x, jnp.array([[1]]), jnp.asarray(rope_inv_freq(4, 10_000.0)))
  expected = [-1.9841106, 1.9599007, 2.4623779, 4.0197997]
  np.testing.assert_allclose(np.asarray(out).ravel(), expected, rtol=1e-6)
  # Position 0 is the identity.
  out0 = apply_rope(x, jnp.array([[0]]), jnp.asarray(rope_inv_freq(4, 10_000.0)))
  np.testing.assert_allclose(np.asarray(out0), np.asarray(x))


def test_rope_half_swap_as_a_product_is_bit_equal():
  """The TPU decode step's rotary half swap (a product with a permutation matrix, under
  attention.tracing(rope_matmul=True); jaxrl.backends.decode_on_matrix_unit) against the
  concatenate of the halves: bit-equal outputs, float32 and bfloat16, head_dim 128."""
  import jax
  from jaxrl.models import attention
  rng = np.random.default_rng(1)
  pos = jnp.asarray(rng.integers(0, 4096, size=(3, 2)))
  inv = jnp.asarray(rope_inv_freq(128, 1e6))
  for dtype in (jnp.float32, jnp.bfloat16):
    x = jnp.asarray(rng.normal(size=(3, 2, 4, 128)) * 5, dtype)
    # A fresh function per trace: jax caches a function's trace whatever the scope.
    want = jax.jit(lambda *a: apply_rope(*a))(x, pos, inv)
    with attention.tracing(rope_matmul=True):
      swap = jax.jit(lambda *a: apply_rope(*a))
      assert "dot_general" in str(jax.make_jaxpr(lambda *a: apply_rope(*a))(x, pos, inv))
      got = swap(x, pos, inv)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(want, np.float32), np.asarray(x, np.float32))


def test_rope_preserves_norm_and_relative_position():
  inv = jnp.asarray(rope_inv_freq(8, 500.0))
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  dots = []
  for shift in (0, 5, 17):
    qr = apply_rope(q, jnp.array([[3 + shift]]), inv)
    kr = apply_rope(k, jnp.array([[1 + shift]]), inv)
    np.testing.assert_allclose(jnp.linalg.norm(qr), jnp.linalg.norm(q), rtol=1e-5)
    dots.append(float(jnp.sum(qr * kr)))
  np.testing.assert_allclose(dots, dots[0], rtol=1e-4)  # depends on 3 - 1 only


def test_rope_llama3_scaling_golden():
  # Llama 3.1 settings: H=128, theta=5e5, factor 8, low 1, high 4, original 8192.
  # low_wavelen = 8192, high_wavelen = 2048; wavelen_i = 2*pi / inv_freq_i.
  s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position=8192)
  plain = rope_inv_freq(128, 500_000.0)
  scaled = rope_inv_freq(128, 500_000.0, s)
  # i=0: wavelen 2*pi < 2048 -> unchanged (1.0).
  assert scaled[0] == 1.0
  # i=63: inv = 5e5^(-126/128) = 2.45514e-06, wavelen ~2.56e6 > 8192 -> divided by 8.
  np.testing.assert_allclose(scaled[63], 3.068926e-07, rtol=1e-5)
  # i=22: inv = 5e5^(-44/128) = 0.0109895, wavelen = 571.74 < 2048 -> unchanged.
  np.testing.assert_allclose(scaled[22], 0.0109895, rtol=1e-5)
  # i=34: inv = 5e5^(-68/128) = 9.384739e-04, wavelen = 6695.11, in the smooth band:
  #   smooth = (8192 / 6695.11 - 1) / (4 - 1) = 0.0745266
  #   out = (1 - smooth) * inv / 8 + smooth * inv = 1.785078e-04
  np.testing.assert_allclose(plain[34], 9.384739e-04, rtol=1e-5)
  np.testing.assert_allclose(scaled[34], 1.785078e-04, rtol=1e-5)
  # Monotone: scaling never raises a frequency.
  assert np.all(scaled <= plain + 1e-12)


def test_rmsnorm_golden():
  # x = [1, 2, 3, 4]: mean square 7.5, rsqrt(7.5 + 1e-6) = 0.36514834; scale ones.
  norm = RMSNorm(4, 1e-6, jnp.float32)
  out = norm(jnp.array([[1.0, 2.0, 3.0, 4.0]]))
  np.testing.assert_allclose(np.asarray(out), [[0.36514837, 0.73029673, 1.0954451, 1.4605935]],
                             rtol=1e-6)
  # A learned scale multiplies after normalisation.
  norm.scale[...] = jnp.array([2.0, 0.5, 1.0, 0.0])
  out = norm(jnp.array([[1.0, 2.0, 3.0, 4.0]]))
  np.testing.assert_allclose(np.asarray(out), [[0.73029673, 0.36514837, 1.0954451, 0.0]],
                             rtol=1e-6)
  # eps matters for tiny inputs: x = [1e-3]*4 with eps 1e-6 -> 1e-3 / sqrt(1e-6 + 1e-6).
  out = RMSNorm(4, 1e-6, jnp.float32)(jnp.full((1, 4), 1e-3))
  np.testing.assert_allclose(np.asarray(out), np.full((1, 4), 1e-3 / math.sqrt(2e-6)), rtol=1e-5)


def test_rmsnorm_bf16_output_dtype():
  out = RMSNorm(4, 1e-6, jnp.bfloat16)(jnp.ones((2, 4), jnp.bfloat16))
  assert out.dtype == jnp.bfloat16


def test_swiglu_backward_equals_autodiff():
  # The hand-written VJP of silu(g) * u against jax's autodiff of the same expression.
  import jax

  from jaxrl.models.llama import swiglu
  key = jax.random.key(0)
  g, u, dh = (jax.random.normal(jax.random.fold_in(key, i), (64, 48)) * 3 for i in range(3))
  out, vjp = jax.vjp(swiglu, g, u)
  ref_out, ref_vjp = jax.vjp(lambda g, u: jax.nn.silu(g) * u, g, u)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6)
  for got, want in zip(vjp(dh), ref_vjp(dh)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(want).max()) > 1.0  # the gradients are not trivially small
