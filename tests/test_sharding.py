"""Parameters are born sharded and follow the layout rules; bad meshes fail in one sentence;
the learner step on a batch-parallel mesh moves weights, not activations."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.errors import ConfigError
from jaxrl.models import get_preset
from jaxrl.parallel import batch_sharding, init_params, make_mesh, param_shardings, param_table
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.algorithms.sft import sft_loss
from jaxrl.train import state as train_state
from jaxrl.train.state import init_train_state, make_train_step, put_batch

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



# ----------------------------------------------------------------------------- FSDP activations

_COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2}


def _collective_bytes(hlo: str) -> dict[str, int]:
  """Bytes each device's collectives return in a compiled program, by kind."""
  out: dict[str, int] = {}
  for m in _COLLECTIVE.finditer(hlo):
    n = sum(int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _BYTES[dt]
            for dt, dims in re.findall(r"(f32|bf16|s32|u32)\[([\d,]*)\]", m.group(1)))
    out[m.group(2)] = out.get(m.group(2), 0) + n
  return out


def _sft_step(mesh, batch_rows=16, seq=64):
  """The SFT train step on `mesh` (tiny preset): compiled HLO text, and the step's outputs."""
  cfg = get_preset("tiny")
  # eps=1 and lr=1 make the first update g / (|g| + 1), smooth in the gradient (at a small eps
  # Adam's first step is lr * sign(g), which flips on rounding for a near-zero gradient).
  tx, schedule = make_optimizer(optim_section(lr=1.0, eps=1.0, warmup_steps=0,
                                              schedule="constant", weight_decay=0.0), 10)
  graphdef, state, shardings = init_train_state(cfg, mesh, tx, seed=0)
  rng = np.random.default_rng(0)
  host = {"inputs": rng.integers(0, cfg.vocab_size, (batch_rows, seq), dtype=np.int32),
          "targets": rng.integers(0, cfg.vocab_size, (batch_rows, seq), dtype=np.int32),
          "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch_rows, seq)).copy(),
          "segment_ids": np.ones((batch_rows, seq), np.int32),
          "loss_mask": np.ones((batch_rows, seq), np.float32)}
  shd = batch_sharding(mesh, 2)
  step = make_train_step(sft_loss(graphdef), tx, schedule, shardings, shd, mesh=mesh)
  hlo = step.lower(state, put_batch(host, shd)).compile().as_text()
  before = jax.device_get(state.params)
  new, metrics = step(state, put_batch(host, shd))
  return hlo, (before, jax.device_get(new.params), float(metrics["loss"]))


@pytest.mark.parametrize("shape", [dict(data=1, fsdp=8), dict(data=2, fsdp=4)])
def test_fsdp_step_moves_weights_not_activations(devices, shape, monkeypatch):
  """On a batch-parallel mesh the learner step keeps each device on its own rows: its
  collectives move about the parameters' bytes (all-gathers of weights, the gradients'
  reduction), not activations. Unpinned, propagation split D instead and all-reduced products'
  outputs for the whole batch: this step (16 x 64 tokens) then moved 7.6x more on fsdp=8, and
  the gap grows with the tokens per step."""
  mesh = make_mesh(**shape)
  hlo, (before, params, loss) = _sft_step(mesh)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  moved = _collective_bytes(hlo)
  # Weights gathered once for the forward (the backward reuses them), gradients reduced once.
  assert moved.get("all-gather", 0) <= 1.1 * param_bytes, moved
  assert moved.get("all-reduce", 0) + moved.get("reduce-scatter", 0) <= 1.1 * param_bytes, moved
  # The same step built without the pin (the train step traced outside activation_sharding).
  monkeypatch.setattr(train_state, "shard_activations", lambda fn, mesh: fn)
  unpinned = _collective_bytes(_sft_step(mesh)[0])
  monkeypatch.undo()
  assert sum(unpinned.values()) > 5 * sum(moved.values()), (unpinned, moved)
  # The same update as on one device.
  one = make_mesh(data=1, fsdp=1, devices=jax.devices()[:1])
  _, (_, params_1, loss_1) = _sft_step(one)
  assert loss == pytest.approx(loss_1, rel=1e-5)
  moved_by = max(float(np.max(np.abs(a - b)))
                 for a, b in zip(jax.tree.leaves(params_1), jax.tree.leaves(before)))
  assert moved_by > 1e-3  # the update did change the weights
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_1)):
    np.testing.assert_allclose(a, b, atol=1e-6)
