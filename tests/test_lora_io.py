"""LoRA adapters in and out (jaxrl.io.peft, `jaxrl convert jaxrl-to-hf [--merge]`) and the
adapter-only weight sync (jaxrl.parallel.sync).

tests/fixtures/make_peft_fixture.py made tests/fixtures/peft/ offline with torch, transformers
and peft: an adapter jaxrl exported and one PEFT saved itself, each with transformers + PEFT's
logits on the tiny Qwen3 of tests/fixtures/hf/qwen3. Everything runs on the 8-device mesh,
learner layout, fsdp 2 x tensor 4 (so adapters are sharded as their weights are).
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxrl.errors import ConfigError
from jaxrl.io import hf, peft
from jaxrl.io.params import save_params
from jaxrl.models import abstract_model, apply, lora
from jaxrl.models.config import LORA_WEIGHTS, lora_fields
from jaxrl.parallel import make_mesh

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
QWEN3 = os.path.join(FIXTURES, "hf", "qwen3")
PEFT = os.path.join(FIXTURES, "peft")
ADAPTERS = ("jaxrl_export", "peft_native")
FWD = jax.jit(lambda g, p, t: apply(g, p, t)[0], static_argnums=0)


@pytest.fixture(scope="module")
def mesh(devices):
  return make_mesh(data=1, fsdp=2, tensor=4)


@pytest.fixture(scope="module")
def base(mesh):
  """(cfg, params) of the Qwen3 fixture, LoRA off."""
  cfg, _, params = hf.load_hf(QWEN3, mesh)
  return cfg, params


def lora_cfg(cfg, path):
  """cfg with the model.lora section of the PEFT adapter at `path`."""
  return cfg.replace(**lora_fields(peft.peft_lora_section(path)))


def leaves_equal(a, b) -> bool:
  fa, fb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  return [p for p, _ in fa] == [p for p, _ in fb] and all(
      x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
      for (_, x), (_, y) in zip(fa, fb))


def random_adapters(cfg, mesh, seed=0):
  """cfg's adapter sub-tree, placed in the learner layout, A and B drawn at random (B is zero
  at init, which would hide a transposed or misplaced tensor)."""
  abstract, _ = peft.adapter_shardings(cfg, mesh)
  keys = iter(jax.random.split(jax.random.key(seed), 256))
  return jax.tree.map(lambda a: jax.device_put(
      0.2 * jax.random.normal(next(keys), a.shape, a.dtype), a.sharding), abstract)


def with_peft(base, path, mesh):
  """(cfg, graphdef, params): the fixture's base with the PEFT adapter at `path`."""
  cfg = lora_cfg(base[0], path)
  graphdef, _, _ = abstract_model(cfg)
  return cfg, graphdef, lora.combine(base[1], peft.load_peft(path, cfg, mesh))


# ----------------------------------------------------------------------------- PEFT parity


@pytest.mark.parametrize("name", ADAPTERS)
def test_logits_with_adapter_match_peft(mesh, base, name):
  """jaxrl with the adapter loaded gives transformers + PEFT's logits: an adapter jaxrl wrote
  (rank 4, all-linear) and one PEFT wrote (rank 2, rsLoRA, q, v, down)."""
  ref = np.load(os.path.join(PEFT, "reference.npz"))
  _, graphdef, params = with_peft(base, os.path.join(PEFT, name), mesh)
  logits = np.asarray(FWD(graphdef, params, jnp.asarray(ref["tokens"], jnp.int32)))
  diff = np.abs(logits - ref[name]).max()
  # fp32 on both sides, logits up to |60|: 2e-4 is a relative error of a few 1e-6.
  assert diff < 2e-4, f"{name}: max |logit diff| to PEFT {diff}"
  # The adapter matters: without it the logits are far from PEFT's.
  assert np.abs(ref[name] - ref["base"]).max() > 10.0


def test_peft_config_is_read_as_peft_means_it():
  section = peft.peft_lora_section(os.path.join(PEFT, "peft_native"))
  # use_rslora scales by alpha / sqrt(r): folded into alpha, so alpha / r is PEFT's scale.
  assert section == {"rank": 2, "alpha": pytest.approx(5 * 2**0.5), "dropout": 0.0,
                     "targets": "q,v,down"}
  conf = json.load(open(os.path.join(PEFT, "jaxrl_export", peft.PEFT_CONFIG)))
  assert (conf["peft_type"], conf["task_type"], conf["r"], conf["lora_alpha"]) == (
      "LORA", "CAUSAL_LM", 4, 8.0)
  assert conf["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"]


@pytest.mark.parametrize("name", ADAPTERS)
def test_peft_round_trip_is_bitwise(mesh, base, tmp_path, name):
  """import -> export gives PEFT's tensors back, bit for bit, and export -> import the same
  adapters."""
  src = os.path.join(PEFT, name)
  cfg, _, params = with_peft(base, src, mesh)
  peft.save_peft(str(tmp_path), cfg, params, base_model_name_or_path="b")
  mode = lambda f: os.stat(tmp_path / f).st_mode & 0o777  # noqa: E731
  assert mode(peft.PEFT_WEIGHTS) == mode(peft.PEFT_CONFIG)  # safetensors alone writes 0600
  theirs, ours = load_file(os.path.join(src, peft.PEFT_WEIGHTS)), load_file(
      str(tmp_path / peft.PEFT_WEIGHTS))
  assert sorted(theirs) == sorted(ours)
  assert all(np.array_equal(theirs[k], ours[k]) for k in theirs)
  again = peft.load_peft(str(tmp_path), cfg, mesh)
  assert leaves_equal(again, lora.split_lora(params)[1])


def test_export_then_import_equal_params(mesh, base, tmp_path):
  cfg = base[0].replace(lora_rank=3, lora_alpha=6.0, lora_targets=("q", "o", "up"))
  adapters = random_adapters(cfg, mesh)
  params = lora.combine(base[1], adapters)
  peft.save_peft(str(tmp_path), cfg, params)
  back = lora.combine(base[1], peft.load_peft(str(tmp_path), cfg, mesh))
  assert leaves_equal(back, params)
  # Placed as the learner layout places the adapters (sharded beside their weights).
  _, shardings = peft.adapter_shardings(cfg, mesh)
  got = lora.split_lora(back)[1]
  assert all(x.sharding == s for x, s in zip(jax.tree.leaves(got), jax.tree.leaves(shardings)))


def test_jaxrl_adapter_checkpoint_round_trips(mesh, base, tmp_path):
  cfg = base[0].replace(lora_rank=4, lora_alpha=8.0, lora_targets=LORA_WEIGHTS)
  adapters = random_adapters(cfg, mesh, seed=1)
  peft.save_adapters(str(tmp_path), cfg, lora.combine(base[1], adapters))
  assert not os.path.exists(tmp_path / "params")  # the adapters alone, not the base
  assert leaves_equal(peft.load_adapters(str(tmp_path), cfg, mesh), adapters)
  with pytest.raises(ConfigError, match=r"tensor layers\.0\.attn\.k_lora\.lora_a has shape "
                     r"\[64, 4\] there but \[64, 2\] in this model"):
    peft.load_adapters(str(tmp_path), cfg.replace(lora_rank=2), mesh)
  with pytest.raises(ConfigError, match=r"model.lora.alpha=8.0 but the config has 4.0"):
    peft.load_adapters(str(tmp_path), cfg.replace(lora_alpha=4.0), mesh)


# ----------------------------------------------------------------------------- bad adapters


def _copy(tmp_path, name="jaxrl_export"):
  dst = tmp_path / name
  shutil.copytree(os.path.join(PEFT, name), dst)
  return str(dst)


def _edit_config(path, **kw):
  file = os.path.join(path, peft.PEFT_CONFIG)
  conf = json.load(open(file))
  conf.update(kw)
  json.dump(conf, open(file, "w"))


def _edit_tensors(path, fn):
  file = os.path.join(path, peft.PEFT_WEIGHTS)
  tensors = load_file(file)
  fn(tensors)
  save_file(tensors, file)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_mismatched_rank_target_and_alpha_name_the_key(mesh, base, tmp_path):
  path = _copy(tmp_path)
  cfg = lora_cfg(base[0], path)
  file = os.path.join(path, peft.PEFT_CONFIG)
  with pytest.raises(ConfigError, match=rf"{file}: the adapter has rank 4 but model.lora.rank "
                     r"is 8: set --config.model.lora.rank=4"):
    peft.load_peft(path, cfg.replace(lora_rank=8), mesh)
  with pytest.raises(ConfigError, match=r"the adapter has targets 'q,k,v,o,gate,up,down' but "
                     r"model.lora.targets is 'q,k,v,o'"):
    peft.load_peft(path, cfg.replace(lora_targets=("q", "k", "v", "o")), mesh)
  with pytest.raises(ConfigError, match=r"the adapter has alpha 8.0 but model.lora.alpha is 2.0"):
    peft.load_peft(path, cfg.replace(lora_alpha=2.0), mesh)


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.update({Q_A: t[Q_A][:, :32]}),
     rf"tensor {Q_A} has shape \[4, 32\] but this model needs \[4, 64\]"),
    (lambda t: t.pop(Q_A), rf"tensor {Q_A} is missing"),
    (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": np.zeros((4, 64), np.float32)}),
     r"tensor base_model.model.lm_head.lora_A.weight has no place in this model's adapters"),
])
def test_bad_tensor_names_file_and_tensor(mesh, base, tmp_path, edit, words):
  path = _copy(tmp_path)
  _edit_tensors(path, edit)
  with pytest.raises(ConfigError, match=os.path.join(path, peft.PEFT_WEIGHTS) + ": " + words):
    peft.load_peft(path, lora_cfg(base[0], path), mesh)


@pytest.mark.parametrize("patch,words", [
    ({"peft_type": "IA3"}, r"peft_type is 'IA3'; jaxrl reads LORA adapters only"),
    ({"use_dora": True}, r"use_dora=True is not supported"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules names 'lm_head'"),
    ({"target_modules": ".*proj"}, r"target_modules='.\*proj' must be a list"),
    ({"r": 0}, r"r=0 must be a positive integer"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\] is not supported"),
])
def test_bad_adapter_config_is_one_sentence(tmp_path, patch, words):
  path = _copy(tmp_path)
  _edit_config(path, **patch)
  with pytest.raises(ConfigError, match=os.path.join(path, peft.PEFT_CONFIG) + ": " + words):
    peft.peft_lora_section(path)


def test_not_an_adapter_dir(tmp_path):
  with pytest.raises(ConfigError, match=r"holds no adapter_config.json: give a PEFT adapter"):
    peft.peft_lora_section(str(tmp_path))


# ----------------------------------------------------------------------------- convert


@pytest.fixture(scope="module")
def lora_checkpoint(mesh, base, tmp_path_factory):
  """A jaxrl checkpoint (save_params) of the fixture's base with the jaxrl_export adapter,
  carrying the HF import's config and tokenizer files in hf/ as hf-to-jaxrl does."""
  path = str(tmp_path_factory.mktemp("lora_ckpt"))
  cfg, _, params = with_peft(base, os.path.join(PEFT, "jaxrl_export"), mesh)
  save_params(path, cfg, params)
  os.makedirs(os.path.join(path, "hf"))
  for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(QWEN3, f), os.path.join(path, "hf", f))
  return path


def test_convert_merge_writes_full_weights(mesh, lora_checkpoint, tmp_path):
  """--merge: a plain HF checkpoint (no adapter tensors) whose logits are PEFT's."""
  out = str(tmp_path / "merged")
  files = hf.jaxrl_to_hf(lora_checkpoint, out, mesh, merge=True)
  assert "model.safetensors" in files and "adapter_config.json" not in files
  assert not any("lora" in k for k in load_file(os.path.join(out, "model.safetensors")))
  cfg, graphdef, params = hf.load_hf(out, mesh)
  assert cfg.lora_rank == 0
  ref = np.load(os.path.join(PEFT, "reference.npz"))
  logits = np.asarray(FWD(graphdef, params, jnp.asarray(ref["tokens"], jnp.int32)))
  assert np.abs(logits - ref["jaxrl_export"]).max() < 2e-4


def test_convert_lora_without_merge_writes_peft_and_base(mesh, base, lora_checkpoint, tmp_path):
  """Without --merge: the PEFT adapter in OUT, and (the checkpoint naming no HF base of its
  own) the base in OUT/base, which adapter_config.json names."""
  out = str(tmp_path / "peft")
  files = hf.jaxrl_to_hf(lora_checkpoint, out, mesh)
  assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json",
          os.path.join("base", "model.safetensors")} <= set(files)
  conf = json.load(open(os.path.join(out, peft.PEFT_CONFIG)))
  assert conf["base_model_name_or_path"] == os.path.join(os.path.abspath(out), "base")
  # The base there is the fixture's own weights, tensor for tensor.
  theirs, ours = load_file(os.path.join(QWEN3, "model.safetensors")), load_file(
      os.path.join(out, "base", "model.safetensors"))
  assert sorted(theirs) == sorted(ours) and all(np.array_equal(theirs[k], ours[k]) for k in ours)
  # And the adapter is the one the checkpoint holds.
  src = load_file(os.path.join(PEFT, "jaxrl_export", peft.PEFT_WEIGHTS))
  got = load_file(os.path.join(out, peft.PEFT_WEIGHTS))
  assert sorted(src) == sorted(got) and all(np.array_equal(src[k], got[k]) for k in got)


def test_merge_of_a_plain_checkpoint_is_refused(mesh, base, tmp_path):
  save_params(str(tmp_path / "plain"), *base)
  with pytest.raises(ConfigError, match=r"--merge: .* has no LoRA adapters .*drop --merge"):
    hf.jaxrl_to_hf(str(tmp_path / "plain"), str(tmp_path / "out"), mesh, merge=True)


# ----------------------------------------------------------------------------- adapter-only sync


def _placement(mode):
  from jaxrl.parallel.sync import make_placement, placement_config
  section = placement_config()
  section.mode = mode
  section.sampler_mesh.tensor = 4  # colocated: data=2 x tensor=4; disaggregated: tensor=4
  if mode == "disaggregated":
    section.learner_devices = 4
  return make_placement(dict(data=1, fsdp=-1, tensor=1), section)


def test_colocated_merge_takes_a_sampler_mesh_in_another_device_order(devices):
  """On a 3-D TPU slice a colocated learner and sampler mesh of different shapes list the same
  chips in different orders (v5p-8: the learner's fsdp=4 ring is 0, 2, 1, 3, the sampler's 2x2
  0, 1, 2, 3), and jit refuses one program over both ("incompatible devices"). CPU devices keep
  their order, so the sampler mesh is built here over the devices reversed: the merge sync
  then moves the adapters into the sampler's order first, and its weights equal those of the
  same-order placement."""
  import dataclasses
  from jaxrl.models import get_preset
  from jaxrl.parallel import init_params
  from jaxrl.parallel import sync as sync_lib
  same = _placement("colocated")
  sampler = same.sampler.mesh
  reversed_mesh = jax.sharding.Mesh(sampler.devices.reshape(-1)[::-1].reshape(
      sampler.devices.shape), sampler.axis_names, axis_types=sampler.axis_types)
  other = dataclasses.replace(same, sampler=dataclasses.replace(same.sampler, mesh=reversed_mesh))
  cfg = get_preset("tiny-qwen3").replace(lora_rank=4, lora_alpha=8.0, lora_targets=LORA_WEIGHTS)
  _, params = init_params(cfg, same.learner.mesh, "learner", seed=3)
  # Non-zero adapters (lora_b starts at zero), so the merge changes the weights.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.01 if "lora_b" in jax.tree_util.keystr(path) else x, params)
  expected = jax.device_get(sync_lib.WeightSync(cfg, same, lora_sampler="merge")(params))
  out = sync_lib.WeightSync(cfg, other, lora_sampler="merge")(params)
  assert all(x.sharding.mesh.devices.flat[0] == reversed_mesh.devices.flat[0]
             for x in jax.tree.leaves(out))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(out), expected)


@pytest.mark.parametrize("mode,lora_sampler", [("colocated", "merge"), ("disaggregated", "merge"),
                                               ("colocated", "apply")])
def test_adapter_only_sync_moves_adapter_bytes_and_sampler_logits_equal(devices, monkeypatch,
                                                                         mode, lora_sampler):
  """With LoRA, the first sync moves the base and the adapters, every later one the adapters
  alone (counted at the transfer itself); the sampler's logits then equal the learner's,
  whether it merges the adapters into its base copy or applies them at decode time."""
  from jaxrl.models import get_preset
  from jaxrl.parallel import init_params
  from jaxrl.parallel import sync as sync_lib
  placement = _placement(mode)
  cfg = get_preset("tiny-qwen3").replace(lora_rank=4, lora_alpha=8.0, lora_targets=LORA_WEIGHTS)
  graphdef, params = init_params(cfg, placement.learner.mesh, "learner", seed=3)
  moved = []
  real_sync = sync_lib.sync
  monkeypatch.setattr(sync_lib, "sync", lambda tree, *a, **k: (
      moved.append(sync_lib.tree_bytes(tree)), real_sync(tree, *a, **k))[1])
  ws = sync_lib.WeightSync(cfg, placement, lora_sampler=lora_sampler)
  assert ws.adapters_only
  merge = lora_sampler == "merge"
  assert ws.sampler_cfg == (lora.base_config(cfg) if merge else cfg)
  sampler_graphdef = abstract_model(ws.sampler_cfg)[0]
  if merge:
    # Colocated, the merge program takes the learner's adapters as they are (XLA moves them
    # inside it): count what enters it from the learner's layout, and check its base argument
    # is the sampler's own copy.
    adapter_target = lora.split_lora(ws.target)[1]
    real_merge = ws._merge

    def counting_merge(b, a):
      assert b is ws.base
      if not all(x.sharding.is_equivalent_to(t, x.ndim)
                 for x, t in zip(jax.tree.leaves(a), jax.tree.leaves(adapter_target))):
        moved.append(sync_lib.tree_bytes(a))
      return real_merge(b, a)
    ws._merge = counting_merge
  copy = sync_lib.SamplerCopy(ws, keep=False)
  copy.refresh(params)
  assert sum(moved) == ws.last.bytes == cfg.num_params * 4  # base + adapters, once
  base_s = ws.base
  copy.before_update()  # releases what the sync made, never the base copy
  assert not any(x.is_deleted() for x in jax.tree.leaves(base_s))
  adapter_bytes = cfg.num_lora_params * 4
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, cfg.vocab_size)
  on_sampler = jax.device_put(tokens, jax.sharding.NamedSharding(
      placement.sampler.mesh, jax.sharding.PartitionSpec()))
  for step in range(2):  # the learner's adapters change; its base does not
    base, adapters = lora.split_lora(params)
    params = lora.combine(base, random_adapters(cfg, placement.learner.mesh, seed=10 + step))
    moved.clear()
    out = copy.refresh(params)
    assert moved == [adapter_bytes] and ws.last.bytes == adapter_bytes
    assert ws.last.bytes < cfg.num_params * 4 / 4  # a small share of the model
    assert ws.base is base_s  # the base copy, kept
    target = lora.split_lora(ws.target)[0] if merge else ws.target
    assert jax.tree.structure(out) == jax.tree.structure(target)
    for x, t in zip(jax.tree.leaves(out), jax.tree.leaves(target)):
      assert x.sharding.is_equivalent_to(t, x.ndim)
    if not merge:  # bitwise what a full sync of the same params gives
      full = real_sync(params, ws.target)
      assert leaves_equal(out, full)
      sync_lib.release(full)
    got = np.asarray(FWD(sampler_graphdef, out, on_sampler))
    # The learner's logits, up to the layouts' summation order (and the merge's rounding).
    want = np.asarray(FWD(graphdef, params, tokens))
    assert np.abs(want - np.asarray(FWD(graphdef, lora.adapters_off(params), tokens))).max() > 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    copy.before_update()
    assert not any(x.is_deleted() for x in jax.tree.leaves(base_s))


def test_adapter_only_sync_resyncs_a_new_base(colocated_lora):
  """If the learner's base arrays are ever other ones, the base moves again (never a stale
  base on the sampler)."""
  cfg, placement, params = colocated_lora
  from jaxrl.parallel.sync import WeightSync
  ws = WeightSync(cfg, placement)
  ws(params)
  ws(params)
  assert ws.last.bytes == cfg.num_lora_params * 4
  base, adapters = lora.split_lora(params)
  moved_base = lora.combine(jax.tree.map(lambda x: x + 1, base), adapters)
  out = ws(moved_base)
  assert ws.last.bytes == cfg.num_params * 4
  np.testing.assert_array_equal(np.asarray(out["embed"]), np.asarray(base["embed"]) + 1)


@pytest.fixture
def colocated_lora(devices):
  from jaxrl.models import get_preset
  from jaxrl.parallel import init_params
  placement = _placement("colocated")
  cfg = get_preset("tiny").replace(lora_rank=2, lora_alpha=4.0, lora_targets=("q", "v"))
  _, params = init_params(cfg, placement.learner.mesh, "learner")
  return cfg, placement, params


def test_full_sync_is_kept_without_lora_and_refused_when_asked_for_adapters(colocated_lora):
  from jaxrl.models import get_preset
  from jaxrl.parallel.sync import WeightSync
  cfg, placement, params = colocated_lora
  ws = WeightSync(cfg, placement, adapters_only=False)
  ws(params)
  assert ws.last.bytes == cfg.num_params * 4
  with pytest.raises(ConfigError, match="adapter-only weight sync needs LoRA adapters"):
    WeightSync(get_preset("tiny"), placement, adapters_only=True)


def test_convert_cli_says_what_it_wrote(lora_checkpoint, tmp_path, capsys):
  from jaxrl import cli
  out = str(tmp_path / "cli")
  cli.main(["convert", "jaxrl-to-hf", "--checkpoint", lora_checkpoint, "--out", out])
  said = capsys.readouterr().out
  assert "PEFT LoRA adapter: r=4, lora_alpha=8.0" in said and "rerun with --merge" in said
  assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))
  cli.main(["convert", "jaxrl-to-hf", "--checkpoint", lora_checkpoint, "--out", out + "-m",
            "--merge"])
  assert "family qwen3" in capsys.readouterr().out
  assert os.path.isfile(os.path.join(out + "-m", "model.safetensors"))


def test_a_run_names_its_hf_base_only_when_unchanged():
  """What a LoRA run's PEFT export names as its base (jaxrl_to_hf on a run directory)."""
  import ml_collections
  run = lambda **kw: ml_collections.ConfigDict(  # noqa: E731
      {"model": {"hf_path": kw.get("hf", "")}, "init": {"checkpoint": kw.get("init", "")}})
  assert hf.frozen_base_path(run(hf="ckpt/qwen3")) == os.path.abspath("ckpt/qwen3")
  assert hf.frozen_base_path(run(hf="ckpt/qwen3", init="runs/sft")) == ""  # adapters merged in
  assert hf.frozen_base_path(run()) == ""  # a preset's random base: written to OUT/base


@pytest.mark.slow
def test_lora_grpo_syncs_adapters_only_sync_and_async(repo_root, tmp_path, devices):
  """GRPO with LoRA, disaggregated, synchronous and with async generation: sync/ms and
  sync/gb_per_s say the first step moved the whole model and every later step the adapters
  alone; with the weights frozen (lr 1e-30) the async run's rewards are the synchronous run's,
  step by step (the merged sampler copy is never released while a rollout uses it)."""
  from jaxrl import config as config_lib
  from jaxrl.algorithms.grpo import trainer as grpo
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  common = ["train.steps=3", "optim.lr=1e-30", "eval.every=0", "placement.mode=disaggregated",
            "model.lora.rank=4", "model.lora.targets=all-linear"]
  rows = {}
  for name, extra in (("sync", []), ("async", ["rollout.async_generation=True"])):
    config = config_lib.load_config(spec, common + extra)
    workdir = str(tmp_path / name)
    grpo.run(config, workdir, out=lambda *a: None)
    rows[name] = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))
                  if "reward/mean" in line]
  cfg = config_lib.model_config(config)
  for name, got in rows.items():
    moved = [r["sync/gb_per_s"] * r["sync/ms"] * 1e6 for r in got]  # bytes
    assert moved[0] == pytest.approx(cfg.num_params * 4, rel=1e-6), name
    assert moved[1:] == pytest.approx([cfg.num_lora_params * 4] * 2, rel=1e-6), name
  for s, a in zip(rows["sync"], rows["async"]):
    assert a["reward/mean"] == pytest.approx(s["reward/mean"], rel=1e-5)
