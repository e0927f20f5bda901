"""GRPO's reference / old-policy log-prob forward in micro-batches (one lax.scan in one jit):
the values are the unsplit ones, in both batch forms, and the plan counts one micro-batch."""

import numpy as np
import pytest

from jaxrl.models import get_preset
from jaxrl.parallel import batch_sharding, make_mesh
from jaxrl.algorithms import grpo
from jaxrl.algorithms.grpo.update import join_micro, split_micro
from jaxrl.sampler import Rollout
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.train.state import init_train_state, put_batch


def _rollout(rng, P, G, Tc):
  """P prompts of 2-8 tokens, each with G completions of 1..Tc tokens (rows p*G .. p*G+G-1)."""
  prompts = [rng.integers(3, 200, size=int(n)) for n in rng.integers(2, 9, size=P)]
  comps = [rng.integers(3, 200, size=int(n)) for n in rng.integers(1, Tc + 1, size=P * G)]
  N, lp = P * G, max(map(len, prompts))
  pid, cid = np.zeros((N, lp), np.int32), np.zeros((N, Tc), np.int32)
  for i, c in enumerate(comps):
    pid[i, :len(prompts[i // G])], cid[i, :len(c)] = prompts[i // G], c
  return Rollout(prompt_ids=pid, prompt_lengths=np.array([len(prompts[i // G]) for i in range(N)]),
                 completion_ids=cid, completion_mask=(cid > 0).astype(np.int32),
                 logprobs=np.zeros((N, Tc), np.float32),
                 lengths=np.array(list(map(len, comps))), finish_reasons=["stop"] * N,
                 prompt_index=np.repeat(np.arange(P), G), stats={})


def test_split_and_join_keep_groups_and_invert():
  P, G, A = 8, 3, 4
  batch = {"prompt": np.arange(P)[:, None] * np.ones((1, 2), int),
           "completion": np.repeat(np.arange(P), G)[:, None] * np.ones((1, 5), int)}
  micro, units = split_micro(batch, A)
  assert units == P and micro["prompt"].shape == (A, P // A, 2)
  assert micro["completion"].shape == (A, P // A * G, 5)
  for i in range(A):  # each micro-batch holds whole groups: its prompts and their G rows
    np.testing.assert_array_equal(np.repeat(micro["prompt"][i][:, 0], G),
                                  micro["completion"][i][:, 0])
  back = join_micro(micro, units)
  for k in batch:
    np.testing.assert_array_equal(np.asarray(back[k]), batch[k])


@pytest.mark.parametrize("form", ["grouped", "joined"])
def test_micro_batched_logprobs_equal_the_unsplit_ones(devices, form):
  """On 8 CPU devices (each micro-batch keeps every device's own rows) and on one device, with
  and without the entropy: 2 and 4 micro-batches give the unsplit forward's values."""
  cfg = get_preset("tiny")
  mesh = make_mesh()
  P, G, Tc = 16, 2, 6
  rollout = _rollout(np.random.default_rng(0), P, G, Tc)
  tx, _ = make_optimizer(optim_section(lr=1e-3), 10)
  graphdef, state, _ = init_train_state(cfg, mesh, tx, seed=0)
  if form == "grouped":
    b = grpo.grouped_learner_batch(rollout, prompt_len=16, group=G, pad_id=0)
    inputs = ("prompt", "prompt_len", "completion")
  else:
    b = grpo.learner_batch(rollout, length=16 + Tc, pad_id=0)
    inputs = ("inputs", "targets", "positions")
  dev = put_batch({k: b[k] for k in inputs}, batch_sharding(mesh, 2, "learner"))
  for m, parts in ((mesh, 2), (None, 4)):
    for entropy in (True, False):
      whole = grpo.make_batch_logprobs_fn(graphdef, 1.0, mesh=m, entropy=entropy)
      split = grpo.make_batch_logprobs_fn(graphdef, 1.0, mesh=m, entropy=entropy,
                                          micro_batches=parts)
      (l0, e0), (l1, e1) = whole(state.params, dev), split(state.params, dev)
      assert l1.shape == l0.shape and (e1 is None) == (not entropy)
      # Not bitwise: XLA:CPU compiles the scan's body (a while loop over a smaller batch) with
      # other fusions than the straight-line forward, so the vocabulary's sums round
      # differently: a few float32 ulps (measured: 9.5e-7 on log-probs near -5, 2.9e-6 on
      # entropies near 6.2).
      np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=1e-6, atol=1e-6)
      if entropy:
        np.testing.assert_allclose(np.asarray(e1), np.asarray(e0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("accum", [1, 2])
def test_the_trainer_runs_its_logprob_forward_in_the_updates_micro_batches(
    repo_root, devices, tmp_path, accum):
  """setup() builds the forward that make_experience calls with the update's micro-batches:
  a loop over them in the lowered program when optim.accum_steps = 2, none at 1."""
  import os
  from jaxrl import config as config_lib
  from jaxrl.algorithms.grpo.trainer import setup
  config = config_lib.load_config(os.path.join(repo_root, "configs/grpo_tiny.py:runlocal"),
                                  [f"optim.accum_steps={accum}"], grpo.CHOICES)
  p, state = setup(config, str(tmp_path / "run"), out=lambda *a, **k: None)
  try:
    rollout = _rollout(np.random.default_rng(1), 4, 4, 8)
    b = grpo.learner_batch(rollout, length=p.rollouts.length, pad_id=0)
    dev = p.put({k: b[k] for k in ("inputs", "targets", "positions")})
    hlo = p.learner.logprobs_fn.lower(state.params, dev).as_text()
    assert ("stablehlo.while" in hlo) == (accum > 1)
    assert np.isfinite(np.asarray(p.learner.logprobs_fn(state.params, dev)[0])).all()
  finally:
    p.close()
