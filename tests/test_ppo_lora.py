"""PPO with LoRA / QLoRA (model.lora; critic.lora): the actor trains adapters over a frozen base
whose adapters-off self is the reference; the critic trains adapters and its value head over
its own frozen base; a `jaxrl ppo` run with ,lora resumes bitwise; the plan's rows match XLA."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.models import RewardModel, abstract_model, apply, lora
from jaxrl.parallel import batch_sharding, mesh_from_config
from jaxrl.algorithms import ppo
from jaxrl.algorithms.ppo.critic import critic_config, critic_optimizer
from jaxrl.train.state import init_train_state, make_train_step

QUIET = lambda *a: None  # noqa: E731


def _config(repo_root, arg="runlocal,lora", overrides=()):
  return config_lib.load_config(os.path.join(repo_root, f"configs/ppo_tiny.py:{arg}"),
                                ["eval.every=0", *overrides], ppo.CHOICES)


def _paths(tree):
  return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)
          for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_only_trained_moved(before, after, *, also=()):
  """The frozen base is bitwise as it started; every adapter's lora_b, and each top-level
  sub-tree in `also` (the critic's head), moved."""
  base0, ad0 = lora.split_lora(jax.device_get(before))
  base1, ad1 = lora.split_lora(jax.device_get(after))
  extra0, extra1 = {k: base0.pop(k) for k in also}, {k: base1.pop(k) for k in also}
  assert jax.tree.leaves(base0)
  for x, y in zip(jax.tree.leaves(base0), jax.tree.leaves(base1), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  moved = [float(np.abs(np.asarray(y) - np.asarray(x)).max()) for (p, x), y in zip(
      jax.tree_util.tree_flatten_with_path(ad0)[0], jax.tree.leaves(ad1), strict=True)
      if p[-1].key == "lora_b"]
  assert moved and min(moved) > 0
  for k in also:
    assert float(np.abs(np.asarray(extra1[k]) - np.asarray(extra0[k])).max()) > 0


def _opt_is_adapters_only(state, *, also=()):
  """The optimizer state's parameter leaves are adapters (and `also`) alone."""
  paths = [p for p in _paths(state.opt_state) if "/backbone/" in p or "/layers/" in p
           or any(f"/{k}" in p for k in also)]
  assert paths and all("_lora/" in p or any(f"/{k}" in p for k in also) for p in paths), paths


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides,words", [
    (["critic.lora=half"], "critic.lora='half' is not one of"),
    (["critic.init=reward_model"], "a LoRA critic starts from the policy's base"),
])
def test_bad_lora_settings_stop_in_one_sentence(repo_root, tmp_path, overrides, words):
  with pytest.raises(ConfigError) as e:
    ppo.run(_config(repo_root, overrides=overrides), str(tmp_path / "x"), out=QUIET)
  assert words in str(e.value) and "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "x" / "checkpoints")


def test_critic_lora_follows_the_actor_or_is_off(repo_root):
  for arg, lora_kw, rank, quantize in (("runlocal,lora", "actor", 16, ""),
                                       ("runlocal,qlora", "actor", 16, "int8"),
                                       ("runlocal,lora", "off", 0, ""),
                                       ("runlocal", "actor", 0, "")):
    config = _config(repo_root, arg, [f"critic.lora={lora_kw}"])
    cfg = critic_config(config, config_lib.model_config(config))
    assert (cfg.lora_rank, cfg.lora_quantize) == (rank, quantize), (arg, lora_kw)


# ----------------------------------------------------------------------------- the critic


@pytest.mark.slow  # 11-16 s on the shared 2-core test bed
def test_critic_step_trains_only_adapters_and_the_head(repo_root, devices):
  """One LoRA critic update (PPO2's clipped value loss, the shared LoRA train step): the base
  stays bitwise, lora_b and the value head move, Adam's moments cover them alone."""
  config = _config(repo_root)
  cfg = critic_config(config, config_lib.model_config(config))
  mesh = mesh_from_config(config.mesh)
  tx, schedule = critic_optimizer(config, 4)
  graphdef, state, shardings = init_train_state(cfg, mesh, tx, seed=0, layout="learner",
                                                model=RewardModel)
  assert state.train_only == ("head",)
  before = jax.device_get(state.params)
  step = make_train_step(ppo.value_loss(graphdef, value_clip=0.2), tx, schedule, shardings,
                         batch_sharding(mesh, 2, "learner"), mesh=mesh)
  n, t = 8, 12
  k = jax.random.split(jax.random.key(0), 3)
  batch = {"inputs": jax.random.randint(k[0], (n, t), 0, cfg.vocab_size),
           "positions": jnp.broadcast_to(jnp.arange(t), (n, t)),
           "mask": (jnp.arange(t) >= 4).astype(jnp.float32)[None].repeat(n, 0),
           "returns": jax.random.normal(k[1], (n, t)),
           "old_values": 0.1 * jax.random.normal(k[2], (n, t))}
  for _ in range(2):  # the first step moves lora_b (zeros at init), the second both factors
    state, m = step(state, batch)
  assert np.isfinite(float(m["loss"]))
  _assert_only_trained_moved(before, state.params, also=("head",))
  _opt_is_adapters_only(state, also=("head",))


# ----------------------------------------------------------------------------- the reference


def _assert_reference_is_the_base_with_adapters_off(p, state):
  """PPO's reference is the actor's own frozen base (the same arrays: no copy) with zero
  adapters, and with trained (random) adapters it still computes the base model's logits."""
  base, _ = lora.split_lora(state.actor.params)
  ref_base, ref_adapters = lora.split_lora(p.learner.reference)
  assert all(x is y for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(ref_base),
                                    strict=True))
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(ref_adapters))
  # The critic keeps its own frozen base (critic.lora='actor'): adapters and head train.
  assert state.critic.train_only == ("head",) and state.actor.train_only == ()
  cfg = p.cfg
  keys = iter(jax.random.split(jax.random.key(5), 256))
  trained = jax.tree_util.tree_map_with_path(
      lambda path, x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype)
      if lora.is_lora_path(path) else x, jax.device_get(state.actor.params))
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
  # (Every forward on one device's copy: a sharded one would sum in another order.)
  graphdef = abstract_model(cfg)[0]
  base_graphdef = abstract_model(lora.base_config(cfg))[0]
  off = apply(graphdef, lora.adapters_off(trained), tokens, pos)[0]
  on = apply(graphdef, trained, tokens, pos)[0]
  plain = apply(base_graphdef, jax.device_get(base), tokens, pos)[0]
  np.testing.assert_array_equal(np.asarray(off), np.asarray(plain))
  assert float(jnp.abs(on - plain).max()) > 1e-4  # the adapters do act when on


# ----------------------------------------------------------------------------- a run


@pytest.mark.slow
def test_lora_ppo_run_reference_adapters_only_and_bitwise_resume(repo_root, tmp_path, devices):
  """`jaxrl ppo` on the tiny config's ,lora variant: the actor's and the critic's bases stay
  bitwise as they started, their adapters (and the critic's head) move, the optimizer states
  hold adapters (and head) only; a run stopped at its step-2 checkpoint and resumed to 3 ends
  bitwise equal to one that went straight to 3, both optimizer states included. (One test,
  as each PPO setup costs ~20 s here: the reference's check rides on the fresh setup.)"""
  p, fresh = ppo.setup(_config(repo_root), str(tmp_path / "fresh"), out=QUIET)
  try:
    _assert_reference_is_the_base_with_adapters_off(p, fresh)
  finally:
    p.close()
  fresh = jax.device_get(fresh)
  resumed = str(tmp_path / "resumed")
  s2 = ppo.run(_config(repo_root), resumed, out=QUIET)
  assert s2["status"] == "completed" and s2["step"] == 2
  lines = []
  s3 = ppo.run(_config(repo_root, overrides=["train.steps=3"]), resumed, out=lines.append)
  assert s3["step"] == 3 and any("resuming" in s for s in lines)
  a = s3["state"]
  _assert_only_trained_moved(fresh.actor.params, a.actor.params)
  _assert_only_trained_moved(fresh.critic.params, a.critic.params, also=("head",))
  _opt_is_adapters_only(a.actor)
  _opt_is_adapters_only(a.critic, also=("head",))
  straight = str(tmp_path / "straight")
  b = ppo.run(_config(repo_root, overrides=["train.steps=3", "train.save_every=3"]), straight,
              out=QUIET)["state"]
  for part in ("actor", "critic"):
    x, y = getattr(a, part), getattr(b, part)
    assert int(x.step) == int(y.step)
    for u, v in zip(jax.tree.leaves((x.params, x.opt_state)),
                    jax.tree.leaves((y.params, y.opt_state)), strict=True):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v))  # bitwise


# ----------------------------------------------------------------------------- memory plan


@pytest.mark.slow  # ~35 s: every PPO program compiled
def test_lora_ppo_plan_is_within_15_percent_of_xla_on_cpu(repo_root, devices, arg="lora"):
  """The tiny ,lora PPO programs (measured by hand for ,qlora too: docs/guides/ppo.md) planned and compiled on 8 CPU devices: the run's peak
  and both train steps within 15% of XLA's memory_analysis(); the actor's base counted once
  (the reference's own bytes are its zero adapters); the critic's step holds its own base as
  its frozen argument, gradients and Adam moments for its adapters and head alone."""
  from jaxrl.parallel import compile as aot
  from jaxrl.parallel.plan import abstract_bytes, estimate
  config = config_lib.load_config(f"{repo_root}/configs/ppo_tiny.py:{arg}", [], ppo.CHOICES)
  work, programs = ppo.programs(config)
  assert work.critic
  estimates = [estimate(p) for p in programs]
  compiled = [aot.compile_program(p) for p in programs]
  plan, xla = aot.run_peaks(programs, estimates, compiled)
  assert abs(plan - xla) / xla < 0.15, (plan, xla)
  names = [p.name for p in programs]
  for name in ("train step", "critic train step"):
    i = names.index(name)
    assert abs(estimates[i].program_peak - compiled[i].bytes) / compiled[i].bytes < 0.15, (
        name, estimates[i].program_peak, compiled[i].bytes)
  actor_trained, actor_frozen, _ = programs[0].args
  assert not lora.split_lora(actor_frozen)[1] and lora.split_lora(actor_trained.params)[0] == {}
  assert programs[0].resident["reference params"] == abstract_bytes(actor_trained.params)
  critic_trained, critic_frozen, _ = programs[names.index("critic train step")].args
  assert set(critic_trained.params) == {"backbone", "head"}
  assert lora.split_lora(critic_trained.params["backbone"])[0] == {}
  assert not lora.split_lora(critic_frozen)[1]
  assert (abstract_bytes(critic_trained.opt_state)
          < 2 * abstract_bytes(critic_trained.params) + 64)  # Adam's two moments
  # The critic's own frozen base is in what the actor's step keeps resident.
  assert (programs[0].resident["critic params + optimizer state"]
          >= abstract_bytes(critic_frozen) + abstract_bytes(critic_trained))


def test_roles_count_the_critics_adapters_and_head(devices):
  """The roles table (jaxrl plan): a LoRA critic's gradients and moments are its adapters and
  head; its params are its own base besides; critic.lora='off' counts a full critic."""
  import ml_collections

  from jaxrl.models import get_preset
  from jaxrl.parallel.plan import Workload, memory_plan
  from jaxrl.parallel.sync import make_placement
  cfg = get_preset("tiny").replace(lora_rank=8, lora_alpha=16.0,
                                   lora_targets=("q", "k", "v", "o", "gate", "up", "down"))
  placement = make_placement(ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1)))
  roles = memory_plan(cfg, placement, workload=Workload(reference=True, critic=True)).learner
  full = memory_plan(cfg, placement, workload=Workload(reference=True, critic=True,
                                                        critic_full=True)).learner
  assert roles["critic gradients"] < roles["critic params"] // 2
  assert roles["critic optimizer state"] == 2 * roles["critic gradients"]
  # Its adapters are the actor's, plus the [D] head (replicated here: no sharded axis).
  head = cfg.embed_dim * 4
  assert roles["critic gradients"] - roles["actor gradients"] in range(head // 8, head + 1)
  assert full["critic gradients"] == full["critic params"] > roles["critic params"] // 2
  assert full["critic params"] < roles["critic params"]  # no adapters in a full critic
