"""QLoRA (model.lora.quantize="int8"; jaxrl.models.quant): the frozen base in int8 with
per-output-channel scales, the adapters float32 beside it, the plan and the sync counting it."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.models import Transformer, abstract_model, apply, get_preset
from jaxrl.models import lora, quant
from jaxrl.models.config import LORA_WEIGHTS, lora_fields
from jaxrl.algorithms.grpo.update import batch_logprobs

FWD = jax.jit(lambda g, p, t: apply(g, p, t)[0], static_argnums=0)


def _qcfg(preset="tiny-qwen3", rank=4, alpha=8.0, targets=LORA_WEIGHTS, **kw):
  return get_preset(preset).replace(lora_rank=rank, lora_alpha=alpha, lora_targets=targets,
                                    lora_quantize="int8", **kw)


def _split(cfg, seed=3):
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(seed))))
  return graphdef, nnx.to_pure_dict(state)


def _tokens(cfg, B=3, T=12):
  return jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)


def _randomise_b(params, seed=7, scale=0.05):
  keys = iter(jax.random.split(jax.random.key(seed), 64))

  def walk(node, inside):
    return {k: walk(v, inside or str(k).endswith("_lora")) if isinstance(v, dict) else
            (scale * jax.random.normal(next(keys), v.shape, v.dtype)
             if inside and k == "lora_b" else v) for k, v in node.items()}
  return walk(params, False)


def _paths(tree):
  return {"/".join(str(getattr(k, "key", k)) for k in p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ----------------------------------------------------------------------------- config


def test_quantize_key_to_model_config_and_bad_values_are_one_sentence():
  assert lora_fields({"rank": 8, "quantize": "int8"})["lora_quantize"] == "int8"
  assert _qcfg().lora_quantize == "int8"
  assert lora.base_config(_qcfg()).lora_quantize == ""
  with pytest.raises(ConfigError, match=r"model\.lora\.quantize='int4' is not supported: use "
                                        r"'' .* or 'int8'\.$"):
    _qcfg().replace(lora_quantize="int4")
  with pytest.raises(ConfigError, match=r"model\.lora\.quantize='int8' .* needs LoRA: set "
                                        r"model\.lora\.rank > 0"):
    get_preset("tiny").replace(lora_quantize="int8")
  with pytest.raises(ConfigError, match=r"model\.lora\.quantize=8 has the wrong type"):
    lora_fields({"rank": 8, "quantize": 8})


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("name,shape", [("q", (64, 4, 16)), ("o", (4, 16, 64)),
                                        ("down", (96, 64))])
def test_quantize_error_bound_per_channel(name, shape):
  """One float32 scale per output channel, max |w| / 127 over the input axes; every element's
  dequantisation error is at most half its channel's scale, and an all-zero channel stays
  zero (scale 1, not a division by zero)."""
  in_axes = quant.IN_AXES[name]
  w = jax.random.normal(jax.random.key(0), shape) * jnp.linspace(0.01, 3.0, shape[-1])
  w = w.at[..., 0].set(0.0)  # an all-zero output channel
  values, scale = quant.quantize(w, in_axes=in_axes)
  assert values.dtype == jnp.int8 and values.shape == w.shape
  assert scale.dtype == jnp.float32 and scale.shape == (1,) * in_axes + shape[in_axes:]
  red = tuple(range(in_axes))
  absmax = jnp.max(jnp.abs(w), axis=red, keepdims=True)
  np.testing.assert_allclose(np.asarray(scale[..., 1:]), np.asarray(absmax / 127)[..., 1:],
                             rtol=1e-6)
  assert int(jnp.max(jnp.abs(values.astype(jnp.int32)))) == 127
  err = jnp.abs(quant.dequantize(values, scale, jnp.float32) - w)
  assert bool(jnp.all(err <= scale / 2 * (1 + 1e-5)))
  assert float(jnp.max(jnp.abs(quant.dequantize(values, scale, jnp.float32)[..., 0]))) == 0.0
  # The bound is tight enough to be a bound of int8 and not of a coarser grid.
  assert float(jnp.max(err / scale)) > 0.45


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen2", "tiny-llama3"])
def test_qlora_at_init_equals_the_dequantized_base_bitwise(preset):
  """B = 0: the QLoRA model's logits are, bit for bit, a plain model's over the dequantised
  weights; its int8 base is the quantisation of the plain model of the same seed, and every
  linear weight of every layer (adapted or not) is int8 with its scales beside it."""
  cfg = _qcfg(preset, targets=("q", "v"))
  g, p = _split(cfg)
  plain_cfg = lora.base_config(cfg)
  g0, p0 = _split(plain_cfg)
  leaves = _paths(p)
  for i in range(cfg.num_layers):
    for name in LORA_WEIGHTS:
      mod = "attn" if name in ("q", "k", "v", "o") else "mlp"
      w = leaves[f"layers/{i}/{mod}/{name}"]
      assert w.dtype == jnp.int8, name
      values, scale = quant.quantize(_paths(p0)[f"layers/{i}/{mod}/{name}"],
                                     in_axes=quant.IN_AXES[name])
      np.testing.assert_array_equal(np.asarray(w), np.asarray(values))
      np.testing.assert_array_equal(np.asarray(leaves[f"layers/{i}/{mod}/{name}_scale"]),
                                    np.asarray(scale))
  assert leaves["embed"].dtype == jnp.float32  # the embedding stays in the param dtype
  base = quant.dequantized_base(cfg, lora.split_lora(p)[0])
  assert jax.tree.structure(base) == jax.tree.structure(p0)
  toks = _tokens(cfg)
  got, want = FWD(g, p, toks), FWD(g0, base, toks)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # ... and close to the unquantised model's (int8's rounding, not a wrong weight).
  full = FWD(g0, p0, toks)
  rel = float(jnp.abs(got - full).max() / jnp.abs(full).max())
  assert 0 < rel < 0.05, rel


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qlora_adapters_and_merge(dtype):
  """With trained (random) B: the adapters' term is added to the dequantised weight's
  product, and merge_lora gives a plain model with the same logits (decode path included)."""
  cfg = _qcfg(dtype=dtype, param_dtype=dtype)
  g, p = _split(cfg)
  p = _randomise_b(p)
  g0 = abstract_model(lora.base_config(cfg))[0]
  merged = lora.merge_lora(cfg, p)
  assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(merged))
  toks = _tokens(cfg)
  got, want = FWD(g, p, toks), FWD(g0, merged, toks)
  off = FWD(g, lora.adapters_off(p), toks)
  assert float(jnp.abs(got - off).max()) > 1e-2  # the adapters do something
  tol = 2e-4 if dtype == "float32" else 0.1
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)


def test_gradients_reach_only_adapters():
  """The LoRA train step differentiates the adapters alone; the int8 base is a constant in it.
  Differentiating the base itself is refused by JAX (int8 has no gradient), so a path that
  tried would fail loudly rather than train it."""
  cfg = _qcfg()
  g, p = _split(cfg)
  p = _randomise_b(p)
  toks = _tokens(cfg, 4, 10)
  batch = {"inputs": toks, "targets": jnp.roll(toks, -1, 1),
           "positions": jnp.broadcast_to(jnp.arange(10), (4, 10))}
  base, adapters = lora.split_lora(p)

  def loss(ad):
    logp, _ = batch_logprobs(g, lora.combine(base, ad), batch, 1.0)
    return jnp.sum(logp)
  grads = jax.jit(jax.grad(loss))(adapters)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)
  assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(grads))
  with pytest.raises(TypeError, match="int8"):
    jax.grad(lambda b: jnp.sum(batch_logprobs(g, lora.combine(b, adapters), batch, 1.0)[0]))(
        base)


def test_frozen_base_bytes_are_int8(devices):
  """The param tree's base: every decoder linear weight int8 (1 byte a parameter) plus its
  scales; the plan's actor params count exactly that, and the reference adds only its own
  zero adapters (the base it reads is the same int8 tree)."""
  from jaxrl.parallel.plan import Workload, memory_plan, tree_bytes_per_device
  from jaxrl.parallel.sync import make_placement
  cfg = _qcfg("tiny", rank=8)
  lcfg = cfg.replace(lora_quantize="")
  _, shapes, axes = abstract_model(cfg)
  base = lora.split_lora(shapes)[0]
  linear = {k: x for k, x in _paths(base).items() if k.split("/")[-1] in LORA_WEIGHTS}
  scales = {k: x for k, x in _paths(base).items() if k.endswith(quant.SCALE)}
  assert len(linear) == len(scales) == cfg.num_layers * 7
  assert all(x.dtype == jnp.int8 for x in linear.values())
  n_linear = sum(int(np.prod(x.shape)) for x in linear.values())
  n_scales = sum(int(np.prod(x.shape)) for x in scales.values())
  placement = make_placement(ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1)))
  q = memory_plan(cfg, placement, workload=Workload(reference=True)).learner
  f = memory_plan(lcfg, placement, workload=Workload(reference=True)).learner
  # One device's share: fsdp=8 shards the weights 8 ways (the scales' channel axes too,
  # where they divide), the rest as the layout places it; the saving is the linear weights'
  # 3 of every 4 bytes less their scales.
  assert f["actor params"] - q["actor params"] == (
      tree_bytes_per_device(*(lora.split_lora(t)[0] for t in (abstract_model(lcfg)[1:])),
                            placement.learner)
      - tree_bytes_per_device(base, lora.split_lora(axes)[0], placement.learner))
  assert f["actor params"] - q["actor params"] > (3 * n_linear - 4 * n_scales) // 8 * 0.9
  assert q["reference params"] == f["reference params"] == q["actor gradients"]
  # The initialised state itself: what the learner's devices hold is int8.
  from jaxrl.parallel import init_params
  _, params = init_params(cfg, placement.learner.mesh, "learner", seed=0)
  got = {k: x for k, x in _paths(params).items() if k in linear}
  assert all(x.dtype == jnp.int8 for x in got.values())
  assert sum(x.nbytes for x in got.values()) == n_linear


# ----------------------------------------------------------------------------- sync


@pytest.mark.parametrize("lora_sampler", ["merge", "apply"])
def test_sync_moves_the_int8_base_once_and_sampler_logits_equal(devices, lora_sampler):
  """Colocated QLoRA sync: the first call moves the int8 base (values + scales) and the
  adapters, later ones the adapters alone. "merge" (the default) dequantises the very same
  int8 values and scales on the sampler and merges the adapters into a plain model of the
  param dtype; "apply" runs the QLoRA graph on the synced tree. Either way the sampler's
  logits equal the learner's (up to the merge's and the layouts' summation order)."""
  from jaxrl.parallel import init_params
  from jaxrl.parallel.sync import WeightSync, make_placement, placement_config, tree_bytes
  section = placement_config()
  section.sampler_mesh.tensor = 4
  placement = make_placement(dict(data=1, fsdp=-1, tensor=1), section)
  cfg = _qcfg()
  graphdef, params = init_params(cfg, placement.learner.mesh, "learner", seed=3)
  ws = WeightSync(cfg, placement, lora_sampler=lora_sampler)
  out = ws(params)
  assert ws.last.bytes == tree_bytes(params)  # int8 base + scales + adapters, once
  # (half the float32 model: the tiny model's embedding, a fifth of it, stays float32)
  assert ws.last.bytes < tree_bytes(lora.merge_lora(cfg, params)) * 0.5
  assert any(x.dtype == jnp.int8 for x in jax.tree.leaves(ws.base))
  ws.release(out)
  # The learner's adapters change (B drawn at random); its base arrays are the same ones.
  base, _ = lora.split_lora(params)
  adapters = jax.device_put(lora.split_lora(_randomise_b(jax.device_get(params)))[1],
                            lora.split_lora(placement.learner.model_shardings(cfg))[1])
  params = lora.combine(base, adapters)
  out = ws(params)
  assert ws.last.bytes == tree_bytes(lora.split_lora(params)[1])
  toks = _tokens(cfg, 2, 10)
  want = np.asarray(FWD(graphdef, params, toks))
  assert np.abs(want - np.asarray(FWD(graphdef, lora.adapters_off(params), toks))).max() > 1e-2
  got = np.asarray(FWD(abstract_model(ws.sampler_cfg)[0], out, toks))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- plan, runs


def test_qlora_grpo_plan_is_within_15_percent_of_xla_on_cpu(repo_root, devices):
  """The tiny QLoRA GRPO programs (rank 8 on every linear weight, int8 base), planned and
  compiled on 8 CPU devices: the run's peak and the train step's within 15% of XLA's
  memory_analysis(), the frozen base argument of the train step int8."""
  from jaxrl.parallel import compile as aot
  from jaxrl.parallel.plan import estimate
  from jaxrl.algorithms import grpo
  over = ["model.lora.rank=8", "model.lora.targets=all-linear", "model.lora.quantize=int8"]
  config = config_lib.load_config(f"{repo_root}/configs/grpo_tiny.py", over, grpo.CHOICES)
  _, programs = grpo.programs(config)
  estimates = [estimate(p) for p in programs]
  compiled = [aot.compile_program(p) for p in programs]
  plan, xla = aot.run_peaks(programs, estimates, compiled)
  assert abs(plan - xla) / xla < 0.15, (plan, xla)
  assert abs(estimates[0].program_peak - compiled[0].bytes) / compiled[0].bytes < 0.15
  _, frozen, _ = programs[0].args
  assert {x.dtype for k, x in _paths(frozen).items()
          if k.split("/")[-1] in LORA_WEIGHTS} == {jnp.dtype(jnp.int8)}


def test_ready_made_qlora_variants(repo_root):
  for spec in ("qwen3.py:8b,grpo,v5e", "llama3.py:3.1-8b,sft,v5p", "qwen2p5.py:7b"):
    lcfg = config_lib.model_config(config_lib.load_config(f"{repo_root}/configs/{spec},lora"))
    qcfg = config_lib.model_config(config_lib.load_config(f"{repo_root}/configs/{spec},qlora"))
    assert qcfg.lora_quantize == "int8" and lcfg.lora_quantize == ""
    assert qcfg.replace(lora_quantize="") == lcfg


@pytest.mark.slow
def test_qlora_grpo_runs_end_to_end_from_a_hf_checkpoint(repo_root, tmp_path, devices,
                                                         monkeypatch):
  """`jaxrl grpo --config configs/qwen3.py:fixture,qlora`: the HF fixture fills the base,
  quantised (its int8 values are the quantisation of the checkpoint's weights), and two steps
  run with finite losses, the int8 base after them bitwise as it started."""
  from jaxrl import cli
  from jaxrl.io.hf import load_hf
  from jaxrl.parallel import mesh_from_config
  from jaxrl.train import Checkpointer, init_train_state, make_optimizer
  from jaxrl.train.checkpoint import abstract_state
  monkeypatch.chdir(repo_root)
  spec = "configs/qwen3.py:fixture,qlora"
  over = ["train.steps=2", "eval.every=0", "train.save_every=2", "optim.lr=1e-2"]
  workdir = tmp_path / "grpo"
  cli.main(["grpo", "--config", spec, "--workdir", str(workdir),
            *[f"--config.{o}" for o in over]])
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))
          if '"loss"' in line]
  assert rows and all(np.isfinite(r["loss"]) for r in rows)
  config = config_lib.load_config(spec, over)
  cfg = config_lib.model_config(config)
  assert cfg.lora_quantize == "int8"
  mesh = mesh_from_config(config.mesh)
  tx, _ = make_optimizer(config.optim, config.train.steps)
  _, fresh, shardings = init_train_state(cfg, mesh, tx, seed=config.seed)
  ckpt = Checkpointer(str(workdir / "checkpoints"))
  state, _ = ckpt.restore(abstract_state(jax.eval_shape(lambda: fresh), shardings))
  ckpt.close()
  _, _, hf = load_hf(config.model.hf_path, mesh)
  want = jax.device_get(quant.quantize_params(cfg, hf))
  base, adapters = lora.split_lora(jax.device_get(state.params))
  for k, x in _paths(want).items():
    np.testing.assert_array_equal(np.asarray(_paths(base)[k]), np.asarray(x), err_msg=k)
  assert _paths(base)["layers/0/mlp/down"].dtype == jnp.int8
  # (Whether the adapters moved depends on the rewards of two steps of the fixture's random
  # policy, mostly zero: the LoRA learning test is the one that trains them.)
  assert adapters["layers"][0]["attn"]["q_lora"]["lora_a"].shape == (cfg.embed_dim, 16)


def test_qlora_exports_dequantized_base_and_merged_weights(devices, tmp_path):
  """`jaxrl convert jaxrl-to-hf` of a QLoRA checkpoint: --merge writes the plain model of the
  dequantised base plus B A; without it the PEFT adapter and, as its base, the dequantised
  weights the adapters trained against. Both give the QLoRA model's logits."""
  from jaxrl.io import hf, peft
  from jaxrl.io.params import save_params
  from jaxrl.parallel import make_mesh
  mesh = make_mesh(data=1, fsdp=2, tensor=4)
  fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf", "qwen3")
  plain_cfg, _, plain = hf.load_hf(fixture, mesh)
  cfg = plain_cfg.replace(lora_rank=4, lora_alpha=8.0, lora_targets=LORA_WEIGHTS,
                          lora_quantize="int8")
  g = abstract_model(cfg)[0]
  params = _randomise_b(lora.combine(
      jax.device_get(quant.quantize_params(cfg, plain)),
      lora.split_lora(jax.device_get(_split(cfg)[1]))[1]))
  save_params(str(tmp_path / "ckpt"), cfg, params)
  toks = _tokens(cfg, 2, 10)
  want = np.asarray(FWD(g, params, toks))
  merged_dir = str(tmp_path / "merged")
  hf.jaxrl_to_hf(str(tmp_path / "ckpt"), merged_dir, mesh, merge=True)
  mcfg, mg, mp = hf.load_hf(merged_dir, mesh)
  assert mcfg.lora_rank == 0 and not mcfg.lora_quantize
  np.testing.assert_allclose(np.asarray(FWD(mg, mp, toks)), want, atol=2e-4, rtol=2e-4)
  peft_dir = str(tmp_path / "peft")
  hf.jaxrl_to_hf(str(tmp_path / "ckpt"), peft_dir, mesh)
  bcfg, _, bp = hf.load_hf(os.path.join(peft_dir, "base"), mesh)
  deq = quant.dequantized_base(cfg, lora.split_lora(params)[0])
  for k, x in _paths(deq).items():
    np.testing.assert_array_equal(np.asarray(_paths(jax.device_get(bp))[k]), np.asarray(x))
  lcfg = cfg.replace(lora_quantize="")
  adapters = peft.load_peft(peft_dir, lcfg, mesh)
  got = FWD(abstract_model(lcfg)[0], lora.combine(bp, adapters), toks)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("sft_quantize", ["", "int8"])
def test_qlora_starts_from_a_plain_or_qlora_sft_run(repo_root, tmp_path, devices, monkeypatch,
                                                    sft_quantize):
  """init.checkpoint of a QLoRA run: a plain SFT run's weights, or a QLoRA SFT run's (its int8
  base dequantised and its adapters merged), quantised into this run's int8 base, in the
  learner's layout; this run's adapters keep their init (B = 0)."""
  from jaxrl import cli
  from jaxrl.parallel import mesh_from_config
  from jaxrl.train import init_train_state, make_optimizer
  from jaxrl.train.state import start_from_checkpoint
  monkeypatch.chdir(repo_root)
  spec = "configs/sft_tiny.py:runlocal"
  over = {"train.steps": 2, "train.save_every": 2, "eval.every": 0, "optim.lr": 1e-2}
  if sft_quantize:
    over.update({"model.lora.rank": 4, "model.lora.targets": "all-linear",
                 "model.lora.quantize": sft_quantize})
  sft_dir = tmp_path / "sft"
  cli.main(["sft", "--config", spec, "--workdir", str(sft_dir),
            *[f"--config.{k}={v}" for k, v in over.items()]])
  sft_config = config_lib.load_config(spec, [f"{k}={v}" for k, v in over.items()])
  sft_cfg = config_lib.model_config(sft_config)
  mesh = mesh_from_config(sft_config.mesh)
  tx, _ = make_optimizer(sft_config.optim, 2)
  from jaxrl.train import Checkpointer
  from jaxrl.train.checkpoint import abstract_state
  _, fresh, shd = init_train_state(sft_cfg, mesh, tx, seed=sft_config.seed)
  ckpt = Checkpointer(str(sft_dir / "checkpoints"))
  sft_state, _ = ckpt.restore(abstract_state(jax.eval_shape(lambda: fresh), shd))
  ckpt.close()
  want = quant.quantize_params(_qcfg("tiny"), lora.merge_lora(sft_cfg, jax.device_get(
      sft_state.params)) if sft_cfg.lora_rank else jax.device_get(sft_state.params))

  cfg = _qcfg("tiny", rank=8, alpha=16.0)
  _, state, shardings = init_train_state(cfg, mesh, tx, seed=1)
  state = start_from_checkpoint(cfg, state, str(sft_dir))
  base, adapters = lora.split_lora(state.params)
  got = _paths(base)
  assert set(got) == set(_paths(want))
  for k, x in _paths(want).items():
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(x), rtol=1e-6, atol=1e-7,
                               err_msg=k)
    assert got[k].dtype == x.dtype
  for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(shardings.params)):
    assert x.sharding.is_equivalent_to(s, x.ndim)
  assert not any(np.any(np.asarray(v)) for k, v in _paths(adapters).items()
                 if k.endswith("lora_b"))
