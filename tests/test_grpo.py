"""GRPO: the batch layout, the update's direction, dynamic sampling, alarms, and a pulse run."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from conftest import JAXRL, LEARN_SEED, jaxrl_cli, subprocess_env

from jaxrl import config as config_lib
from jaxrl.models import get_preset
from jaxrl.parallel import batch_sharding, make_mesh
from jaxrl.errors import ConfigError
from jaxrl.algorithms import grpo
from jaxrl.sampler import Rollout
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.train.rundir import read_metrics
from jaxrl.train.state import init_train_state, make_train_step, put_batch

# Every metric docs/design.md names for an RL step (eval/accuracy appears at eval steps).
STEP_METRICS = (
    "loss", "reward/mean", "reward/std", "accuracy", "frac_zero_std_groups", "kl", "entropy",
    "clipfrac/low", "clipfrac/high", "is_ratio/mean", "staleness/mean", "response_length/mean",
    "response_length/clip_ratio", "timing_s/gen", "timing_s/score", "timing_s/ref",
    "timing_s/update", "timing_s/sync", "timing_s/step", "perf/gen_tokens_per_s",
    "perf/gen_fraction", "sync/ms", "sync/gb_per_s", "lr", "grad_norm")


def _rollout(prompts, completions, logprobs=None):
  N = len(completions)
  lp, lc = max(map(len, prompts)), max(map(len, completions))
  pid = np.zeros((N, lp), np.int32)
  cid = np.zeros((N, lc), np.int32)
  lps = np.zeros((N, lc), np.float32)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    pid[i, :len(p)], cid[i, :len(c)] = p, c
    if logprobs is not None:
      lps[i, :len(c)] = logprobs[i]
  return Rollout(prompt_ids=pid, prompt_lengths=np.array(list(map(len, prompts))),
                 completion_ids=cid, completion_mask=(cid > 0).astype(np.int32), logprobs=lps,
                 lengths=np.array(list(map(len, completions))),
                 finish_reasons=["stop"] * N, prompt_index=np.arange(N), stats={})


def _group_rollout(rng, P, G, Tc):
  """P random prompts of 2-8 tokens, each with G random completions of 1..Tc tokens (rows
  p*G .. p*G+G-1 share prompt p), with sampler log-probs near -3."""
  prompts = [list(rng.integers(3, 200, size=int(n))) for n in rng.integers(2, 9, size=P)]
  comps = [list(rng.integers(3, 200, size=int(n))) for n in rng.integers(1, Tc + 1, size=P * G)]
  rollout = _rollout([prompts[i // G] for i in range(P * G)], comps,
                     [list(rng.normal(size=len(c)) - 3.0) for c in comps])
  return dataclasses.replace(rollout, prompt_index=np.repeat(np.arange(P), G))


def test_learner_batch_aligns_completion_targets():
  ro = _rollout([[1, 10, 11], [1, 12]], [[20, 2], [21, 22, 2]], [[-0.5, -0.1], [-1, -2, -3]])
  b = grpo.learner_batch(ro, length=6, pad_id=0)
  # Row 0: seq 1 10 11 20 2 | targets 10 11 20 2 0 0; completion targets at indices 2, 3.
  assert b["inputs"][0].tolist() == [1, 10, 11, 20, 2, 0]
  assert b["targets"][0].tolist() == [10, 11, 20, 2, 0, 0]
  assert b["mask"][0].tolist() == [0, 0, 1, 1, 0, 0]
  assert b["sampler_logp"][0].tolist() == pytest.approx([0, 0, -0.5, -0.1, 0, 0])
  assert b["targets"][1].tolist() == [12, 21, 22, 2, 0, 0]
  assert b["mask"][1].tolist() == [0, 1, 1, 1, 0, 0]


def test_update_raises_logp_of_positive_advantages(devices):
  cfg = get_preset("tiny")
  mesh = make_mesh()
  tx, sched = make_optimizer(optim_section(lr=1e-3, warmup_steps=0, weight_decay=0.0), 10)
  graphdef, state, shd = init_train_state(cfg, mesh, tx, seed=0)
  N, L = 8, 6
  seq = np.random.default_rng(0).integers(3, 200, size=(N, L + 1)).astype(np.int32)
  mask = np.zeros((N, L), np.float32)
  mask[:, 2:] = 1
  adv = np.array([1, 1, 1, 1, -1, -1, -1, -1], np.float32)
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), (N, L)).copy()
  logprobs = grpo.make_logprobs_fn(graphdef, 1.0)
  old = np.asarray(logprobs(state.params, seq[:, :-1], seq[:, 1:], pos)[0])
  batch = dict(inputs=seq[:, :-1], targets=seq[:, 1:], positions=pos, mask=mask, old_logp=old,
               ref_logp=old, adv=np.repeat(adv[:, None], L, 1), sampler_logp=old,
               beta=np.zeros((N, L), np.float32))
  bs = batch_sharding(mesh, 2, "learner")
  step = make_train_step(grpo.grpo_loss(graphdef, grpo.algo_section(beta=0.0), temperature=1.0,
                                        norm_len=L), tx, sched, shd, bs, mesh=mesh)
  state, metrics = step(state, put_batch(batch, bs))
  # On-policy first update: ratio 1, loss = -mean(adv) over tokens = 0, no clipping.
  assert float(metrics["loss"]) == pytest.approx(0.0, abs=1e-6)
  assert float(metrics["clipfrac/low"]) == 0.0 and float(metrics["clipfrac/high"]) == 0.0
  new = np.asarray(logprobs(state.params, seq[:, :-1], seq[:, 1:], pos)[0])
  delta = ((new - old) * mask).sum(1)
  assert np.all(delta[adv > 0] > 0) and np.all(delta[adv < 0] < 0), delta


def test_old_logp_from_the_update_forward_equals_a_separate_forward(devices):
  """One update per step: taking the old log-probs (and the truncated-IS weights) from the
  update's own forward under stop_gradient gives the same update as a separate forward."""
  cfg = get_preset("tiny")
  mesh = make_mesh()
  # eps = 1 makes Adam's first step lr * g / (|g| + 1), linear in small gradients: with the
  # default eps a gradient element near zero turns float noise into a whole lr-sized step.
  tx, sched = make_optimizer(optim_section(lr=1e-3, warmup_steps=0, weight_decay=0.0,
                                           eps=1.0), 10)
  N, L = 8, 6
  rng = np.random.default_rng(1)
  seq = rng.integers(3, 200, size=(N, L + 1)).astype(np.int32)
  mask = np.zeros((N, L), np.float32)
  mask[:, 2:] = 1
  mask[0, 4:] = 0
  pos = np.broadcast_to(np.arange(L, dtype=np.int32), (N, L)).copy()
  adv = np.repeat(rng.normal(size=(N, 1)).astype(np.float32), L, 1)
  a = grpo.algo_section(beta=0.04, tis_cap=1.5)
  bs = batch_sharding(mesh, 2, "learner")
  out = {}
  for fused in (False, True):
    graphdef, state, shd = init_train_state(cfg, mesh, tx, seed=0)
    init = jax.device_get(state.params)
    logprobs = grpo.make_logprobs_fn(graphdef, 1.0)
    old = np.asarray(logprobs(state.params, seq[:, :-1], seq[:, 1:], pos)[0])
    sampler = (old + rng.normal(scale=0.3, size=old.shape) * mask).astype(np.float32) \
        if not out else out["sampler"]
    batch = dict(inputs=seq[:, :-1], targets=seq[:, 1:], positions=pos, mask=mask,
                 ref_logp=old - 0.5 * mask, adv=adv, beta=np.full((N, L), 0.04, np.float32))
    batch["sampler_logp"] = sampler
    if not fused:  # a separate forward's old log-probs; the loss derives the IS weights
      batch["old_logp"] = old
    step = make_train_step(grpo.grpo_loss(graphdef, a, temperature=1.0, norm_len=L), tx, sched,
                           shd, bs, mesh=mesh)
    state, metrics = step(state, put_batch(batch, bs))
    out.update(sampler=sampler, old=old)
    out[fused] = (jax.device_get(state.params), jax.device_get(metrics))
  (p0, m0), (p1, m1) = out[False], out[True]
  for key in ("loss", "kl", "grad_norm", "clipfrac/low", "clipfrac/high"):
    assert float(m1[key]) == pytest.approx(float(m0[key]), rel=1e-5, abs=1e-7), key
  assert float(m0["grad_norm"]) > 0
  moved = max(float(np.abs(x - x0).max()) for x, x0 in zip(jax.tree.leaves(p0),
                                                           jax.tree.leaves(init)))
  assert moved > 1e-5, moved  # the step did update the params
  for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8)
  # is_ratio/mean: the token mean of pi_old / pi_sampler, from the fused forward's own sums.
  expect = float((np.exp((out["old"] - out["sampler"]) * mask) * mask).sum() / mask.sum())
  assert float(m1["is_ratio_tokens"] / m1["tokens"]) == pytest.approx(expect, rel=1e-5)
  assert expect != pytest.approx(1.0, abs=1e-2)  # the sampler log-probs were perturbed


def test_shared_prompt_forward_equals_the_joined_forward(devices):
  """The grouped learner batch (each prompt once, its G completions against it) gives the
  joined batch's log-probs on every completion token, and the same update."""
  cfg = get_preset("tiny")
  mesh = make_mesh()
  rng = np.random.default_rng(2)
  P, G, Tc = 8, 2, 5
  rollout = _group_rollout(rng, P, G, Tc)
  joined = grpo.learner_batch(rollout, length=16 + Tc, pad_id=0)
  grouped = grpo.grouped_learner_batch(rollout, prompt_len=16, group=G, pad_id=0)
  # eps = 1 makes Adam's first step lr * g / (|g| + 1): linear in small gradients, so float
  # noise in a near-zero gradient cannot flip a whole lr-sized step.
  tx, sched = make_optimizer(optim_section(lr=1e-3, warmup_steps=0, weight_decay=0.0,
                                           eps=1.0), 10)
  a = grpo.algo_section(beta=0.04)
  bs = batch_sharding(mesh, 2, "learner")
  out = {}
  for name, batch in (("joined", joined), ("grouped", grouped)):
    graphdef, state, shd = init_train_state(cfg, mesh, tx, seed=0)
    if name == "joined":
      logp = np.asarray(grpo.make_logprobs_fn(graphdef, 1.0)(
          state.params, batch["inputs"], batch["targets"], batch["positions"])[0])
      # joined row n holds completion token t at target index len(prompt) - 1 + t
      logp = np.stack([logp[n, rollout.prompt_lengths[n] - 1:][:Tc] for n in range(P * G)])
    else:
      dev = put_batch({k: batch[k] for k in ("prompt", "prompt_len", "completion")}, bs)
      logp, entropy = grpo.make_batch_logprobs_fn(graphdef, 1.0)(state.params, dev)
      # The reference forward's form skips the entropy, and gives the same log-probs.
      ref_logp, no_entropy = grpo.make_batch_logprobs_fn(graphdef, 1.0, entropy=False)(
          state.params, dev)
      assert no_entropy is None and entropy.shape == ref_logp.shape
      np.testing.assert_allclose(np.asarray(ref_logp), np.asarray(logp), rtol=0, atol=1e-6)
      logp = np.asarray(logp)
    mask = batch["mask"]
    full = {**batch, "ref_logp": np.zeros_like(mask), "beta": np.full_like(mask, 0.04),
            "adv": np.repeat(rng.normal(size=(P * G, 1)).astype(np.float32), mask.shape[1], 1)
            if name == "joined" else None}
    out[name] = dict(logp=logp, mask=grouped["mask"], batch=full, graphdef=graphdef,
                     state=state, shd=shd)
  # the same advantages per completion in both forms
  out["grouped"]["batch"]["adv"] = np.repeat(out["joined"]["batch"]["adv"][:, :1], Tc, 1)
  m = grouped["mask"] > 0
  np.testing.assert_allclose(out["grouped"]["logp"][m], out["joined"]["logp"][m], atol=2e-5)
  results = {}
  for name, o in out.items():
    step = make_train_step(grpo.grpo_loss(o["graphdef"], a, temperature=1.0, norm_len=Tc), tx,
                           sched, o["shd"], bs, mesh=mesh)
    state, metrics = step(o["state"], put_batch(o["batch"], bs))
    results[name] = (jax.device_get(state.params), jax.device_get(metrics))
  (p0, m0), (p1, m1) = results["joined"], results["grouped"]
  for key in ("loss", "kl", "grad_norm", "is_ratio_tokens", "tokens"):
    assert float(m1[key]) == pytest.approx(float(m0[key]), rel=1e-4, abs=1e-6), key
  for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8)
  _, init, _ = init_train_state(cfg, mesh, tx, seed=0)  # the update did move the params
  assert max(float(np.abs(x - y).max()) for x, y in zip(
      jax.tree.leaves(p0), jax.tree.leaves(jax.device_get(init.params)))) > 1e-6


def test_completion_width_is_a_capped_power_of_two():
  assert [grpo.completion_width(n, 8) for n in (1, 4, 5, 8)] == [8, 8, 8, 8]  # the demo's
  assert [grpo.completion_width(n, 64) for n in (4, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
  assert grpo.completion_width(600, 1000) == 1000 and grpo.completion_width(300, 1000) == 512


def test_padding_completions_to_a_fixed_width_changes_no_update(devices):
  """The learner batch's completions padded to completion_width (so the learner compiles
  once per width, not per longest length) give the same log-probs and the same update."""
  cfg = get_preset("tiny")
  mesh = make_mesh()
  rng = np.random.default_rng(3)
  P, G = 8, 2
  rollout = _group_rollout(rng, P, G, 5)
  Tc = rollout.completion_ids.shape[1]
  tx, sched = make_optimizer(optim_section(lr=1e-3, warmup_steps=0, weight_decay=0.0,
                                           eps=1.0), 10)
  a = grpo.algo_section(beta=0.04)
  bs = batch_sharding(mesh, 2, "learner")
  adv = rng.normal(size=(P * G, 1)).astype(np.float32)
  out = {}
  for width in (None, 16):
    batch = grpo.grouped_learner_batch(rollout, prompt_len=16, group=G, pad_id=0, width=width)
    W = batch["mask"].shape[1]
    assert W == (width or Tc)
    assert not batch["mask"][:, Tc:].any() and not batch["sampler_logp"][:, Tc:].any()
    graphdef, state, shd = init_train_state(cfg, mesh, tx, seed=0)
    logp = np.asarray(grpo.make_batch_logprobs_fn(graphdef, 1.0)(
        state.params, put_batch({k: batch[k] for k in ("prompt", "prompt_len", "completion")},
                                bs))[0])
    full = {**batch, "ref_logp": np.zeros_like(batch["mask"]),
            "beta": np.full_like(batch["mask"], 0.04), "adv": np.repeat(adv, W, 1)}
    step = make_train_step(grpo.grpo_loss(graphdef, a, temperature=1.0, norm_len=8), tx, sched,
                           shd, bs, mesh=mesh)
    state, metrics = step(state, put_batch(full, bs))
    out[width] = (logp[:, :Tc], batch["mask"][:, :Tc], jax.device_get(state.params),
                  jax.device_get(metrics))
  (l0, m0, p0, x0), (l1, m1, p1, x1) = out[None], out[16]
  np.testing.assert_array_equal(m0, m1)
  np.testing.assert_allclose(l1[m1 > 0], l0[m0 > 0], atol=2e-5)
  for key in ("loss", "kl", "grad_norm", "tokens"):
    assert float(x1[key]) == pytest.approx(float(x0[key]), rel=1e-4, abs=1e-6), key
  for x, y in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8)
  with pytest.raises(ValueError, match="shorter than the rollout's longest completion"):
    grpo.grouped_learner_batch(rollout, prompt_len=16, group=G, pad_id=0, width=Tc - 1)


def test_dynamic_sampling_refills_zero_variance_groups():
  G = 2
  first = _rollout([[1, 5]] * 4, [[7, 2], [7, 2], [8, 2], [9, 2]])
  rewards = np.array([[1.0, 1.0], [0.0, 1.0]])  # group 0 has zero variance
  calls = []

  def sample(prompts, round_):
    calls.append(round_)
    ro = _rollout([[1, 6]] * 4, [[3, 2], [4, 2], [5, 2], [6, 2]])
    return ro, np.array([1.0, 0.0, 0.0, 0.0], np.float32), {}

  ro, rw = grpo._refill(first, rewards, np.array([True, False]), sample, iter([["p"]] * 5), 3,
                        G)
  assert calls == [1]
  assert rw.tolist() == [[0.0, 1.0], [1.0, 0.0]]  # kept group 1, then the refill's group 0
  assert ro.completion_ids[:, 0].tolist() == [8, 9, 3, 4]
  assert ro.prompt_ids[2].tolist() == [1, 6]


def test_reward_specs_take_kwargs_from_config():
  from jaxrl.errors import ConfigError
  from jaxrl.rewards import score
  specs = grpo.reward_specs("exact_match:1.0,format:0.5", None,
                            {"format": {"pattern": r"^\d+$"}})
  total, _ = score(specs, ["12", "12 apples"], {"answer": ["12", "12"]})
  assert total.tolist() == [1.5, 0.0]
  with pytest.raises(ConfigError, match="reward_kwargs names 'lenght_penalty'"):
    grpo.reward_specs("exact_match", None, {"lenght_penalty": {"max_tokens": 3}})


def test_alarms_fire():
  said = []
  alarms = grpo.Alarms(kl_threshold=0.1, window=3, out=said.append)
  assert alarms.on_step(1, {"reward/mean": 0.1, "kl": 0.05})["alarm/kl"] == 0.0
  assert alarms.on_step(2, {"reward/mean": 0.2, "kl": 0.5})["alarm/kl"] == 1.0
  assert alarms.on_eval(2, 0.6)["alarm/reward_hacking"] == 0.0
  alarms.on_step(3, {"reward/mean": 0.9, "kl": 0.0})
  alarms.on_step(4, {"reward/mean": 0.9, "kl": 0.0})
  assert alarms.on_eval(4, 0.59)["alarm/reward_hacking"] == 0.0  # a one-point dip is noise
  alarms.on_step(5, {"reward/mean": 0.95, "kl": 0.0})
  assert alarms.on_eval(5, 0.4)["alarm/reward_hacking"] == 1.0  # reward up, accuracy down
  assert alarms.raised == {"kl": 1, "reward_hacking": 1}
  assert any("kl=0.5000 > 0.1" in s for s in said) and any("reward hacking" in s for s in said)
  assert not any("learned nothing" in s for s in said)
  # A step whose groups all scored alike (a pulse from an untrained policy: every reward 0)
  # says once that it learned nothing; its loss and grad_norm were 0 without a word.
  for step in (6, 7):
    alarms.on_step(step, {"reward/mean": 0.0, "kl": 0.0, "frac_zero_std_groups": 1.0})
  notes = [s for s in said if "learned nothing" in s]
  assert len(notes) == 1 and notes[0].startswith("note step 6: every group's rewards were equal")


def test_reward_hacking_alarm_sees_a_slow_slide_over_its_window():
  """Evals every 10 steps, window 20: accuracy sliding 0.02 per eval never falls 0.03 between
  neighbours, but does over the window, while the reward rises (the measured slide of GRPO
  against a biased reward model: 0.766, 0.762, 0.742, 0.723, 0.699)."""
  said = []
  alarms = grpo.Alarms(kl_threshold=0.1, window=20, out=said.append)
  fired = [alarms.on_eval(0, 0.766)["alarm/reward_hacking"]]
  for step, acc in ((10, 0.762), (20, 0.742), (30, 0.723), (40, 0.699)):
    for s in range(step - 9, step + 1):
      alarms.on_step(s, {"reward/mean": 0.01 * s, "kl": 0.0})
    fired.append(alarms.on_eval(step, acc)["alarm/reward_hacking"])
  # step 20 compares with step 0 (-0.024), step 30 with 10 (-0.039), step 40 with 20 (-0.043)
  assert fired == [0.0, 0.0, 0.0, 1.0, 1.0]
  assert any("0.762 -> 0.723" in s for s in said)
  # A flat reward with the same slide is not hacking (the policy is just getting worse).
  flat = grpo.Alarms(kl_threshold=0.1, window=20, out=said.append)
  flat.on_eval(0, 0.766)
  for step, acc in ((10, 0.762), (20, 0.742), (30, 0.723), (40, 0.699)):
    for s in range(step - 9, step + 1):
      flat.on_step(s, {"reward/mean": 0.5, "kl": 0.0})
    assert flat.on_eval(step, acc)["alarm/reward_hacking"] == 0.0


def test_pulse_run_logs_every_metric_and_resumes(repo_root, tmp_path, devices, monkeypatch,
                                                 caplog):
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  workdir = str(tmp_path / "grpo")
  # The adaptive KL controller on, with a short horizon so beta moves visibly every step.
  adaptive = ["algo.kl_target=0.001", "algo.kl_horizon=100"]
  summary = grpo.run(config_lib.load_config(spec, adaptive), workdir, out=lambda *a: None)
  assert summary["status"] == "completed" and summary["step"] == 2
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]  # the starting point
  rows = rows[1:]
  assert [r["step"] for r in rows] == [1, 2]
  for name in STEP_METRICS:
    assert all(name in r for r in rows), name
  # Model TFLOP/s per phase (jaxrl.models.flops): the reference forward and the update count
  # the same batch, the update as forward + backward (3 forwards) per iteration.
  iters = config_lib.load_config(spec, adaptive).algo.num_iterations
  for r in rows:
    assert all(r[f"perf/tflops/{k}"] > 0 for k in ("gen", "ref", "update")), r
    assert (r["perf/tflops/update"] * r["timing_s/update"] == pytest.approx(
        3 * iters * r["perf/tflops/ref"] * r["timing_s/ref"], rel=1e-6))
  assert "eval/accuracy" in rows[-1]
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert rows[0]["is_ratio/mean"] == pytest.approx(1.0, abs=1e-3)  # sampler == learner
  # The checkpoint serves `jaxrl sample --checkpoint`: the params it loads are the run's own.
  from jaxrl.sampler import command
  from jaxrl.io.params import restore_params
  trained = summary["state"].params
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          trained)
  with caplog.at_level("WARNING"):
    restored = restore_params(workdir, abstract)
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # orbax warned on every restore that the step's _CHECKPOINT_METADATA (one level up) is missing
  assert not [r.getMessage() for r in caplog.records if "does not exist" in r.getMessage()]
  # A relative run path, as `make demo` passes runs/demo/sft (orbax wants absolute paths).
  monkeypatch.chdir(tmp_path)
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(restore_params("grpo", abstract))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  monkeypatch.undo()
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "12+7="}\n')
  sample_cfg = config_lib.load_config(os.path.join(repo_root, "configs/sample_tiny.py"))
  out = command.run(sample_cfg, prompts_path=str(prompts), workdir=str(tmp_path / "s"), n=2,
                    checkpoint=workdir, progress=False, out=lambda *a: None)
  assert len(out["rollout"].lengths) == 2 and os.path.exists(out["path"])
  # Re-running with more steps resumes from the checkpoint at step 2.
  lines = []
  summary = grpo.run(config_lib.load_config(spec, adaptive + ["train.steps=3"]), workdir,
                     out=lines.append)
  assert summary["step"] == 3 and any("resuming" in s for s in lines)
  assert any("train.steps: 2 -> 3" in s for s in lines)  # a changed config is never silent
  lines.clear()  # run again as it is, it says it is done and where its summary is
  grpo.run(config_lib.load_config(spec, adaptive + ["train.steps=3"]), workdir, out=lines.append)
  assert (f"this run is already complete (step 3 of 3): its summary is {workdir}/summary.json "
          "(raise train.steps to train on).") in lines, lines
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  # The resumed step continues from the beta step 2 reached, not from algo.beta again...
  from jaxrl.objectives import losses
  def moved(beta):
    return losses.adaptive_kl_beta(beta, kl=rows[3]["kl"], target=0.001, horizon=100,
                                   n_steps=16)
  assert rows[1]["kl/beta"] != 0.04 and rows[2]["kl/beta"] != rows[1]["kl/beta"]
  assert rows[3]["kl/beta"] == pytest.approx(moved(rows[2]["kl/beta"]), rel=1e-12)
  assert moved(rows[2]["kl/beta"]) != pytest.approx(moved(0.04), rel=1e-9)
  # ...and kl/max spans every step, the ones before the restart included.
  assert summary["kl/max"] == max(r["kl"] for r in rows[1:])


@pytest.mark.slow
def test_demo_grpo_raises_heldout_accuracy_above_sft(tmp_path, sft_slip, bars):
  """`jaxrl demo` as `make demo` runs it (a subprocess on 8 CPU devices with the default XLA
  flags, not this suite's faster-compiling ones), resumed after its SFT phase: its sft/ run dir is a
  copy of the committed sft_slip run (tests/fixtures/sft_slip: the demo's own SFT settings,
  jaxrl.demo.SFT_OVERRIDES, seed 0, one device; held-out 0.645), so the demo restores it onto its
  8-device mesh and runs GRPO with the verifier. Held-out greedy accuracy (GRPO's own eval, step 0
  to the end, on this seed's held-out prompts) must rise clearly above the SFT start with KL below
  0.12. Over GRPO seeds 0-4 from an sft_slip trained in the suite then (SFT seed 0, held-out 0.586),
  the demo's GRPO stage on 8 CPU devices (`jaxrl launch --config configs/grpo_tiny.py --seeds 0-4`
  with jaxrl.demo.GRPO_OVERRIDES; AMD EPYC, YNNPACK dots, 2026-12-03; docs/guides/recipes.md; the
  held-out prompts follow the seed): gain median +0.145 (+0.109 to +0.199), seed 0 0.586 -> 0.746;
  KL max 0.053-0.088, no alarm. The demo whole (its SFT seed varied too) gained +0.094 to +0.265
  over seeds 0-4 on 1 device and +0.101 to +0.239 on 8. The demo's SFT phase is not re-run:
  test_recipe_gsm8k holds SFT's own learning bars.

  Over the 12 cells of tools/learning_sweep.py (docs/design.md, Testing; 2026-12-07), from the
  committed sft_slip, the four ISA x dot-kernel cells of each seed gave the same figures to the last
  digit (GRPO from one checkpoint is bit-identical under both dot kernels and both ISA levels on
  this AMD EPYC, as jaxrl/backends/cpu/dots.py found), so the spread is the three seeds': gain
  +0.102 to +0.148, KL max 0.059-0.096 (the alarm's 0.1 never reached). Bars: +0.06 and KL 0.12, as
  after the sweep with sft_slip retrained per cell (worst gain +0.090 there, KL 0.109 once). The six
  AVX-512 cells (an Intel Xeon with AMX) gave the AMD's figures seed for seed.

  cells (ISA dots seed: held-out gain; KL max):
  AVX2 eigen 0: +0.109, +0.071
  AVX2 ynnpack 0: +0.109, +0.071
  AVX eigen 0: +0.109, +0.071
  AVX ynnpack 0: +0.109, +0.071
  AVX2 eigen 1: +0.148, +0.096
  AVX2 ynnpack 1: +0.148, +0.096
  AVX eigen 1: +0.148, +0.096
  AVX ynnpack 1: +0.148, +0.096
  AVX2 eigen 2: +0.102, +0.059
  AVX2 ynnpack 2: +0.102, +0.059
  AVX eigen 2: +0.102, +0.059
  AVX ynnpack 2: +0.102, +0.059
  AVX-512 cells (an Intel Xeon with AMX, 2 cores, 2026-12-07; --isa native):
  AVX-512 eigen 0: +0.109, +0.071
  AVX-512 ynnpack 0: +0.109, +0.071
  AVX-512 eigen 1: +0.148, +0.096
  AVX-512 ynnpack 1: +0.148, +0.096
  AVX-512 eigen 2: +0.102, +0.059
  AVX-512 ynnpack 2: +0.102, +0.059"""
  import shutil
  workdir = tmp_path / "demo"
  shutil.copytree(sft_slip, workdir / "sft")
  # A relative --workdir, as `make demo` gives runs/demo.
  res = jaxrl_cli(["demo", "--workdir", "demo", f"--config.seed={LEARN_SEED}"], cwd=tmp_path,
                  devices=8)
  stdout = res.stdout
  assert "Traceback" not in res.stderr
  assert f"resuming from {workdir / 'sft' / 'checkpoints'} at step 1000" in stdout
  assert "after GRPO" in stdout and "* resumed (SFT from step 1000)" in stdout
  # The fixture's SFT config is the demo's own, but for the seed (the test's, a sweep's GRPO
  # seed; the fixture is seed 0) and the backend (the fixture's CPU may not be this one).
  from jaxrl.train.rundir import read_config
  fixture, resumed = (
      {k: v for k, v in read_config(d).items() if k not in ("seed", "backend")}
      for d in (sft_slip, workdir / "sft"))
  assert fixture == resumed
  result = json.load(open(workdir / "summary.json"))
  # The demo reports its SFT stage's own figure (the fixture's, on seed 0's held-out prompts);
  # the gain is read from GRPO's step-0 eval, the SFT policy on this seed's prompts.
  assert result["sft"]["eval/accuracy"] == json.load(
      open(workdir / "sft" / "summary.json"))["eval"]["eval/accuracy"]
  rows = [json.loads(line) for line in open(workdir / "grpo" / "metrics.jsonl")]
  sft_acc = next(r["eval/accuracy"] for r in rows if r["step"] == 0)
  grpo_acc = result["grpo"]["eval/accuracy"]
  bars.above("held-out gain", grpo_acc - sft_acc, 0.06)
  bars.below("KL max", result["grpo"]["kl/max"], 0.12)
  bars.check()
  assert result["grpo"]["alarms"]["kl"] == 0
  # a real PNG with three panels (summary paths are relative to where the demo ran)
  assert os.path.getsize(tmp_path / result["plot"]) > 10_000
  assert result["grpo"]["steps"] == 80 and set(result["grpo"]["time_split"]) == {
      "gen", "score", "ref", "update", "sync"}


@pytest.mark.slow
def test_two_processes_match_one_process(repo_root, tmp_path, sft_addition, free_port,
                                         devices):
  """GRPO on a multi-process mesh, as on a TPU pod slice: 2 processes x 4 CPU devices (gloo),
  disaggregated, train the same run as this process's 8 devices colocated. Every process reads
  the sampler's outputs, the log-probs and the scores whole (gathered across processes), so all
  make the same host-side choices, and each feeds its own shards of the batch. (Before, the
  rollout's first read of a sharded array raised a RuntimeError on every process.) Each
  process gives half its devices to each side and the sync goes through the hosts (the device
  sets differ); synchronous, disaggregated trains the same run as colocated. Colocated on two
  processes differs only in the sync (jax.device_put within one device set); it was checked by
  hand, and is left out to keep the suite within its time."""
  import subprocess
  args = ["grpo", "--config", "configs/grpo_tiny.py:runlocal",
          f"--config.init.checkpoint={sft_addition}"]
  one = str(tmp_path / "one")
  grpo.run(config_lib.load_config(os.path.join(repo_root, "configs/grpo_tiny.py:runlocal"),
                                  [f"init.checkpoint={sft_addition}"]), one, out=lambda *a: None)
  m1 = read_metrics(one)
  assert [m["step"] for m in m1] == [0, 1, 2]
  assert m1[1]["reward/std"] > 0  # rewards varied, so the update did something to compare
  two = str(tmp_path / "two")
  procs = [subprocess.Popen(
      [JAXRL, *args, "--config.placement.mode=disaggregated", "--workdir", two,
       f"--config.distributed.coordinator_address=127.0.0.1:{free_port}",
       "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
      env=subprocess_env(4), cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  assert "step 2/2" in outs[0] and "step 2/2" not in outs[1]  # process 0 reports
  # Both processes saved their prompt-stream position with the checkpoint.
  assert sorted(os.listdir(os.path.join(two, "checkpoints", "2", "data"))) == [
      "commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"]
  m2 = read_metrics(two)
  assert [m["step"] for m in m2] == [0, 1, 2]
  for a, b in zip(m1, m2):
    # The same samples, so the same rewards and lengths, to the bit.
    for key in ("reward/mean", "accuracy", "response_length/mean", "frac_zero_std_groups",
                "eval/accuracy"):
      assert b.get(key) == a.get(key), (a["step"], key)
    for key in ("loss", "grad_norm", "entropy", "kl"):
      if key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (a["step"], key)


def test_async_generation_is_one_step_stale_and_otherwise_the_same(repo_root, tmp_path, devices):
  """Async mode generates step k+1's rollout during step k's update, with step k's weights.
  With the weights frozen (lr 1e-30) that changes nothing: the same prompts, seeds and params give
  the same rewards as the synchronous run, step by step; only the staleness differs."""
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  common = ["train.steps=3", "optim.lr=1e-30", "eval.every=0", "placement.mode=disaggregated"]
  rows = {}
  for name, extra in (("sync", []), ("async", ["rollout.async_generation=True"])):
    workdir = str(tmp_path / name)
    grpo.run(config_lib.load_config(spec, common + extra), workdir, out=lambda *a: None)
    rows[name] = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))
                  if "reward/mean" in line]
  assert [r["staleness/mean"] for r in rows["sync"]] == [0.0, 0.0, 0.0]
  assert [r["staleness/mean"] for r in rows["async"]] == [0.0, 1.0, 1.0]
  for s, a in zip(rows["sync"], rows["async"]):
    for key in ("reward/mean", "response_length/mean", "loss"):
      assert a[key] == pytest.approx(s[key], rel=1e-5), key
    assert a["timing_s/gen_wait"] >= 0.0 and a["timing_s/gen"] > 0.0


def test_a_step_by_hand_is_the_runs_step(repo_root, tmp_path, devices):
  """A notebook's GRPO step: setup(), then the roles' calls (scored_rollouts ->
  learner_forwards -> group_advantages -> update) and step_metrics by hand, is run()'s first
  step to the bit (the same prompts, seeds, params and programs)."""
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  overrides = ["train.steps=1", "eval.every=0"]
  grpo.run(config_lib.load_config(spec, overrides), str(tmp_path / "run"), out=lambda *a: None)
  logged = read_metrics(str(tmp_path / "run"))[-1]
  p, state = grpo.setup(config_lib.load_config(spec, overrides), str(tmp_path / "hand"),
                        out=lambda *a: None)
  try:
    scored = grpo.scored_rollouts(p, state, next(p.rollouts.stream), 0)
    f = grpo.learner_forwards(p, state, scored)
    experience = f.experience(p, grpo.group_advantages(p, f))
    # One update per step: the update's own forward gives the old log-probs.
    assert grpo.old_logp_from_update(p.config.algo)
    assert experience.old_sums is None and "old_logp" not in experience.batch
    assert experience.batch["adv"].shape == experience.batch["mask"].shape
    state, upd = grpo.update(p, state, experience)
    metrics = grpo.step_metrics(p, experience, upd)
  finally:
    p.close()
  assert int(jax.device_get(state.step)) == 1
  for key in ("loss", "grad_norm", "kl", "entropy", "is_ratio/mean", "clipfrac/low",
              "reward/mean", "accuracy", "frac_zero_std_groups", "staleness/mean"):
    assert metrics[key] == logged[key], key


def test_async_generation_needs_disaggregated_placement(repo_root, tmp_path):
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  with pytest.raises(ConfigError, match=r"rollout.async_generation=True needs "
                     r"placement.mode=disaggregated"):
    grpo.run(config_lib.load_config(spec, ["rollout.async_generation=True"]),
             str(tmp_path / "x"), out=lambda *a: None)


def test_prompt_stream_checkpoints_its_host_state_as_marked():
  """PromptStream.get_state() returns the extras as of the last mark(), so what a background
  rollout adds after it (async generation scoring step k+1 while step k is saved) waits for
  the next mark; set_state() marks what it restores."""
  from jaxrl.rewards.model import RunningNorm
  norm = RunningNorm(1)
  stream = grpo.PromptStream([{"prompt": str(i)} for i in range(8)], 2, seed=0,
                             extras={"rm_norm": norm})
  norm.normalize(np.ones((1, 4)))
  stream.mark()
  norm.normalize(np.zeros((1, 4)))  # the next step's batch, scored in the background
  saved = stream.get_state()
  assert saved["rm_norm"]["count"] == 4 and saved["rm_norm"]["mean"] == [1.0]
  stream.mark()
  assert stream.get_state()["rm_norm"]["count"] == 8
  restored = RunningNorm(1)
  other = grpo.PromptStream([{"prompt": str(i)} for i in range(8)], 2, seed=0,
                            extras={"rm_norm": restored})
  other.set_state(saved)
  assert restored.count == 4 and other.get_state()["rm_norm"]["count"] == 4


def test_prompt_stream_saves_learner_state_as_it_is_and_alarms_resume():
  """The learner's own host state (the KL coefficient, the alarms' history) is saved as it is
  at get_state(), not as of the last mark(): the step's update and alarms run after it. A
  stream restored from it gives back the coefficient, kl/max, the raised counts, and the evals
  the reward-hacking check compares against."""
  said = []
  beta = grpo.KLCoefficient(0.04)
  alarms = grpo.Alarms(kl_threshold=0.1, window=2, out=said.append)
  records = [{"prompt": str(i)} for i in range(8)]
  stream = grpo.PromptStream(records, 2, seed=0, learner_state={"kl_coef": beta,
                                                                 "alarms": alarms})
  alarms.on_eval(0, 0.80)
  stream.mark()
  for step, kl in ((1, 0.02), (2, 0.5), (3, 0.03)):
    alarms.on_step(step, {"reward/mean": 0.1 * step, "kl": kl})
  beta.value = 0.05  # the adaptive controller moved it after the mark
  alarms.on_eval(3, 0.79)
  saved = json.loads(json.dumps(stream.get_state()))  # as the checkpoint writes it
  assert saved["kl_coef"] == {"value": 0.05}
  beta2 = grpo.KLCoefficient(0.04)
  alarms2 = grpo.Alarms(kl_threshold=0.1, window=2, out=said.append)
  grpo.PromptStream(records, 2, seed=0, learner_state={"kl_coef": beta2, "alarms": alarms2}
                    ).set_state(saved)
  assert beta2.value == 0.05 and alarms2.kl_max == 0.5 and alarms2.raised["kl"] == 1
  # Step 5's eval compares with step 3's (window 2), known only from the restored history:
  # reward up, accuracy down 0.09, so the alarm fires after the resume as it would have without.
  for step in (4, 5):
    alarms2.on_step(step, {"reward/mean": 0.1 * step, "kl": 0.0})
  assert alarms2.on_eval(5, 0.70)["alarm/reward_hacking"] == 1.0
  assert any("0.790 -> 0.700" in s for s in said)
  # A checkpoint from before this state existed restores the rest and keeps these as configured.
  beta3 = grpo.KLCoefficient(0.04)
  grpo.PromptStream(records, 2, seed=0, learner_state={"kl_coef": beta3}).set_state(
      {"epoch": 0, "pos": 2})
  assert beta3.value == 0.04


def test_grouped_batch_accumulates_whole_groups(devices):
  """optim.accum_steps on the shared-prompt batch: each micro-batch holds whole groups (a
  prompt with its own G completions), so accumulating gives the one-batch update."""
  cfg = get_preset("tiny")
  mesh = make_mesh(devices=jax.devices()[:2])  # 4 prompts per device: 2 per micro-batch
  rng = np.random.default_rng(3)
  P, G, Tc = 8, 4, 5
  prompts = [list(rng.integers(3, 200, size=int(n))) for n in rng.integers(2, 9, size=P)]
  comps = [list(rng.integers(3, 200, size=int(n))) for n in rng.integers(1, Tc + 1, size=P * G)]
  rollout = _rollout([prompts[i // G] for i in range(P * G)], comps,
                     [list(rng.normal(size=len(c)) - 3.0) for c in comps])
  rollout = dataclasses.replace(rollout, prompt_index=np.repeat(np.arange(P), G))
  batch = grpo.grouped_learner_batch(rollout, prompt_len=16, group=G, pad_id=0)
  mask = batch["mask"]
  batch.update(ref_logp=np.zeros_like(mask) - 3.0, beta=np.full_like(mask, 0.04),
               adv=np.repeat(rng.normal(size=(P * G, 1)).astype(np.float32), Tc, 1))
  tx, sched = make_optimizer(optim_section(lr=1e-3, warmup_steps=0, weight_decay=0.0,
                                           eps=1.0), 10)
  bs = batch_sharding(mesh, 2, "learner")
  results = {}
  for accum in (1, 2):
    graphdef, state, shd = init_train_state(cfg, mesh, tx, seed=0)
    loss = grpo.grpo_loss(graphdef, grpo.algo_section(beta=0.04), temperature=1.0, norm_len=Tc)
    step = make_train_step(loss, tx, sched, shd, bs, mesh=mesh, accum_steps=accum)
    state, metrics = step(state, put_batch(batch, bs))
    results[accum] = (jax.device_get(state.params), jax.device_get(metrics))
  (p1, m1), (p2, m2) = results[1], results[2]
  for key in ("loss", "kl", "grad_norm", "is_ratio_tokens", "tokens"):
    assert float(m2[key]) == pytest.approx(float(m1[key]), rel=1e-4, abs=1e-6), key
  for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8)
