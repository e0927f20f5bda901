"""The TPU and GPU learner-attention kernels (jaxrl.backends.tpu, .gpu) against XLA's attention:
forward and gradient in Pallas's interpreter on CPU, with grouped-query heads, packed segments,
ragged (padded) rows and a GRPO group's shared prompt; through the model's hook; and the TPU
path compiled for a v5e:2x2 inside the tiny SFT train step, where the splash kernels must be in
the compiled program (so a silent fallback to XLA fails here)."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.backends import gpu as gpu_backend, tpu as tpu_backend
from jaxrl.backends.gpu.attention import pallas_attention
from jaxrl.backends.tpu.attention import splash_attention
from jaxrl.models import attention
from jaxrl.models.attention import Causal, xla_attention


@pytest.fixture(autouse=True)
def _splash(monkeypatch):
  """Splash is opt-in on TPU (jaxrl.backends.tpu); these tests are about it."""
  monkeypatch.setenv(tpu_backend.ENV, "splash")


def _rows(rng, B, T, *, packed):
  """Segment ids [B, T]: row 0 two packed sequences then padding (id 0), the others one
  sequence of ragged length then padding; or None (one segment, no padding)."""
  if not packed:
    return None
  seg = np.zeros((B, T), np.int32)
  cut, end = T // 3, T - 5
  seg[0, :cut], seg[0, cut:end] = 1, 2
  for b in range(1, B):
    seg[b, :rng.integers(T // 2, T)] = 1
  return seg


def _self_attention(seed, B, T, K, G, H, *, packed):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, K, G, H), np.float32)
  keys, values = (rng.standard_normal((B, K, T, H), np.float32) for _ in range(2))
  seg = _rows(rng, B, T, packed=packed)
  mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
  if seg is not None:
    mask = mask & (seg[:, :, None] == seg[:, None, :])
  return q, keys, values, mask, Causal(seg, seg)


def _prompt_attention(seed, B, T, Tp, K, G, H):
  """Completions [B, T] against a right-padded prompt of Tp (ragged valid lengths) and their
  own keys, as Transformer.grouped_hidden builds the call."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, K, G, H), np.float32)
  keys, values = (rng.standard_normal((B, K, Tp + T, H), np.float32) for _ in range(2))
  valid = np.arange(Tp)[None, :] < rng.integers(1, Tp + 1, size=(B, 1))
  mask = np.concatenate([np.broadcast_to(valid[:, None], (B, T, Tp)),
                         np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))], axis=2)
  causal = Causal(np.ones((B, T), np.int32),
                  np.concatenate([valid.astype(np.int32), np.ones((B, T), np.int32)], axis=1))
  return q, keys, values, mask, causal


def _value_and_grads(fn, q, keys, values, cot):
  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out * cot), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      q, keys, values)
  return [np.asarray(x) for x in (out, *grads)]


def _check(kernel, q, keys, values, mask, causal):
  """kernel(q, k, v) against xla_attention with `mask` (what `causal` describes): the output
  and the three gradients under a random cotangent."""
  del causal  # the kernel closes over it
  cot = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
  got = _value_and_grads(kernel, q, keys, values, cot)
  want = _value_and_grads(lambda q, k, v: xla_attention(q, k, v, mask), q, keys, values, cot)
  for name, g, w in zip(("out", "d_q", "d_keys", "d_values"), got, want):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4, err_msg=name)


# T not a multiple of 128 (padded inside), G > 1 (grouped-query heads), packed + ragged rows.
@pytest.mark.parametrize("B,T,K,G,H,packed", [(2, 130, 2, 2, 32, True),
                                              (1, 128, 1, 4, 16, False)])
def test_splash_equals_xla_forward_and_gradient(B, T, K, G, H, packed):
  q, keys, values, mask, causal = _self_attention(0, B, T, K, G, H, packed=packed)
  seg = causal.q_segment_ids
  _check(lambda q, k, v: splash_attention(q, k, v, seg, seg, interpret=True),
         q, keys, values, mask, causal)


def test_splash_equals_xla_for_completions_against_a_shared_prompt():
  q, keys, values, mask, causal = _prompt_attention(2, 2, 40, 100, 2, 2, 32)
  _check(lambda q, k, v: splash_attention(q, k, v, *causal, interpret=True),
         q, keys, values, mask, causal)


def test_pallas_gpu_equals_xla_forward_and_gradient():
  q, keys, values, mask, causal = _self_attention(3, 2, 40, 2, 2, 32, packed=True)
  seg = causal.q_segment_ids
  _check(lambda q, k, v: pallas_attention(q, k, v, seg, seg, interpret=True),
         q, keys, values, mask, causal)


def test_backends_leave_what_they_cannot_take_to_xla(devices):
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("data",))
  q, keys, values, mask, causal = _prompt_attention(4, 1, 8, 140, 1, 2, 16)
  splash = tpu_backend.attention_kernel(mesh, batch="data", kv_heads=None, interpret=True)
  pallas = gpu_backend.attention_kernel(mesh, batch="data", kv_heads=None, interpret=True)
  assert splash(q, keys, values, mask, None) is None  # a mask by position (cached forwards)
  assert pallas(q, keys, values, mask, None) is None
  assert pallas(q, keys, values, mask, causal) is None  # keys beyond the queries' positions
  assert splash(q, keys, values, mask, causal) is not None
  short = _self_attention(4, 1, 64, 1, 2, 16, packed=False)
  assert splash(*short) is None  # under one 128-key block: XLA's scores are the smaller


def test_sharded_kernels_run_per_device(devices):
  """Rows over fsdp and KV heads over tensor, each device on its own under shard_map; the
  gradients equal XLA's (a shard_map that left an axis out would sum them over it)."""
  from jaxrl.parallel.layouts import get_rules
  from jaxrl.parallel.mesh import make_mesh
  mesh = make_mesh(1, 4, 2)
  rules = get_rules("learner")
  q, keys, values, mask, causal = _self_attention(5, 4, 128, 2, 2, 16, packed=True)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
  q = put(q, P("fsdp", None, "tensor", None, None))
  keys, values = (put(x, P("fsdp", "tensor", None, None)) for x in (keys, values))
  seg = put(causal.q_segment_ids, P("fsdp", None))
  for backend in (tpu_backend, gpu_backend):
    kernel = backend.attention_kernel(mesh, batch=rules["batch"], kv_heads=rules["kv_heads"],
                                      interpret=True)
    _check(lambda q, k, v: kernel(q, k, v, mask, Causal(seg, seg)), q, keys, values, mask,
           causal)


def test_the_model_through_the_hook_equals_xla():
  """The tiny model's full forward and grouped (shared-prompt) forward with splash in the hook
  equal XLA's: llama.py hands the kernel the mask's structure that matches its dense mask."""
  from flax import nnx
  from jaxrl.models import PRESETS, Transformer
  cfg = PRESETS["tiny"].replace(num_layers=1)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  kernel = tpu_backend.attention_kernel(mesh, batch="data", kv_heads=None, interpret=True)
  rng = np.random.default_rng(6)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 130)), jnp.int32)
  seg = jnp.asarray(_rows(rng, 2, 130, packed=True))
  # Prompt 130 (97 real), completions 40: both of grouped_hidden's calls have >= 128 keys.
  prompt, completion = tokens[:1], tokens[:, 60:100]
  prompt_len = jnp.asarray([97], jnp.int32)

  def run():
    h, _ = model.hidden(tokens, segment_ids_bt=seg)
    return h, model.grouped_hidden(prompt, prompt_len, completion)

  def counted(*args):
    out = kernel(*args)
    taken.append(out is not None)
    return out

  want = run()
  taken = []
  with attention.tracing(attention=counted):
    got = run()
  assert taken == [True] * 3  # one full forward, the prompt's pass and its completions'
  np.testing.assert_allclose(got[0], want[0], atol=2e-4)
  np.testing.assert_allclose(got[1], want[1], atol=2e-4)


# ----------------------------------------------------------------------------- TPU compile


def _sft_train_step(monkeypatch, choice):
  from jaxrl import config as config_lib
  from jaxrl.parallel import compile as aot
  from jaxrl.algorithms import sft
  monkeypatch.setenv(tpu_backend.ENV, choice)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = config_lib.load_config(os.path.join(root, "configs/sft_tiny.py"),
                                  choices=sft.CHOICES)
  # One 128-key block, splash's least; 16 rows, 4 per chip.
  config_lib.apply_overrides(config, ["data.seq_len=128", "data.batch_size=16"])
  _, programs = sft.programs(config, devices=aot.topology_devices("v5e:2x2"))
  train = programs[0]
  return train.fn.lower(*train.args)


def test_tpu_train_step_compiles_with_splash_for_v5e(monkeypatch):
  """The tiny SFT train step (2 layers, packed rows) compiled for a v5e:2x2: per layer the
  splash forward and its two backward kernels are in the program; with
  JAXRL_TPU_ATTENTION=xla none are."""
  pytest.importorskip("libtpu", reason='libtpu is in the test extra: pip install -e ".[test]"')
  hlo = _sft_train_step(monkeypatch, "splash").compile().as_text()
  kernels = lambda name: len(re.findall(rf"%{name}[.\d]* = ", hlo))  # noqa: E731
  assert kernels("splash_mha_fwd_segmented_residuals") == 2, hlo[:2000]
  assert kernels("splash_mha_dq_segmented_no_residuals") == 2
  assert kernels("splash_mha_dkv_segmented_no_residuals") == 2
  assert "splash_mha" in _sft_train_step(monkeypatch, "splash").as_text()  # what is looked for
  # (Lowered, not compiled: a kernel not in the lowered program is not in the compiled one.)
  assert "splash_mha" not in _sft_train_step(monkeypatch, "xla").as_text()


def test_the_plans_attention_term_follows_the_kernel(monkeypatch):
  """The memory plan counts a call's float32 scores only where XLA's attention runs it: on a
  v5e mesh splash takes 256 x 256 (no scores), not 16 x 16 (under one kv block)."""
  pytest.importorskip("libtpu", reason='libtpu is in the test extra: pip install -e ".[test]"')
  from jaxrl.backends import attention_kernel
  from jaxrl.models import PRESETS
  from jaxrl.parallel import compile as aot
  from jaxrl.parallel.layouts import get_rules
  from jaxrl.parallel.mesh import make_mesh
  from jaxrl.parallel.plan import attention_score_bytes, kernel_takes
  cfg, rules = PRESETS["tiny"], get_rules("learner")
  mesh = make_mesh(1, 4, 1, devices=aot.topology_devices("v5e:2x2"))

  def scores(queries, keys):
    kernel = attention_kernel(mesh, batch=rules["batch"], kv_heads=rules["kv_heads"])
    fused = kernel_takes(kernel, cfg, mesh, queries=queries, keys=keys)
    return attention_score_bytes(cfg, mesh, rows=2, queries=queries, keys=keys, fused=fused)

  assert scores(256, 256) == 0 and scores(16, 16) == 4 * 2 * 4 * 16 * 16
  monkeypatch.setenv(tpu_backend.ENV, "xla")
  assert scores(256, 256) == 4 * 2 * 4 * 256 * 256


def test_grouped_completions_call_compiles_for_v5e():
  """GRPO's completions against their shared prompt (the causal offset, both lengths padded to
  128) in bfloat16, forward and gradient, per device on a v5e:2x2: Mosaic lowers all three
  splash kernels."""
  pytest.importorskip("libtpu", reason='libtpu is in the test extra: pip install -e ".[test]"')
  from jaxrl.parallel import compile as aot
  mesh = jax.sharding.Mesh(np.array(aot.topology_devices("v5e:2x2")).reshape(4, 1),
                           ("fsdp", "tensor"))
  kernel = tpu_backend.attention_kernel(mesh, batch="fsdp", kv_heads="tensor")
  B, T, Tp, K, G, H = 8, 40, 100, 2, 2, 128
  spec = lambda shape, dtype, *axes: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dtype, sharding=NamedSharding(mesh, P(*axes)))
  q = spec((B, T, K, G, H), jnp.bfloat16, "fsdp")
  kv = spec((B, K, Tp + T, H), jnp.bfloat16, "fsdp", "tensor")
  q_seg, kv_seg = spec((B, T), jnp.int32, "fsdp"), spec((B, Tp + T), jnp.int32, "fsdp")

  def loss(q, k, v, q_seg, kv_seg):
    out = kernel(q, k, v, None, Causal(q_seg, kv_seg))
    return jnp.sum(out.astype(jnp.float32) ** 2)

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, q_seg, kv_seg).compile()
  names = set(re.findall(r"%(splash_mha_\w+?)[.\d]* = ", hlo.as_text()))
  assert names == {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
                   "splash_mha_dkv_segmented_no_residuals"}, names


def test_describe_and_bad_choice(monkeypatch):
  """The run record names the kernel each switch selects; a bad value is one sentence."""
  from jaxrl.errors import ConfigError
  assert tpu_backend.describe()["attention"].startswith("splash")
  monkeypatch.delenv(tpu_backend.ENV)
  assert tpu_backend.describe()["attention"].startswith("xla")  # the default
  assert gpu_backend.describe()["attention"].startswith("pallas")
  monkeypatch.setenv(gpu_backend.ENV, "cudnn")
  assert gpu_backend.describe()["attention"].startswith("cudnn")
  monkeypatch.setenv(tpu_backend.ENV, "splsh")
  with pytest.raises(ConfigError, match="JAXRL_TPU_ATTENTION='splsh' is not valid. Did you "
                                        "mean 'splash'"):
    tpu_backend.describe()


def test_compiler_options_read_a_one_pass_device_iterator_once():
  """A mesh's `devices.flat` is a one-pass iterator. compiler_options walked it twice (is it
  CPU? then is it TPU?), so on one GPU the second walk saw no devices, took them for TPU, and
  handed libtpu's options to the CUDA compiler: every GRPO run on a single GPU stopped at its
  first reference forward ("No such compile option", seen on an H200). A GPU gets XLA's
  defaults, an iterator the same options as the list."""
  from types import SimpleNamespace
  from jaxrl import backends
  gpu = SimpleNamespace(platform="gpu")
  assert backends.compiler_options(np.array([gpu]).flat) is None
  assert backends.compiler_options(iter([gpu, gpu])) is None
  cpus = jax.devices("cpu")[:2]
  assert (backends.compiler_options(np.array(cpus).flat) ==
          backends.compiler_options(list(cpus)))


def test_tpu_learner_programs_turn_the_collective_matmul_off(monkeypatch):
  """Learner programs compiled for a TPU carry the libtpu options that turn the windowed einsum
  of FSDP all-gathers and of the gradients' reduce-scatters off (jaxrl.backends.tpu.
  compiler_options: what they cost Qwen3-0.6B's step per layer on v5e and on v6e); libtpu
  accepts them (an unknown option fails the compile, checked below), decode
  programs keep libtpu's defaults, and JAXRL_TPU_COLLECTIVE_MATMUL=on brings it back."""
  pytest.importorskip("libtpu", reason='libtpu is in the test extra: pip install -e ".[test]"')
  from jaxrl import backends
  from jaxrl.errors import ConfigError
  from jaxrl.parallel import compile as aot
  devices = aot.topology_devices("v5e:2x2")
  monkeypatch.delenv(tpu_backend.COLLECTIVE_MATMUL_ENV, raising=False)
  options = backends.compiler_options(devices)
  assert options == {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                     "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}
  assert backends.compiler_options(devices, "decode_one_slot") is None
  mesh = jax.sharding.Mesh(np.array(devices).reshape(4), ("fsdp",))
  row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=row)
  w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=row)
  lowered = jax.jit(lambda x, w: x @ w, out_shardings=row).lower(x, w)
  lowered.compile(compiler_options=options)  # accepted
  with pytest.raises(Exception, match="No such compile option"):
    lowered.compile(compiler_options={"xla_tpu_no_such_option_jaxrl": False})
  assert tpu_backend.describe()["collective_matmul"].startswith("off")
  monkeypatch.setenv(tpu_backend.COLLECTIVE_MATMUL_ENV, "on")
  assert backends.compiler_options(devices) is None
  monkeypatch.setenv(tpu_backend.COLLECTIVE_MATMUL_ENV, "of")
  with pytest.raises(ConfigError, match="JAXRL_TPU_COLLECTIVE_MATMUL='of' is not valid"):
    backends.compiler_options(devices)
