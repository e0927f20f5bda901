"""Layers under scan (model.scan_layers): the stacked model computes what the unrolled one does.

Each family's HF fixture is read both ways. The scanned params are the unrolled ones stacked
(jaxrl.models.llama.stack_layers), its logits and greedy decode match transformers' as the
unrolled model's do, its gradients equal the unrolled model's to float rounding, and it writes
the same HF and PEFT tensors back. Everything runs on the 8-device mesh, learner layout,
fsdp 2 x tensor 4, so the stacked leaves are sharded as their layers are.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxrl.io import hf, peft
from jaxrl.models import PRESETS, abstract_model, init_cache, lora, quant
from jaxrl.models import llama
from jaxrl.models.config import lora_fields
from jaxrl.parallel import cache_sharding, make_mesh, param_shardings, plan
from jaxrl.sampler import Engine, SamplingParams, generate
# The HF fixtures' helpers, and their mesh (learner layout, fsdp 2 x tensor 4).
from test_hf import FAMILIES, FWD, fixture, hf_tensors, leaves_equal as same, mesh  # noqa: F401

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


@pytest.fixture(scope="module")
def loaded(mesh):
  """family -> ((cfg, graphdef, params) unrolled, the same scanned), from the HF fixture."""
  out = {}
  for name in FAMILIES:
    cfg, graphdef, params = hf.load_hf(fixture(name), mesh)
    scfg = cfg.replace(scan_layers=True)
    out[name] = ((cfg, graphdef, params), hf.load_hf(fixture(name), mesh, cfg=scfg))
  return out


def test_scanned_params_are_the_layers_stacked_in_their_layout(mesh, loaded):
  for name in FAMILIES:
    (cfg, _, params), (scfg, _, sparams) = loaded[name]
    assert same(sparams, llama.stack_layers(params)), name
    assert same(llama.unstack_layers(sparams, cfg.num_layers), params), name
    q = sparams["layers"]["attn"]["q"]
    assert q.shape == (cfg.num_layers, *params["layers"][0]["attn"]["q"].shape)
    _, _, axes = abstract_model(scfg)
    assert axes["layers"]["attn"]["q"] == ("layers", "embed", "heads", "head_dim")
    want = param_shardings(scfg, mesh, "learner")
    assert all(jax.tree.leaves(jax.tree.map(
        lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), sparams, want)))


@pytest.mark.parametrize("name", FAMILIES)
def test_scanned_logits_and_greedy_decode_match_transformers(mesh, loaded, name):
  (cfg, graphdef, params), (scfg, sgraphdef, sparams) = loaded[name]
  ref = np.load(os.path.join(fixture(name), "reference.npz"))
  tokens = jnp.asarray(ref["tokens"], jnp.int32)
  logits = np.asarray(FWD(sgraphdef, sparams, tokens)[0])
  assert np.abs(logits - ref["logits"]).max() < 1e-4
  assert np.abs(logits - np.asarray(FWD(graphdef, params, tokens)[0])).max() < 1e-5
  # The sampler's path: prefill into a per-layer cache, then cached one-token steps.
  prompt, want = ref["prompt"].astype(np.int32), ref["greedy"]
  B, P = prompt.shape
  S = P + want.shape[1]
  cache = jax.device_put(init_cache(scfg, B, S),
                         [cache_sharding(mesh, scfg, B, S)] * scfg.num_layers)
  logits, cache = FWD(sgraphdef, sparams, jnp.asarray(prompt),
                      jnp.broadcast_to(jnp.arange(P), (B, P)), cache=cache)
  out = []
  tok = np.asarray(logits)[:, -1].argmax(-1)
  for i in range(want.shape[1]):
    out.append(tok)
    logits, cache = FWD(sgraphdef, sparams, jnp.asarray(tok[:, None], jnp.int32),
                        jnp.full((B, 1), P + i), cache=cache)
    tok = np.asarray(logits)[:, -1].argmax(-1)
  np.testing.assert_array_equal(np.stack(out, 1), want)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_learner_forwards_and_gradients_equal_the_unrolled(loaded, remat):
  """The learner's three forwards (full sequence, a GRPO group's shared prompt, packed rows)
  and the gradient of a log-prob loss through each, scanned against unrolled, with the LoRA
  dropout's per-layer keys (fold_in of the layer index, traced under scan)."""
  (cfg, _, params), _ = loaded["qwen3"]
  cfg = cfg.replace(remat=remat)
  scfg = cfg.replace(scan_layers=True)
  graphdef, sgraphdef = abstract_model(cfg)[0], abstract_model(scfg)[0]
  rng = np.random.default_rng(0)
  P, G, Tp, Tc = 2, 2, 5, 4
  prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (P, Tp)), jnp.int32)
  plen = jnp.asarray([5, 3], jnp.int32)
  comp = jnp.asarray(rng.integers(1, cfg.vocab_size, (P * G, Tc)), jnp.int32)
  targets = jnp.roll(comp, -1, axis=1)

  def losses(g, p):
    m = nnx.merge(g, p)
    full = m.token_logprobs(m.hidden(comp)[0], targets)[0].sum()
    grouped = m.token_logprobs(m.grouped_hidden(prompt, plen, comp), comp)[0].sum()
    offsets = jnp.broadcast_to(jnp.arange(Tc), (P * G, Tc))
    segments = jnp.ones((P * G, Tc), jnp.int32)
    _, h = m.packed_hidden(prompt, plen, comp, offsets, segments,
                           jnp.repeat(jnp.arange(P), G))
    packed = m.token_logprobs(h, targets)[0].sum()
    return full + grouped + packed, (full, grouped, packed)

  grad = jax.jit(jax.grad(losses, argnums=1, has_aux=True), static_argnums=0)
  g_u, v_u = grad(graphdef, params)
  g_s, v_s = grad(sgraphdef, llama.stack_layers(params))
  np.testing.assert_allclose(np.asarray(v_s), np.asarray(v_u), rtol=1e-6)
  g_s = llama.unstack_layers(g_s, cfg.num_layers)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_u), jax.tree.leaves(g_s)):
    scale = float(jnp.abs(a).max()) + 1e-6
    assert float(jnp.abs(a - b).max()) <= 1e-5 * scale, jax.tree_util.keystr(path)


def test_scanned_export_writes_the_fixtures_tensors_bit_for_bit(tmp_path, loaded):
  for name in FAMILIES:
    _, (scfg, _, sparams) = loaded[name]
    hf.save_hf(str(tmp_path / name), scfg, sparams, max_shard_bytes=150_000)
    original, exported = hf_tensors(fixture(name)), hf_tensors(str(tmp_path / name))
    assert sorted(original) == sorted(exported), name
    assert all(np.array_equal(original[k], exported[k]) for k in original), name


def test_scanned_lora_reads_and_writes_peft_adapters_as_the_unrolled(mesh, loaded, tmp_path):
  """A PEFT adapter (the committed jaxrl export, rank 4 on every linear weight) loaded into
  the scanned model: its logits equal the unrolled model's, and it exports the same tensors."""
  src = os.path.join(FIXTURES, "peft", "jaxrl_export")
  (cfg, _, params), (scfg, _, sparams) = loaded["qwen3"]
  section = lora_fields(peft.peft_lora_section(src))
  cfg, scfg = cfg.replace(**section), scfg.replace(**section)
  unrolled = lora.combine(params, peft.load_peft(src, cfg, mesh))
  scanned = lora.combine(sparams, peft.load_peft(src, scfg, mesh))
  assert same(scanned, llama.stack_layers(unrolled))
  tokens = jnp.asarray(np.load(os.path.join(FIXTURES, "peft", "reference.npz"))["tokens"],
                       jnp.int32)
  a = FWD(abstract_model(cfg)[0], unrolled, tokens)[0]
  b = FWD(abstract_model(scfg)[0], scanned, tokens)[0]
  assert float(jnp.abs(a - b).max()) < 1e-5
  peft.save_peft(str(tmp_path), scfg, scanned)
  theirs, ours = (load_file(os.path.join(d, peft.PEFT_WEIGHTS)) for d in (src, str(tmp_path)))
  assert sorted(theirs) == sorted(ours) and all(np.array_equal(theirs[k], ours[k]) for k in theirs)


def test_scanned_init_builds_lora_and_the_int8_base_per_layer():
  """A scanned LoRA + int8 model's init: adapters and scales stacked with the "layers" axis,
  every layer its own draw, and quantize_params of the stacked plain weights equal to the
  per-layer quantisation stacked."""
  cfg = PRESETS["tiny-qwen3"].replace(lora_rank=4, lora_targets=("q", "down"),
                                      lora_quantize="int8", scan_layers=True)
  _, shapes, axes = abstract_model(cfg)
  L = cfg.num_layers
  assert shapes["layers"]["attn"]["q_lora"]["lora_a"].shape[0] == L
  assert axes["layers"]["attn"]["q_scale"][0] == "layers"
  assert shapes["layers"]["attn"]["q"].dtype == jnp.int8
  state = nnx.to_pure_dict(nnx.state(llama.Transformer(cfg, rngs=nnx.Rngs(params=0))))
  q = state["layers"]["attn"]["q"]
  assert not np.array_equal(np.asarray(q[0]), np.asarray(q[1]))  # each layer its own draw
  plain = PRESETS["tiny-qwen3"]
  p = nnx.to_pure_dict(nnx.state(llama.Transformer(plain, rngs=nnx.Rngs(params=1))))
  qcfg = plain.replace(lora_rank=4, lora_targets=("q",), lora_quantize="int8")
  per_layer = quant.quantize_params(qcfg, p)
  stacked = quant.quantize_params(qcfg.replace(scan_layers=True), llama.stack_layers(p))
  assert same(stacked, llama.stack_layers(per_layer))


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_the_sampler_generates_the_same_tokens_from_scanned_params(loaded, kv_cache):
  """The engine's rollouts (prefill, insert, decode steps) and their log-probs, scanned or
  unrolled, on the TPU layout of the q, k and v weights too (heads-major, made per sync)."""
  (cfg, graphdef, params), (scfg, sgraphdef, sparams) = loaded["llama"]
  assert same(llama.heads_major_projections(sparams),
              llama.stack_layers(llama.heads_major_projections(params)))
  smesh = make_mesh(data=2, fsdp=1, tensor=4)
  prompts = [[1, 5, 9, 13], [2, 4], [7, 7, 7]]
  sp = SamplingParams(temperature=1.0, max_new_tokens=8, eos_id=None)
  outs = []
  for c, g, p in ((cfg, graphdef, params), (scfg, sgraphdef, sparams)):
    engine = Engine(g, c, smesh, sampling=sp)
    p = jax.device_put(p, param_shardings(c, smesh, "sampler"))
    outs.append(generate(engine, p, prompts, n=2, slots=4, seed=3, kv_cache=kv_cache))
  a, b = outs
  np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_the_plan_counts_a_scanned_model_as_the_unrolled(loaded):
  (cfg, _, params), (_, _, sparams) = loaded["qwen2"]
  assert plan.gathered_bytes(sparams) == plan.gathered_bytes(params)


def test_a_checkpoint_restores_only_into_its_own_layer_form(loaded):
  from jaxrl.errors import ConfigError
  from jaxrl.io.params import check_structure
  (_, _, params), (_, _, sparams) = loaded["qwen2"]
  with pytest.raises(ConfigError, match=r"saved one by one \(model.scan_layers=False\) but this "
                     r"model has scan_layers=True: set --config.model.scan_layers=False"):
    check_structure(params, sparams, where="init.checkpoint='runs/sft'", fix="")
  with pytest.raises(ConfigError, match=r"set --config.model.scan_layers=True"):
    check_structure(sparams, params, where="init.checkpoint='runs/sft'", fix="")


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
@pytest.mark.parametrize("lora_kind", ["", "lora", "qlora"])
def test_the_weight_sync_gives_the_sampler_the_unrolled_models_weights(devices, mode, lora_kind):
  """A scanned learner's sampler runs the layers one by one: every sync (bf16, adapters only
  with LoRA, merged on the sampler) gives the very arrays the unrolled learner's sync gives."""
  from jaxrl.parallel import init_params
  from jaxrl.parallel.sync import WeightSync, make_placement, placement_config
  section = placement_config()
  section.mode = mode
  placement = make_placement({"data": 1, "fsdp": -1, "tensor": 1}, section)
  cfg = PRESETS["tiny-qwen3"]
  if lora_kind:
    cfg = cfg.replace(lora_rank=4, lora_targets=("q", "v", "down"),
                      lora_quantize="int8" if lora_kind == "qlora" else "")
  _, params = init_params(cfg, placement.learner.mesh)
  # Adapters away from zero (B starts at zero, which would hide a misplaced layer).
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.01 * (1 + jnp.arange(x.size).reshape(x.shape) % 7)
      if lora.is_lora_path(p) else x, params)
  scfg = cfg.replace(scan_layers=True)
  sparams = jax.device_put(llama.stack_layers(params), param_shardings(
      scfg, placement.learner.mesh, "learner"))
  outs = []
  for c, p in ((cfg, params), (scfg, sparams)):
    ws = WeightSync(c, placement, dtype="bfloat16")
    assert not ws.sampler_cfg.scan_layers
    outs.append([ws(p), ws.to_sampler(p)])
    outs[-1].append(ws(p))  # a second step: adapters only, the sampler's base copy kept
  for a, b in zip(*outs):
    assert same(a, b)


def test_a_run_of_the_other_layer_form_restores_converted(mesh):
  """restore_params reads a run's checkpoint of either form into either model: the committed
  calculator warm start (the tiny preset, unrolled) into the scanned model is its layers
  stacked, in the scanned model's layout."""
  from jaxrl.io.params import restore_params
  run = os.path.join(FIXTURES, "calculator_sft")

  def target(cfg):
    _, shapes, _ = abstract_model(cfg)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, param_shardings(cfg, mesh, "learner"))
  cfg = PRESETS["tiny"]
  unrolled = restore_params(run, target(cfg))
  scanned = restore_params(run, target(cfg.replace(scan_layers=True)))
  assert same(scanned, llama.stack_layers(unrolled))
  want = param_shardings(cfg.replace(scan_layers=True), mesh, "learner")
  assert all(jax.tree.leaves(jax.tree.map(
      lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), scanned, want)))


@pytest.mark.parametrize("row", ["qwen3:0.6b,grpo,v5e", "qwen3:0.6b,grpo,v5e,qlora"])
def test_a_real_size_plan_is_the_same_scanned(repo_root, row):
  """Every program of a real-size GRPO row (abstract TPU devices, as `jaxrl plan` plans it)
  has the unrolled model's estimate, the weight sync (which unstacks) included."""
  import sys
  from jaxrl.parallel import compile as aot
  from jaxrl.parallel.plan import estimate
  sys.path.insert(0, os.path.join(repo_root, "benchmarks"))
  import scale
  peaks = []
  for scan in (False, True):
    config, module, chip = scale.load(row)
    config.model.scan_layers = scan
    _, programs = module.programs(config, devices=aot.topology_devices(scale.TOPOLOGY[chip]))
    peaks.append([(p.name, estimate(p).program_peak) for p in programs])
  assert peaks[0] == peaks[1] and len(peaks[0]) == 5


@pytest.mark.parametrize("spec", ["sft_tiny.py", "rm_tiny.py:logprob", "dpo_tiny.py",
                                  "grpo_tiny.py", "ppo_tiny.py"])
def test_every_trainers_tiny_plan_is_the_same_scanned(repo_root, devices, spec):
  """Every program of each trainer's tiny config on the 8 devices (rows split 8 ways) has the
  unrolled model's estimate. The tiny preset's 2 blocks are traced whole, not extrapolated:
  before plan.residual_bytes traced a scanned model block by block, the scan's residuals
  ([layers, rows, ...]) were not split by rows, and the SFT train step planned 22.02 MiB per
  device scanned against 5.98 unrolled (XLA: 4.98 and 5.97)."""
  from jaxrl import config as config_lib
  from jaxrl.cli import trainer
  from jaxrl.parallel.plan import estimate
  from jaxrl.train.rundir import infer_command
  path = os.path.join(repo_root, "configs", spec)
  module = trainer(infer_command(config_lib.load_config(path).to_dict()))
  peaks = []
  for scan in (False, True):
    config = config_lib.load_config(path, [f"model.scan_layers={scan}"], module.CHOICES)
    _, programs = module.programs(config)
    peaks.append([(p.name, estimate(p).program_peak) for p in programs])
  assert peaks[0] == peaks[1]


def test_a_scanned_grpo_run_logs_the_unrolled_runs_figures(repo_root, tmp_path, devices):
  """A GRPO pulse (configs/grpo_tiny.py:runlocal, 2 steps, held-out greedy accuracy and
  pass@k from the sampler's engine) scanned and unrolled: the same rewards, losses and evals
  (the scanned backward sums in another order: float rounding)."""
  import json
  from jaxrl import config as config_lib
  from jaxrl.algorithms import grpo
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  rows = []
  for scan in (False, True):
    overrides = ["train.steps=2", "eval.every=2", "eval.n=2", "eval.k=(1, 2)",
                 f"model.scan_layers={scan}"]
    workdir = str(tmp_path / str(scan))
    grpo.run(config_lib.load_config(spec, overrides), workdir, out=lambda *a: None)
    rows.append([json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))])
  assert len(rows[0]) == len(rows[1]) and any("eval/pass@2" in r for r in rows[1])
  for a, b in zip(*rows):
    for key in ("reward/mean", "loss", "kl", "eval/accuracy", "eval/pass@2", "eval/mean@2"):
      if key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
