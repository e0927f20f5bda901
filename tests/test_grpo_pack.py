"""algo.pack_completions: each group's completions packed into rows below its shared prompt
(packing.pack_completions, Transformer.packed_hidden, update.packed_logprobs)."""

import jax
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.models import get_preset
from jaxrl.parallel import batch_sharding, make_mesh
from jaxrl.algorithms import grpo
from jaxrl.algorithms.grpo.config import grouped_forward
from jaxrl.algorithms.grpo.batch import pack_completions
from jaxrl.sampler import Rollout
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.train.rundir import read_metrics
from jaxrl.train.state import init_train_state, make_train_step, put_batch

from conftest import ROOT


def _long_tail_rollout(rng, P, G, Tc):
  """P prompts of 2-8 tokens with G completions each, most 1-4 tokens and about one in six at
  Tc (the long tail pack_completions is for), with sampler log-probs near -3."""
  N = P * G
  prompts = [rng.integers(3, 200, size=int(n)) for n in rng.integers(2, 9, size=P)]
  lengths = np.where(rng.random(N) < 0.17, Tc, rng.integers(1, 5, size=N))
  lengths[0] = Tc  # at least one full-length completion
  pid = np.zeros((N, 8), np.int32)
  cid = np.zeros((N, Tc), np.int32)
  for n in range(N):
    pid[n, :len(prompts[n // G])] = prompts[n // G]
    cid[n, :lengths[n]] = rng.integers(3, 200, size=lengths[n])
  lps = np.where(cid > 0, rng.normal(size=(N, Tc)) - 3.0, 0.0).astype(np.float32)
  return Rollout(prompt_ids=pid, prompt_lengths=np.repeat([len(p) for p in prompts], G),
                 completion_ids=cid, completion_mask=(cid > 0).astype(np.int32), logprobs=lps,
                 lengths=lengths, finish_reasons=["stop"] * N,
                 prompt_index=np.repeat(np.arange(P), G), stats={})


@pytest.mark.parametrize("parts", [1, 2])
def _batches(seed, P, G, Tc, parts):
  """(rollout, its grouped learner batch, that batch packed for `parts` micro-batches) of a
  long-tailed rollout; the packed rows are fewer than the completions."""
  rollout = _long_tail_rollout(np.random.default_rng(seed), P, G, Tc)
  grouped = grpo.grouped_learner_batch(rollout, prompt_len=8, group=G, pad_id=0)
  packed = pack_completions({**grouped, "completion_len": rollout.lengths}, group=G, pad_id=0,
                            parts=parts)
  assert "completion_len" not in packed and packed["pack_tokens"].shape[0] < P * G
  return rollout, grouped, packed


@pytest.mark.parametrize("parts", [1, 2])
def test_pack_completions_places_every_token_once(parts):
  """Every completion token t >= 1 is the target of exactly one packed position, in a row of
  its own prompt within its own micro-batch (split_micro's: prompt b * parts + i in
  micro-batch i), predicted by its token t - 1 at offset t - 1; with a long tail the rows are
  fewer than the completions."""
  P, G, Tc = 6, 8, 12
  rollout, batch, packed = _batches(0, P, G, Tc, parts)
  W = Tc - 1
  R = packed["pack_tokens"].shape[0]
  u = R // P
  assert R == P * u and packed["pack_tokens"].shape == (R, W)
  per = P // parts
  used = np.zeros((R, W), int)
  for n in range(P * G):
    p, L = n // G, rollout.lengths[n]
    i, b = p % parts, p // parts  # its micro-batch and its place there
    for t in range(1, L):
      k, col = divmod(int(packed["pack_index"][n, t]), W)  # the micro-batch's row k
      assert k < per * u
      row = (k // u * parts + i) * u + k % u
      used[row, col] += 1
      assert packed["pack_prompt"][row, 0] == b
      assert packed["pack_targets"][row, col] == batch["completion"][n, t]
      assert packed["pack_tokens"][row, col] == batch["completion"][n, t - 1]
      assert packed["pack_offsets"][row, col] == t - 1
      assert packed["pack_segments"][row, col] > 0
  # each real position used once, padding (segment 0) never
  np.testing.assert_array_equal(used, (packed["pack_segments"] > 0).astype(int))


@pytest.mark.parametrize("micro", [1, 2])
def test_packed_forward_equals_the_grouped_forward(devices, micro):
  """The packed batch gives the grouped batch's log-probs and entropy on every completion
  token (sharded over 8 devices; micro-batches split whole groups with their rows), and the
  same update: loss, metrics and parameters, with optim.accum_steps = micro."""
  cfg = get_preset("tiny")
  mesh = make_mesh()
  P, G, Tc = 16, 4, 10
  _, grouped, packed = _batches(1, P, G, Tc, micro)
  rng = np.random.default_rng(1)
  mask = grouped["mask"]
  extra = {"ref_logp": np.zeros_like(mask) - 3.0, "beta": np.full_like(mask, 0.04),
           "adv": np.repeat(rng.normal(size=(P * G, 1)).astype(np.float32), Tc, 1)}
  tx, sched = make_optimizer(optim_section(lr=1e-3, warmup_steps=0, weight_decay=0.0,
                                           eps=1.0), 10)
  bs = batch_sharding(mesh, 2, "learner")
  a = grpo.algo_section(beta=0.04, tis_cap=2.0)
  out = {}
  for name, batch in (("grouped", grouped), ("packed", packed)):
    graphdef, state, shd = init_train_state(cfg, mesh, tx, seed=0)
    inputs = {k: v for k, v in batch.items() if k not in ("mask", "sampler_logp")}
    logp, entropy = grpo.make_batch_logprobs_fn(graphdef, 1.0, mesh=mesh, micro_batches=micro)(
        state.params, put_batch(inputs, bs))
    ref, none = grpo.make_batch_logprobs_fn(graphdef, 1.0, mesh=mesh, entropy=False,
                                            micro_batches=micro)(
        state.params, put_batch(inputs, bs))
    assert none is None
    step = make_train_step(grpo.grpo_loss(graphdef, a, temperature=1.0, norm_len=Tc), tx,
                           sched, shd, bs, mesh=mesh, accum_steps=micro)
    state, metrics = step(state, put_batch({**batch, **extra}, bs))
    out[name] = dict(logp=np.asarray(logp), entropy=np.asarray(entropy), ref=np.asarray(ref),
                     params=jax.device_get(state.params), metrics=jax.device_get(metrics))
  m = mask > 0
  g, p = out["grouped"], out["packed"]
  for key in ("logp", "entropy", "ref"):
    np.testing.assert_allclose(p[key][m], g[key][m], rtol=0, atol=2e-5, err_msg=key)
  for key in ("loss", "kl", "grad_norm", "is_ratio_tokens", "tokens", "entropy_tokens"):
    assert float(p["metrics"][key]) == pytest.approx(float(g["metrics"][key]), rel=1e-4,
                                                    abs=1e-6), key
  for x, y in zip(jax.tree.leaves(g["params"]), jax.tree.leaves(p["params"])):
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)


def test_pack_completions_needs_the_shared_prompt_forward():
  config = config_lib.load_config(f"{ROOT}/configs/grpo_tiny.py", [
      "algo.pack_completions=True", "algo.shared_prompt_forward=False"])
  with pytest.raises(ConfigError, match="algo.pack_completions packs .* algo.shared_prompt_forward=False"):
    grouped_forward(config, 1, lambda *a: None)


@pytest.mark.parametrize("trainer,spec,extra", [
    ("grpo", "configs/grpo_tiny.py:runlocal", []),
    ("ppo", "configs/ppo_tiny.py:runlocal", ["train.steps=3"]),
])
def test_a_packed_run_matches_the_padded_run(tmp_path, devices, trainer, spec, extra,
                                             monkeypatch):
  """A run with algo.pack_completions samples what the padded run samples and logs the same
  loss, KL, entropy and clip fractions at every step (the same programs' values within float32
  rounding): GRPO and PPO (whose actor packs). Async runs build their learner batch in the
  same learner_forwards; which version samples what there depends on timing."""
  from jaxrl.algorithms import ppo
  module = {"grpo": grpo, "ppo": ppo}[trainer]
  choices = {"ppo": ppo.CHOICES}.get(trainer)
  from jaxrl.algorithms.grpo import batch as packing
  calls = []  # (rows, completions) of each batch the programs took packed

  def counted(batch, **kw):
    out = pack_completions(batch, **kw)
    calls.append((out["pack_tokens"].shape[0], out["completion"].shape[0]))
    return out
  monkeypatch.setattr(packing, "pack_completions", counted)
  rows = {}
  for pack in (False, True):
    config = config_lib.load_config(
        f"{ROOT}/{spec}", ["eval.every=0", "rollout.prompts_per_step=8",
                           f"algo.pack_completions={pack}", *extra], choices)
    workdir = str(tmp_path / f"{trainer}-{pack}")
    assert module.run(config, workdir, out=lambda *a: None)["status"] == "completed"
    rows[pack] = read_metrics(workdir)
  assert len(rows[True]) == len(rows[False]) >= 2
  # the packed run's forwards (one a step) and its actor's updates (PPO's first step is the
  # critic's warm-up) took packed batches
  assert len(calls) >= 2 * len(rows[True]) - (trainer == "ppo"), calls
  compared = 0
  for padded, packed in zip(rows[False], rows[True]):
    assert packed["reward/mean"] == padded["reward/mean"]
    assert packed["response_length/mean"] == padded["response_length/mean"]
    for key in ("loss", "kl", "entropy", "clipfrac/low", "clipfrac/high", "is_ratio/mean"):
      if key in padded:
        assert packed[key] == pytest.approx(padded[key], rel=2e-3, abs=1e-5), key
        compared += 1
  assert compared >= 6
