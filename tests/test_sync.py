"""Learner -> sampler weight sync: values, layouts, placements, memory, donation, the plan."""

import gc

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from jaxrl.errors import ConfigError
from jaxrl.models import apply, get_preset, init_cache
from jaxrl.parallel import cache_sharding, init_params
from jaxrl.parallel import sync as sync_lib
from jaxrl.parallel.plan import Workload, memory_plan, plan_config
from jaxrl.parallel.sync import (HostReshard, Overlap, SamplerCopy, WeightSync, host_pool_bytes,
                                 live_bytes, make_placement, placement_config, release, sync)
from jaxrl.train.state import init_train_state

MESH_FSDP8 = dict(data=1, fsdp=-1, tensor=1)


def _placement(mode, **kw):
  section = placement_config()
  section.mode = mode
  section.sampler_mesh.tensor = 4  # colocated: data=2 x tensor=4; disaggregated: tensor=4
  if mode == "disaggregated":
    section.learner_devices = 4
  for k, v in kw.items():
    section[k] = v
  return make_placement(MESH_FSDP8, section)


@pytest.fixture(scope="module")
def colocated(devices):
  return _placement("colocated")


@pytest.fixture(scope="module")
def disaggregated(devices):
  return _placement("disaggregated")


def test_layout_pairs(colocated, disaggregated):
  assert dict(colocated.learner.mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
  assert dict(colocated.sampler.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
  assert set(colocated.learner.mesh.devices.flat) == set(colocated.sampler.mesh.devices.flat)
  L, S = disaggregated.learner.mesh, disaggregated.sampler.mesh
  assert dict(L.shape) == {"data": 1, "fsdp": 4, "tensor": 1}
  assert dict(S.shape) == {"data": 1, "fsdp": 1, "tensor": 4}
  assert not set(L.devices.flat) & set(S.devices.flat)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_sync_values_and_shardings(mode):
  placement = _placement(mode)
  cfg = get_preset("tiny-qwen3")
  _, params = init_params(cfg, placement.learner.mesh, "learner", seed=3)
  ws = WeightSync(cfg, placement)
  out = ws(params)
  target = placement.sampler.model_shardings(cfg)
  for a, b, t in zip(jax.tree.leaves(params), jax.tree.leaves(out), jax.tree.leaves(target)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # exact
    assert b.sharding.is_equivalent_to(t, b.ndim)
    assert b.sharding.device_set == set(placement.sampler.mesh.devices.flat)
  m = ws.last.metrics()
  assert m["sync/ms"] > 0 and m["sync/gb_per_s"] > 0
  assert ws.last.bytes == cfg.num_params * 4


def test_sync_hands_the_engine_its_decode_form(colocated):
  """WeightSync.prepare (the GRPO trainer sets Engine.decode_params): with the TPU's form
  forced on, each layer's q, k and v arrive heads-major [heads, H, D], the learner's values
  transposed, and the learner's own arrays stay; the other leaves as synced."""
  from jaxrl.sampler import Engine, SamplingParams
  cfg = get_preset("tiny-qwen3")
  graphdef, params = init_params(cfg, colocated.learner.mesh, "learner", seed=3)
  engine = Engine(graphdef, cfg, colocated.sampler.mesh, sampling=SamplingParams())
  engine.heads_major = True
  ws = WeightSync(cfg, colocated)
  ws.prepare = engine.decode_params
  out = ws(params)
  for name in ("q", "k", "v"):
    w = np.asarray(params["layers"][0]["attn"][name])
    np.testing.assert_array_equal(np.asarray(out["layers"][0]["attn"][name]),
                                  w.transpose(1, 2, 0))
  np.testing.assert_array_equal(np.asarray(out["layers"][1]["attn"]["o"]),
                                np.asarray(params["layers"][1]["attn"]["o"]))
  assert ws.last.bytes == cfg.num_params * 4
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))


def test_cast_on_sync_is_exact_to_bf16(colocated):
  cfg = get_preset("tiny")
  _, params = init_params(cfg, colocated.learner.mesh, "learner")
  out = WeightSync(cfg, colocated, dtype="bfloat16")(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(out)):
    assert b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.bfloat16)))
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))  # source untouched


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_outputs_equal_params_born_in_sampler_layout(mode):
  placement = _placement(mode)
  cfg = get_preset("tiny")
  graphdef, params = init_params(cfg, placement.learner.mesh, "learner", seed=5)
  synced = sync(params, placement.sampler.model_shardings(cfg))
  _, direct = init_params(cfg, placement.sampler.mesh, "sampler", seed=5)
  S = placement.sampler.mesh
  tokens = jax.device_put(jax.random.randint(jax.random.key(0), (4, 6), 3, 259),
                          jax.sharding.NamedSharding(S, jax.sharding.PartitionSpec()))

  def decode(p):  # a cached prefill on the sampler mesh, as the sampler runs it
    cache = jax.device_put(init_cache(cfg, 4, 8), [cache_sharding(S, cfg, 4, 8)] *
                           cfg.num_layers)
    pos = jnp.broadcast_to(jnp.arange(6), (4, 6))
    return jax.jit(lambda p, c: apply(graphdef, p, tokens, pos, cache=c)[0])(p, cache)

  np.testing.assert_array_equal(np.asarray(decode(synced)), np.asarray(decode(direct)))


def test_donated_source_is_freed(colocated):
  cfg = get_preset("tiny")
  _, params = init_params(cfg, colocated.learner.mesh, "learner")
  expect = [np.asarray(x) for x in jax.tree.leaves(params)]
  out = sync(params, colocated.sampler.model_shardings(cfg), donate=True)
  assert all(x.is_deleted() for x in jax.tree.leaves(params))
  for e, b in zip(expect, jax.tree.leaves(out)):
    np.testing.assert_array_equal(e, np.asarray(b))


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_live_bytes_stay_flat_over_20_cycles(colocated, keep, host, monkeypatch):
  if host:  # every leaf through the host reshard and its buffer pool
    monkeypatch.setattr(sync_lib, "HOST_RESHARD_MIN_BYTES", 0)
  import gc
  gc.collect()  # arrays an earlier test left in reference cycles count as live until collected
  # Arrays an earlier test on this worker still holds (a module-level cache, a fixture) are
  # not this test's: they were 16,950 bytes on one CI worker (2026-12-06).
  before = live_bytes()
  cfg = get_preset("tiny")
  _, params = init_params(cfg, colocated.learner.mesh, "learner")
  copy = SamplerCopy(WeightSync(cfg, colocated), keep=keep)
  update = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.999, p), donate_argnums=0)
  sizes = []
  for _ in range(20):
    copy.refresh(params)  # sync into the sampler layout (the old copy is released)
    copy.before_update()  # colocated: the sampler copy gives its memory back to the update
    params = update(params)
    jax.block_until_ready(params)
    sizes.append((live_bytes(), host_pool_bytes()))
  assert len(set(sizes[1:])) == 1, sizes  # neither live arrays nor the CPU sync's pool grow
  # Without keep, only the learner params are live at the update; with keep, one copy more.
  assert sizes[-1][0] - before == cfg.num_params * 4 * (2 if keep else 1), before


def _pointers(tree):
  return [[s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
          for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_cpu_sync_reuses_free_buffers_and_never_overwrites_a_live_copy(mode, monkeypatch):
  """On CPU the sync runs on the host (HostReshard): replicas share one buffer, a released
  copy's buffers are reused by the next sync, and a copy still alive is never written over.
  (Every leaf takes the host path here; by default only leaves of 4 MiB and more do.)"""
  monkeypatch.setattr(sync_lib, "HOST_RESHARD_MIN_BYTES", 0)
  placement = _placement(mode)
  cfg = get_preset("tiny")
  target = placement.sampler.model_shardings(cfg)
  _, params = init_params(cfg, placement.learner.mesh, "learner", seed=1)
  assert HostReshard.applies(params, target)
  first = sync(params, target)
  if mode == "colocated":  # data=2 replicas of each tensor shard: one buffer, two devices
    emb = first["embed"]
    by_region = {}
    for shard in emb.addressable_shards:
      by_region.setdefault(str(shard.index), set()).add(shard.data.unsafe_buffer_pointer())
    assert len(by_region) == 4 and all(len(p) == 1 for p in by_region.values())
  pointers, pool = _pointers(first), host_pool_bytes()
  release(first)
  second = sync(params, target)
  assert _pointers(second) == pointers and host_pool_bytes() == pool  # reused, not grown
  # A live copy (second) is kept: the next sync must write elsewhere and leave it intact.
  moved = jax.tree.map(lambda x: x + 1.0, params)
  third = sync(moved, target)
  assert all(not set(a) & set(b) for a, b in zip(_pointers(third), _pointers(second)))
  for p, m, b, c in zip(*(jax.tree.leaves(t) for t in (params, moved, second, third))):
    np.testing.assert_array_equal(np.asarray(b), np.asarray(p))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(m))
  # A third live copy is allocated outside the pool (at most two sets are pooled).
  fourth = sync(params, target)
  assert host_pool_bytes() <= 2 * pool + pool // 2
  for t in (second, third, fourth):
    release(t)


def test_overlap_runs_generation_beside_training(disaggregated):
  cfg = get_preset("tiny")
  graphdef, params = init_params(cfg, disaggregated.learner.mesh, "learner")
  ws = WeightSync(cfg, disaggregated)
  sampler_params = ws(params)
  tokens = jnp.ones((2, 4), jnp.int32)
  gen = jax.jit(lambda p: apply(graphdef, p, tokens)[0].sum())
  step = jax.jit(lambda p: jax.tree.map(lambda x: x + 1.0, p))
  overlap = Overlap()
  try:
    fut = overlap.submit(lambda p: float(gen(p)), sampler_params, version=7)
    params = step(params)  # dispatched while generation runs in the background
    version, value = fut.result(timeout=60)
  finally:
    overlap.close()
  assert version == 7
  assert value == pytest.approx(float(gen(sampler_params)))
  np.testing.assert_allclose(np.asarray(params["final_norm"]["scale"]), 2.0)


def test_bad_placement_is_one_sentence(devices):
  with pytest.raises(ConfigError, match=r"placement.learner_devices=8 must leave devices"):
    _placement("disaggregated", learner_devices=8)
  with pytest.raises(ConfigError, match=r"placement.sampler_mesh: mesh .* needs 3 devices"):
    section = placement_config()
    section.sampler_mesh = ml_collections.ConfigDict(dict(data=3, fsdp=1, tensor=1))
    make_placement(MESH_FSDP8, section)


def test_disaggregated_split_across_processes():
  """On several processes each gives the learner the same share of its own devices, so both
  sides span every process; a count that cannot be shared so is one sentence naming the key."""
  from types import SimpleNamespace
  from jaxrl.parallel.sync import split_devices
  devs = [SimpleNamespace(process_index=i // 4, id=i) for i in range(8)]
  learner, sampler = split_devices(devs, 4)
  assert [d.id for d in learner] == [0, 1, 4, 5] and [d.id for d in sampler] == [2, 3, 6, 7]
  learner, sampler = split_devices(devs, 2)
  assert [d.id for d in learner] == [0, 4] and [d.id for d in sampler] == [1, 2, 3, 5, 6, 7]
  for n in (3, 8):  # not a multiple of 2; no sampler devices left
    with pytest.raises(ConfigError, match=rf"placement.learner_devices={n}: on 2 processes"):
      split_devices(devs, n)
  one = [SimpleNamespace(process_index=0, id=i) for i in range(8)]  # one process: the first n
  assert [[d.id for d in side] for side in split_devices(one, 3)] == [[0, 1, 2],
                                                                      [3, 4, 5, 6, 7]]
  # placement.sampler_devices: the sampler's share of the rest, the same on every process.
  assert [[d.id for d in side] for side in split_devices(one, 4, 1)] == [[0, 1, 2, 3], [4]]
  learner, sampler = split_devices(devs, 2, 4)
  assert [d.id for d in learner] == [0, 4] and [d.id for d in sampler] == [1, 2, 5, 6]
  for n, m, key in ((4, 5, "the learner leaves 4"), (4, 0, "the learner leaves 4"),
                    (2, 3, "on 2 processes")):
    with pytest.raises(ConfigError, match=rf"placement.sampler_devices={m}: {key}"):
      split_devices(devs, n, m)


def test_sampler_devices_places_a_smaller_sampler(devices):
  """placement.sampler_devices=1: the learner's 4 devices and a one-device sampler mesh (the
  other 3 idle); colocated it is refused in one sentence."""
  one = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  p = _placement("disaggregated", sampler_devices=1, sampler_mesh=one)
  assert p.learner.mesh.devices.size == 4 and p.sampler.mesh.devices.size == 1
  assert not set(p.learner.mesh.devices.flat) & set(p.sampler.mesh.devices.flat)
  with pytest.raises(ConfigError, match=r"placement.sampler_devices=1 applies to disaggregated"):
    _placement("colocated", sampler_devices=1, sampler_mesh=one)


def _bytes_per_device():
  gc.collect()
  per = {d: 0 for d in jax.devices()}
  for x in jax.live_arrays():
    for s in x.addressable_shards:
      per[s.device] += s.data.nbytes
  return per


def test_plan_is_within_20_percent_of_measured_live_bytes(colocated):
  cfg = get_preset("tiny")
  work = Workload(reference=True, slots=16, max_len=128)  # what a GRPO trainer's would say
  plan = memory_plan(cfg, colocated, plan_config(), workload=work)
  before = _bytes_per_device()  # other tests' arrays may still be alive in this process
  # Build what stays live in a colocated GRPO step: actor, Adam state, reference, sampler copy,
  # KV cache. Gradients and activations are transient and excluded on both sides.
  tx = optax.adamw(1e-3)
  _, state, _ = init_train_state(cfg, colocated.learner.mesh, tx, seed=0)
  actor, opt_state = state.params, state.opt_state
  _, reference = init_params(cfg, colocated.learner.mesh, "learner", seed=1)
  sampler = WeightSync(cfg, colocated)(actor)
  S = colocated.sampler.mesh
  cache = jax.device_put(init_cache(cfg, 16, 128), [cache_sharding(S, cfg, 16, 128)] *
                         cfg.num_layers)
  jax.block_until_ready((opt_state, sampler, cache))
  after = _bytes_per_device()
  measured = max(after[d] - before[d] for d in after)
  predicted = plan.persistent_bytes()
  assert abs(predicted - measured) / measured < 0.2, (predicted, measured)
  del state, actor, opt_state, reference, sampler, cache


def test_plan_says_when_it_does_not_fit(colocated):
  cfg = get_preset("qwen3-8b").replace(param_dtype="bfloat16", dtype="bfloat16")
  section = plan_config()
  section.device = "tpu-v5e"
  work = Workload(rows=1, seq_len=2048, reference=True, slots=64, max_len=2048)
  plan = memory_plan(cfg, colocated, section, workload=work)
  assert plan.fits is False
  text = plan.table()
  assert "does NOT fit" in text and "LoRA" in text and "disaggregated" in text
  assert "model.remat=full" in text
  section.device = "h200"
  work = Workload(rows=1, seq_len=2048, reference=True, slots=8, max_len=1024, remat="full")
  assert memory_plan(get_preset("qwen3-0.6b"), colocated, section, workload=work).fits is True
  section.device = "tpu-v9"
  with pytest.raises(ConfigError, match="plan.device='tpu-v9' is not a known device"):
    memory_plan(cfg, colocated, section)
