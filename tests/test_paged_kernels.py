"""The paged KV cache's decode kernels (jaxrl/backends/tpu/paged.py, gpu/paged.py) in Pallas's
interpreter on CPU, against XLA's gather path (attention.xla_paged_decode_attention) and dense
decode attention: grouped-query heads, ragged lengths not a multiple of the page size, a group
sharing its prompt pages, an idle slot; per device on 8 CPU devices; the paged engine through
the kernel token for token against the dense engine; the TPU decode step compiled for v5e:2x2
with the kernel in its program (and without it under JAXRL_TPU_PAGED=xla)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl.backends
from jaxrl.backends import gpu as gpu_backend
from jaxrl.backends import tpu as tpu_backend
from jaxrl.backends.gpu import paged as gpu_paged
from jaxrl.backends.tpu import paged as tpu_paged
from jaxrl.models import attention

PAGE = 16
# 4 slots, tables of 4 pages of 16: slots 0 and 1 are one group, sharing their two full prompt
# pages (0, 1) and each on its own third page; slot 2 holds 4 pages and reads them all; slot 3
# is idle (fed n * P, as the engine feeds a slot that does not generate) with one page held.
PAGES_BN = np.array([[0, 1, 2, -1], [0, 1, 3, -1], [4, 5, 6, 7], [8, -1, -1, -1]], np.int32)
POS_B = np.array([37, 40, 63, 4 * PAGE], np.int32)  # 38 and 41 keys: not whole pages
LIVE = slice(0, 3)


def _inputs(K, G, H, dtype=jnp.float32, num_pages=12, seed=0):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.normal(size=(len(POS_B), K, G, H)), dtype)
  keys, values = (jnp.asarray(r.normal(size=(K, num_pages, PAGE, H)), dtype) for _ in range(2))
  return q, keys, values, jnp.asarray(PAGES_BN), jnp.asarray(POS_B)


def _dense_reference(q, keys, values, pages_bn, pos_b):
  """Dense decode attention over a [B, K, S, H] cache copied position by position in numpy
  from the pages (independent of the gather path's indexing)."""
  keys, values, pages_bn = np.asarray(keys), np.asarray(values), np.asarray(pages_bn)
  B, n = pages_bn.shape
  K, _, _, H = keys.shape
  cache = [np.zeros((B, K, n * PAGE, H), keys.dtype) for _ in range(2)]
  for b in range(B):
    for p in range(min(int(pos_b[b]) + 1, n * PAGE)):
      page = pages_bn[b, p // PAGE]
      if page >= 0:
        cache[0][b, :, p] = keys[:, page, p % PAGE]
        cache[1][b, :, p] = values[:, page, p % PAGE]
  return attention.xla_decode_attention(q, jnp.asarray(cache[0]), jnp.asarray(cache[1]),
                                        jnp.asarray(pos_b))


def _bf16(x):
  return x.astype(jnp.bfloat16).astype(x.dtype)


@pytest.mark.parametrize("K,G", [(2, 2), (1, 4)])
def test_tpu_kernel_equals_the_gather_path(K, G):
  """The TPU kernel reads keys and values as bfloat16 (the kernel's own cast, jax 0.12: a TPU's
  default-precision product rounds float32 operands so too): against the gather path over
  bfloat16-rounded pools it agrees to float32 rounding, against the exact pools to bfloat16's."""
  q, keys, values, pages, pos = _inputs(K, G, 128)
  out = jax.jit(lambda *a: tpu_paged.paged_decode(*a, interpret=True))(q, keys, values, pages,
                                                                      pos)
  gather = attention.xla_paged_decode_attention(q, _bf16(keys), _bf16(values), pages, pos)
  np.testing.assert_allclose(out[LIVE], gather[LIVE], atol=2e-5, rtol=2e-5)
  exact = _dense_reference(q, keys, values, pages, pos)
  np.testing.assert_allclose(out[LIVE], exact[LIVE], atol=2e-2)
  assert np.abs(np.asarray(out[LIVE] - exact[LIVE])).max() > 1e-6  # it did round


@pytest.mark.parametrize("K,G,dtype", [(2, 2, jnp.float32), (1, 4, jnp.bfloat16)])
def test_gpu_kernel_equals_the_gather_path_and_dense_attention(K, G, dtype):
  q, keys, values, pages, pos = _inputs(K, G, 64, dtype)
  out = jax.jit(lambda *a: gpu_paged.paged_decode(*a, interpret=True))(q, keys, values, pages,
                                                                      pos)
  assert out.dtype == dtype and out.shape == q.shape
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  gather = attention.xla_paged_decode_attention(q, keys, values, pages, pos)
  np.testing.assert_allclose(out[LIVE].astype(np.float32), gather[LIVE].astype(np.float32),
                             atol=tol, rtol=tol)
  dense = _dense_reference(q, keys, values, pages, pos)
  np.testing.assert_allclose(gather[LIVE].astype(np.float32), dense[LIVE].astype(np.float32),
                             atol=tol, rtol=tol)


def test_the_gather_path_equals_dense_attention_and_shares_prompt_pages():
  """Slots 0 and 1 read the same two prompt pages: their first 32 keys are the same arrays,
  so with the same query and only those keys visible they give the same output."""
  q, keys, values, pages, _ = _inputs(2, 2, 32)
  np.testing.assert_allclose(
      attention.xla_paged_decode_attention(q, keys, values, pages, jnp.asarray(POS_B))[LIVE],
      _dense_reference(q, keys, values, pages, POS_B)[LIVE], atol=1e-6)
  q = q.at[1].set(q[0])
  pos = jnp.array([31, 31, 63, 64], jnp.int32)
  for kernel in (attention.xla_paged_decode_attention,
                 lambda *a: gpu_paged.paged_decode(*a, interpret=True)):
    out = kernel(q, keys, values, pages, pos)
    np.testing.assert_allclose(out[0], out[1], atol=1e-6)


@pytest.mark.parametrize("backend", [tpu_backend, gpu_backend])
def test_the_backends_kernels_run_per_device_on_8_devices(devices, backend):
  """Slots over fsdp (4), KV heads over tensor (2), the pools replicated over the slots as the
  engine lays them out: each device's kernel reads its own slots and heads."""
  mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=devices)
  kernel = backend.paged_decode_kernel(mesh, P("fsdp", "tensor"), interpret=True)
  B = 8
  q, keys, values, _, _ = _inputs(2, 2, 128)
  q = jnp.concatenate([q, q[::-1]])
  pages = jnp.asarray(np.concatenate([PAGES_BN, PAGES_BN[::-1]]))
  pos = jnp.asarray(np.concatenate([POS_B, POS_B[::-1]]))
  put = lambda x, *axes: jax.device_put(x, NamedSharding(mesh, P(*axes)))  # noqa: E731
  args = (put(q, "fsdp", "tensor"), put(keys, "tensor"), put(values, "tensor"),
          put(pages, "fsdp"), put(pos, "fsdp"))
  out = jax.jit(kernel)(*args)
  assert out.sharding.spec[:2] == ("fsdp", "tensor") and out.shape == (B, 2, 2, 128)
  cast = _bf16 if backend is tpu_backend else (lambda x: x)
  gather = attention.xla_paged_decode_attention(q, cast(keys), cast(values), pages, pos)
  live = np.asarray(pos) < 4 * PAGE
  np.testing.assert_allclose(np.asarray(out)[live], np.asarray(gather)[live], atol=2e-5)


def test_what_the_kernels_leave_to_the_gather_path(devices, monkeypatch):
  mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=devices)
  q, keys, values, pages, pos = _inputs(2, 2, 32)
  # head_dim 32: Mosaic lowers the TPU kernel for multiples of 128 only.
  assert tpu_backend.paged_decode_kernel(mesh, P("fsdp", "tensor"))(
      q, keys, values, pages, pos) is None
  # 3 KV heads do not split over tensor = 2.
  q3, k3, v3, _, _ = _inputs(3, 1, 128)
  assert gpu_backend.paged_decode_kernel(mesh, P("fsdp", "tensor"))(
      q3, k3, v3, pages, pos) is None
  assert not gpu_paged.takes(96, jnp.float32, 16) and not gpu_paged.takes(64, jnp.float32, 4)
  assert tpu_paged.takes(256, jnp.bfloat16) and not tpu_paged.takes(64, jnp.bfloat16)
  # Triton's blocks are powers of two: a 48-page table splits 16 ways into blocks of 1 page.
  assert gpu_paged.blocks(48) == (16, 1) and gpu_paged.blocks(64) == (16, 4)
  monkeypatch.setenv(tpu_backend.PAGED_ENV, "xla")
  monkeypatch.setenv(gpu_backend.PAGED_ENV, "xla")
  assert tpu_backend.paged_decode_kernel(mesh, P("fsdp", "tensor")) is None
  assert gpu_backend.paged_decode_kernel(mesh, P("fsdp", "tensor")) is None
  assert "xla paged gather" in tpu_backend.describe()["attention"]
  monkeypatch.setenv(tpu_backend.PAGED_ENV, "palas")
  from jaxrl.errors import ConfigError
  with pytest.raises(ConfigError, match="JAXRL_TPU_PAGED='palas' is not valid"):
    tpu_backend.describe()
  # Off a TPU or GPU mesh there is no paged kernel: the CPU keeps the gather path.
  assert jaxrl.backends.paged_decode_kernel(mesh, P("fsdp", "tensor")) is None


def _tiny_head_dim_128(name):
  import dataclasses

  from jaxrl.models import get_preset
  return dataclasses.replace(get_preset(name), head_dim=128)


@pytest.mark.slow  # ~20 s on 2 busy cores: the dense and paged rollouts' compiles
def test_the_paged_engine_through_the_kernel_equals_dense(devices, monkeypatch):
  """A float32 rollout with kv_cache=paged whose decode attention runs the GPU kernel
  (interpreted) through the backend hook is the dense rollout token for token. (The TPU
  kernel shares the hook, the per-device wrapper and the lengths; it rounds keys and values to
  bfloat16, so a float32 rollout through it is not bit-equal to the dense one on CPU, and a
  bfloat16 one costs another ~20 s of compiles here: its wiring is checked by the v5e compile
  test below, its numbers by the kernel tests above.)"""
  from jaxrl.parallel import init_params, make_mesh
  from jaxrl.sampler import Engine, SamplingParams, generate
  # One device: the kernels' per-device runs are checked on 8 above, and this compiles faster.
  mesh = make_mesh(1, 1, 1, devices=devices[:1])
  cfg = _tiny_head_dim_128("tiny-qwen3")
  graphdef, params = init_params(cfg, mesh, "sampler", seed=0)
  params = dict(params, embed=params["embed"] * 5.0)  # spread the logits: no greedy near-ties
  calls = []

  def kernel(mesh, cache_spec):
    inner = gpu_backend.paged_decode_kernel(mesh, cache_spec, interpret=True)

    def counted(*args):
      out = inner(*args)
      calls.append(out is not None)
      return out
    return counted

  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=12,
                                                               stop_ids=(3, 10, 17)))
  prompts = [[1, 40, 41, 42, 43], [1, 50] + list(range(60, 78))]  # 5 and 20 tokens
  dense = generate(engine, params, prompts, n=2, slots=4, steps_per_call=4, seed=5,
                   grow_cache=False)
  monkeypatch.setattr(jaxrl.backends, "paged_decode_kernel", kernel)
  pg = generate(engine, params, prompts, n=2, slots=4, steps_per_call=4, seed=5,
                kv_cache="paged", page_size=PAGE)
  assert calls and all(calls), "the kernel did not take the decode steps"
  assert sum(pg.lengths) > 8
  for field in ("completion_ids", "completion_mask", "lengths"):
    np.testing.assert_array_equal(getattr(pg, field), getattr(dense, field), err_msg=field)
  np.testing.assert_allclose(pg.logprobs, dense.logprobs, atol=2e-5)


def _decode_step_hlo(monkeypatch, choice, steps=1, kv_heads=None):
  """The paged decode scan of a 2-layer tiny Qwen3 with head_dim 128 in bfloat16, 8 slots of
  up to 256 positions over 64 pages of 16, compiled for v5e:2x2 (fsdp 2 x tensor 2); kv_heads:
  that many KV heads (and twice as many query heads) instead of the preset's 2."""
  import dataclasses

  from jaxrl.models import abstract_model
  from jaxrl.parallel import make_mesh
  from jaxrl.parallel.compile import topology_devices
  from jaxrl.sampler import Engine, SamplingParams
  from jaxrl.train import programs as pg
  monkeypatch.setenv(tpu_backend.PAGED_ENV, choice)
  mesh = make_mesh(1, 2, 2, devices=topology_devices("v5e:2x2"))
  cfg = dataclasses.replace(_tiny_head_dim_128("tiny-qwen3"), dtype="bfloat16")
  if kv_heads:
    cfg = dataclasses.replace(cfg, num_kv_heads=kv_heads, num_heads=2 * kv_heads)
  model = abstract_model(cfg)
  params = pg.params_of(model, mesh, "sampler")
  engine = Engine(model[0], cfg, mesh, sampling=SamplingParams(max_new_tokens=128))
  slots, max_len, pages = 8, 256, 64
  rep = NamedSharding(mesh, P())
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep)
  state = jax.tree.map(
      lambda x, s: pg.spec(x.shape, x.dtype, s),
      jax.eval_shape(lambda: engine._paged_init_fn(slots, max_len // PAGE, pages, PAGE)(
          jnp.int32(max_len))), engine._paged_shardings(slots))
  compiled = jax.jit(lambda p, s, k: engine._steps_fn(p, s, k, steps=steps),
                     donate_argnums=1).lower(params, state, key).compile()
  pool = state["cache"][0][0]
  return compiled, pool.sharding.shard_shape(pool.shape)


def test_the_decode_scan_writes_the_pools_in_place_for_v5e(monkeypatch):
  """The rollout's scan of decode steps (4 here) compiled for v5e: no copy of a page pool.
  With the write as pool[:, page, off] XLA laid the loop-carried pools out for the scatter
  and copied each into the kernel's layout and back every layer and step
  (jaxrl.models.attention.paged_write)."""
  pytest.importorskip("libtpu", reason='libtpu is in the test extra: pip install -e ".[test]"')
  # Two KV heads per chip, as Qwen3's 8 over tensor 4 (with one the two layouts are the same).
  compiled, shard = _decode_step_hlo(monkeypatch, "pallas", steps=4, kv_heads=4)
  copies = re.findall(r"= bf16\[" + ",".join(map(str, shard)) + r"\]\{[^}]*\} copy\(",
                      compiled.as_text())
  assert len(shard) == 4 and not copies, copies


def test_the_paged_decode_step_compiles_with_the_kernel_for_v5e(monkeypatch):
  """Mosaic lowers the kernel in the engine's decode step, one call per layer; with
  JAXRL_TPU_PAGED=xla the step has none. The memory figures are in docs/guides/kernels.md."""
  pytest.importorskip("libtpu", reason='libtpu is in the test extra: pip install -e ".[test]"')

  def calls(hlo):  # the kernel's Mosaic calls
    return len(re.findall(r"%paged_attention[.\d]* = .*tpu_custom_call", hlo))

  with_kernel, _ = _decode_step_hlo(monkeypatch, "pallas")
  assert calls(with_kernel.as_text()) == 2, with_kernel.as_text()[:3000]  # one per layer
  without, _ = _decode_step_hlo(monkeypatch, "xla")
  assert calls(without.as_text()) == 0 and "tpu_custom_call" not in without.as_text()
  for compiled in (with_kernel, without):
    m = compiled.memory_analysis()
    print(f"v5e:2x2 paged decode step: args {m.argument_size_in_bytes} out "
          f"{m.output_size_in_bytes} temp {m.temp_size_in_bytes} bytes per chip")
