"""Parameters are born sharded and follow the layout rules; bad meshes fail in one sentence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.errors import ConfigError
from jaxrl.models import get_preset
from jaxrl.parallel import init_params, make_mesh, param_shardings, param_table

DF = ("data", "fsdp")
# tiny: V=512, D=128, N=4 heads, K=2 kv heads, H=32, F=384; mesh fsdp=2 x tensor=4.
# K=2 does not divide tensor=4, so k and v replicate their head dimension.
EXPECTED = {
    "learner": {
        ("embed",): (P("tensor", DF), (128, 64)),
        ("layers", 0, "attn", "q"): (P(DF, "tensor"), (64, 1, 32)),
        ("layers", 0, "attn", "k"): (P(DF), (64, 2, 32)),
        ("layers", 1, "attn", "o"): (P("tensor", None, DF), (1, 32, 64)),
        ("layers", 1, "mlp", "gate"): (P(DF, "tensor"), (64, 96)),
        ("layers", 0, "mlp", "down"): (P("tensor", DF), (96, 64)),
        ("final_norm", "scale"): (P(), (128,)),
    },
    "sampler": {
        ("embed",): (P("tensor"), (128, 128)),
        ("layers", 0, "attn", "q"): (P(None, "tensor"), (128, 1, 32)),
        ("layers", 0, "attn", "k"): (P(), (128, 2, 32)),
        ("layers", 1, "attn", "o"): (P("tensor"), (1, 32, 128)),
        ("layers", 1, "mlp", "gate"): (P(None, "tensor"), (128, 96)),
        ("layers", 0, "mlp", "down"): (P("tensor"), (96, 128)),
        ("final_norm", "scale"): (P(), (128,)),
    },
}


@pytest.fixture(scope="module")
def mesh(devices):
  return make_mesh(data=1, fsdp=2, tensor=4)


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


@pytest.mark.parametrize("layout", ["learner", "sampler"])
def test_shardings_follow_the_rules(mesh, layout):
  _, params = init_params(get_preset("tiny"), mesh, layout)
  for path, (spec, shard_shape) in EXPECTED[layout].items():
    arr = _get(params, path)
    assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), (path, arr.sharding)
    # Born sharded: every device holds only its shard, never the whole array.
    assert {s.data.shape for s in arr.addressable_shards} == {shard_shape}, path


def test_learner_to_sampler_move_keeps_values(mesh):
  cfg = get_preset("tiny-qwen3")
  _, params = init_params(cfg, mesh, "learner")
  moved = jax.device_put(params, param_shardings(cfg, mesh, "sampler"))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(moved)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  q = moved["layers"][0]["attn"]["q"]
  assert q.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tensor")), 3)


def test_auto_mesh_puts_every_device_on_fsdp(devices):
  mesh = make_mesh()
  assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
  assert dict(make_mesh(data=2, fsdp=-1, tensor=2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}


@pytest.mark.parametrize("kw, pattern", [
    (dict(data=3, fsdp=1, tensor=1), r"needs 3 devices but there are 8"),
    (dict(data=3, fsdp=-1, tensor=1), r"does not divide the 8 devices"),
    (dict(data=-1, fsdp=-1, tensor=1), r"at most one axis can be auto"),
    (dict(data=0, fsdp=-1, tensor=1), r"mesh.data=0 is not a valid axis size"),
])
def test_bad_mesh_is_one_sentence(devices, kw, pattern):
  with pytest.raises(ConfigError, match=pattern):
    make_mesh(**kw)


def test_heads_not_divisible_by_tensor(devices):
  mesh = make_mesh(data=1, fsdp=1, tensor=8)
  with pytest.raises(ConfigError, match=r"model.num_heads=4 is not divisible by the "
                     r"tensor-parallel size 8: choose mesh.tensor"):
    init_params(get_preset("tiny"), mesh, "learner")


def test_param_table_lists_every_parameter(mesh):
  cfg = get_preset("tiny")
  table = param_table(cfg, mesh, "learner")
  for name in ("embed", "layers.0.attn.q", "layers.1.mlp.down", "final_norm.scale"):
    assert f"\n{name} " in table
  assert f"total: {cfg.num_params:,} parameters" in table
  assert "note: kv_heads=2 not divisible by tensor=4, replicated" in table
  # Per-device bytes: embed is 512x128 fp32 split 8 ways = 32 KiB.
  embed_row = next(line for line in table.splitlines() if line.startswith("embed "))
  assert "32.00 KiB" in embed_row


def test_full_size_table_needs_no_memory(mesh):
  # qwen3-8b in bf16 would be 16 GB; the table comes from eval_shape alone.
  cfg = get_preset("qwen3-8b").replace(param_dtype="bfloat16")
  table = param_table(cfg, mesh, "learner")
  assert "total: 8,190,735,360 parameters" in table
  assert "(layers 1..34 have the same rows as layer 0)" in table


def test_param_dtype_applies_to_every_leaf(mesh):
  cfg = get_preset("tiny").replace(param_dtype="bfloat16")
  _, params = init_params(cfg, mesh, "sampler")
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))

