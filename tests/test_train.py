"""The shared training machinery: optimizer, sharded state and step, run directory, NaN guard."""

import math
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.config import base_config, model_config
from jaxrl.errors import ConfigError
from jaxrl.models import apply, token_logprobs
from jaxrl.parallel import batch_sharding, make_mesh, param_shardings
from jaxrl.train import (Checkpointer, RunDir, TrainingDiverged, init_train_state,
                         make_optimizer, make_train_step, optim_section, put_batch,
                         read_metrics, train_loop)
from jaxrl.train.checkpoint import abstract_state
from jaxrl.train.optim import decay_mask
from jaxrl.train.rundir import crc32c, event_bytes, tfrecord

def _loss_fn(graphdef):
  def loss_fn(params, batch, key):
    logits, _ = apply(graphdef, params, batch["inputs"])
    logp, _ = token_logprobs(logits, batch["targets"])
    m = batch["loss_mask"]
    # A poisoned row turns the loss into NaN, as a diverged step would.
    return -(logp * m).sum() * batch["poison"][0, 0], (m.sum(), {})
  return loss_fn


def _batch(rng, b=16, t=12, poison=1.0):
  return {"inputs": rng.integers(3, 200, (b, t)).astype(np.int32),
          "targets": rng.integers(3, 200, (b, t)).astype(np.int32),
          "loss_mask": (rng.random((b, t)) > 0.3).astype(np.float32),
          "poison": np.full((b, t), poison, np.float32)}


class Batches:
  """A checkpointable stand-in iterator: batch i is a pure function of (seed, i)."""

  def __init__(self, poison_at=None):
    self.i, self.poison_at = 0, poison_at

  def __iter__(self):
    return self

  def __next__(self):
    self.i += 1
    poison = math.nan if self.poison_at is not None and self.i >= self.poison_at else 1.0
    return _batch(np.random.default_rng(self.i), poison=poison)

  def get_state(self):
    return {"i": self.i}

  def set_state(self, state):
    self.i = state["i"]


@pytest.fixture(scope="module")
def setup(devices):
  cfg = model_config(base_config())
  mesh = make_mesh()
  tx, schedule = make_optimizer(optim_section(lr=1e-3, warmup_steps=2), 100)
  shd = batch_sharding(mesh, 2)
  return cfg, mesh, tx, schedule, shd


def test_schedule_warms_up_then_decays_to_the_floor():
  _, sched = make_optimizer(optim_section(lr=1e-2, warmup_steps=10, min_lr_ratio=0.1), 110)
  assert float(sched(0)) == pytest.approx(1e-3)  # lr / warmup, not a wasted zero step
  assert float(sched(10)) == pytest.approx(1e-2)
  assert float(sched(60)) == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5), rel=1e-4)
  assert float(sched(110)) == pytest.approx(1e-3, rel=1e-4)
  _, flat = make_optimizer(optim_section(lr=1e-2, warmup_steps=0, schedule="constant"), 50)
  assert float(flat(0)) == float(flat(49)) == pytest.approx(1e-2)


def test_bad_optimizer_keys_name_the_key():
  with pytest.raises(ConfigError, match=r"optim.schedule='cosin' is not valid\. Did you mean "
                     r"'cosine'\?"):
    make_optimizer(optim_section(schedule="cosin"), 10)
  with pytest.raises(ConfigError, match=r"optim.lr=-1.0 must be positive"):
    make_optimizer(optim_section(lr=-1.0), 10)


def test_weight_decay_skips_norms_and_biases():
  cfg = model_config(base_config())
  from jaxrl.models import abstract_model
  from jaxrl.models import get_preset
  _, shapes, _ = abstract_model(get_preset("tiny-qwen2"))  # has q/k/v biases
  mask = decay_mask(shapes)
  assert mask["embed"] and mask["layers"][0]["attn"]["q"] and mask["layers"][0]["mlp"]["up"]
  assert not mask["layers"][0]["attn"]["q_bias"]
  assert not mask["layers"][0]["attn_norm"]["scale"] and not mask["final_norm"]["scale"]
  del cfg


def test_state_is_born_sharded_and_moments_follow_params(setup):
  cfg, mesh, tx, _, _ = setup
  _, state, shardings = init_train_state(cfg, mesh, tx, seed=0)
  want = param_shardings(cfg, mesh, "learner")
  assert state.params["embed"].sharding == want["embed"]
  adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
  mu = adam.mu["layers"][0]["mlp"]["up"]
  assert mu.sharding.spec == want["layers"][0]["mlp"]["up"].spec
  assert mu.sharding.spec != jax.sharding.PartitionSpec()  # really sharded, not replicated
  assert int(state.step) == 0


def test_accumulation_equals_one_big_batch(setup):
  cfg, mesh, tx, schedule, shd = setup
  batch = _batch(np.random.default_rng(0))
  out = []
  for accum in (1, 2):
    graphdef, state, shardings = init_train_state(cfg, mesh, tx, seed=0)
    step = make_train_step(_loss_fn(graphdef), tx, schedule, shardings, shd, mesh=mesh,
                           accum_steps=accum)
    state, m = step(state, put_batch(batch, shd))
    out.append((jax.device_get(state.params), jax.device_get(m)))
  (p1, m1), (p2, m2) = out
  assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-6)
  assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
  # Adam's first update is ~lr * sign(g), so a summation-order difference in a near-zero
  # gradient may move a weight by a little; far below lr, the size of every real update.
  np.testing.assert_allclose(p1["layers"][1]["mlp"]["down"], p2["layers"][1]["mlp"]["down"],
                             rtol=0, atol=2e-5)
  assert m1["lr"] == pytest.approx(1e-3 / 2)


def test_tensorboard_events_are_valid_tfrecords(tmp_path):
  assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
  run = RunDir(str(tmp_path))
  run.log(3, {"loss": 1.5, "eval/accuracy": 0.25})
  run.close()
  (name,) = os.listdir(tmp_path / "tb")
  assert name.startswith("events.out.tfevents.")
  data = (tmp_path / "tb" / name).read_bytes()
  records, i = [], 0
  while i < len(data):
    (n,) = struct.unpack("<Q", data[i:i + 8])
    assert data[i:i + 12] == tfrecord(b"\0" * n)[:12]  # the length's masked crc checks out
    payload = data[i + 12:i + 12 + n]
    assert data[i:i + 16 + n] == tfrecord(payload)
    records.append(payload)
    i += 16 + n
  assert len(records) == 2 and b"brain.Event:2" in records[0]
  ev = records[1]
  assert struct.pack("<f", 1.5) in ev and b"eval/accuracy" in ev
  assert ev[9:11] == bytes([0x10, 3])  # field 2 (step), varint 3, right after wall_time
  assert read_metrics(str(tmp_path)) == [{"step": 3, "loss": 1.5, "eval/accuracy": 0.25}]
  assert event_bytes(0.0, step=1)[:1] == b"\x09"


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(setup, tmp_path):
  cfg, mesh, tx, schedule, shd = setup
  graphdef, state, shardings = init_train_state(cfg, mesh, tx, seed=0)
  step = make_train_step(_loss_fn(graphdef), tx, schedule, shardings, shd, mesh=mesh)

  run = RunDir(str(tmp_path))
  ckpt = Checkpointer(run.checkpoints, keep=2)
  with pytest.raises(TrainingDiverged, match=r"loss is nan at step 7: training stopped .*the "
                     r"last good checkpoint is step 5"):
    train_loop(state=state, step_fn=step, batches=Batches(poison_at=7),
               put=lambda b: put_batch(b, shd),
               total_steps=20, run=run, ckpt=ckpt, log_every=2, save_every=5)
  assert ckpt.latest_step() == 5  # steps 6 (logged fine) and 7 were never saved
  assert RunDir(str(tmp_path)).read_config() is None
  import json
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["status"] == "diverged" and summary["step"] == 8  # found at the log step
  _, fresh, _ = init_train_state(cfg, mesh, tx, seed=0)
  restored, data_state = ckpt.restore(abstract_state(jax.eval_shape(lambda: fresh), shardings))
  assert data_state == {"i": 5} and int(restored.step) == 5
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.params))
  ckpt.close()


def test_a_diverged_run_exits_1_with_one_line(capsys, tmp_path):
  import argparse

  from jaxrl.train import run_trainer

  def diverges(config, workdir):
    raise TrainingDiverged("loss is nan at step 3: training stopped")

  args = argparse.Namespace(command="sft", workdir=str(tmp_path))
  with pytest.raises(SystemExit) as e:
    run_trainer(diverges, args, [], lambda a, o: base_config())
  assert e.value.code == 1
  err = capsys.readouterr().err.strip()
  assert err == "jaxrl sft: loss is nan at step 3: training stopped"


def test_partial_multihost_settings_name_the_missing_key(monkeypatch):
  from jaxrl.parallel.distributed import distributed_section, environment_asks, maybe_initialize
  s = distributed_section()
  s.coordinator_address = "127.0.0.1:1234"
  with pytest.raises(ConfigError, match=r"distributed.num_processes is not set"):
    maybe_initialize(s)
  s.num_processes, s.process_id = 2, 2
  with pytest.raises(ConfigError, match=r"distributed.process_id=2 is outside 0..1"):
    maybe_initialize(s)
  for var in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(var, raising=False)
  assert not environment_asks() and maybe_initialize(distributed_section()) is False
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w0,w1")
  assert environment_asks()


def test_the_run_skeleton_takes_the_placement_only_when_the_trainer_samples(devices, tmp_path):
  """A real-model config file carries a placement section (for its GRPO variant and `jaxrl
  plan`), and its SFT run must still train on config.mesh over every device; only a trainer
  that samples (GRPO: Run(..., placement=True)) takes the placement's learner devices. (The
  first version of the skeleton decided from the section, and the own-checkpoint notebook's SFT
  on 1 device failed on its 8-device sampler mesh.)"""
  from jaxrl.parallel.sync import placement_config
  from jaxrl.algorithms import sft
  from jaxrl.train.run import Run
  c = sft.default_config()
  c.placement = placement_config()
  c.placement.mode = "disaggregated"  # half the devices learn, half sample
  quiet = lambda *_: None  # noqa: E731
  r = Run(c, str(tmp_path / "sft"), out=quiet, choices=sft.CHOICES)
  assert r.placement is None and r.mesh.devices.size == len(devices)
  g = Run(c, str(tmp_path / "grpo"), out=quiet, choices=sft.CHOICES, placement=True)
  assert g.placement is not None and g.mesh.devices.size == len(devices) // 2


def test_a_whole_checkpoint_replaces_the_random_init_and_its_program(repo_root, devices):
  """starting_state from an init.checkpoint that replaces every parameter (no LoRA, no hf_path)
  reads it in place of the random init: the state equals the init-then-restore path's to the
  bit (params, optimizer state, step, key; values, dtypes and shardings), and the init's
  program (its every leaf's random draws) is never lowered, let alone compiled."""
  import jax.monitoring
  from jaxrl import config as config_lib
  from jaxrl.train.run import starting_state
  from jaxrl.train.state import start_from_checkpoint
  ckpt = os.path.join(repo_root, "tests", "fixtures", "calculator_sft")
  config = config_lib.load_config(os.path.join(repo_root, "configs", "agentic_tiny.py"),
                                  [f"init.checkpoint={ckpt}"])
  cfg, mesh, tx = model_config(config), make_mesh(), optax.adamw(1e-3)
  compiled = []

  def listen(event, _, **kw):
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":  # before any cache
      compiled.append(kw.get("fun_name"))

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    _, new, _ = starting_state(config, cfg, mesh, tx, layout="learner")
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert "jit(init)" not in compiled
  _, old, _ = init_train_state(cfg, mesh, tx, seed=config.seed)
  old = start_from_checkpoint(cfg, old, ckpt)
  new_leaves, old_leaves = jax.tree.leaves(new), jax.tree.leaves(old)
  assert len(new_leaves) == len(old_leaves) > 10
  for a, b in zip(new_leaves, old_leaves):
    assert a.dtype == b.dtype and a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
