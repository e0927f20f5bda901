"""Partial rollouts (rollout.partial_rollouts): a sequence in flight when newer weights arrive
continues under them from the next decode call, each token tagged with the version that
sampled it; the rollout queue then dates a group by its oldest token."""

import threading
import time

import numpy as np
import pytest

from jaxrl.models import get_preset
from jaxrl.parallel import init_params, make_mesh
from jaxrl.data.prompts import PromptStream
from jaxrl.algorithms.grpo.producer import RolloutQueue
from jaxrl.sampler import Engine, SamplingParams, generate

PROMPTS = [[1, 40, 41, 42], [1, 50], [1, 7, 8, 9, 10, 11, 12], [1, 60, 61]]


@pytest.fixture(scope="module")
def model(devices):
  mesh = make_mesh(1, 2, 4)
  cfg = get_preset("tiny-qwen2")
  graphdef, p0 = init_params(cfg, mesh, "sampler", seed=0)
  _, p1 = init_params(cfg, mesh, "sampler", seed=1)
  # Spread the logits (as tests/test_sampler.py does) so greedy choices are not float ties.
  return mesh, cfg, graphdef, dict(p0, embed=p0["embed"] * 5.0), dict(p1, embed=p1["embed"] * 5.0)


def test_weights_change_between_decode_calls_and_tokens_keep_their_versions(model):
  """Version 0 for the prefill and the first decode call, version 1 after: every sequence's
  first 1 + steps_per_call tokens (and their log-probs) are the all-version-0 run's, tagged 0,
  the rest are sampled by version 1 over the cache version 0 wrote, tagged 1, with no
  recompile and no restart."""
  mesh, cfg, graphdef, p0, p1 = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(greedy=True, max_new_tokens=13,
                                                               eos_id=None))
  plain = generate(engine, p0, PROMPTS, n=1, slots=4, steps_per_call=4)
  traces = dict(engine.traces)
  calls = []

  def weights():  # one prefill call (one length bucket), then the decode calls
    calls.append(len(calls))
    return (0, p0) if len(calls) <= 2 else (1, p1)

  r = generate(engine, p0, PROMPTS, n=1, slots=4, steps_per_call=4, weights=weights)
  assert dict(engine.traces) == traces  # the new weights needed no compile
  assert len(calls) == 4  # prefill + 3 decode calls of 4 tokens: 1 + 12 = 13 tokens
  assert r.versions.shape == r.completion_ids.shape
  np.testing.assert_array_equal(r.versions, np.array([[0] * 5 + [1] * 8] * 4))
  np.testing.assert_array_equal(r.completion_ids[:, :5], plain.completion_ids[:, :5])
  np.testing.assert_allclose(r.logprobs[:, :5], plain.logprobs[:, :5], rtol=1e-6)
  # After the switch version 1 chose: the continuations are not version 0's.
  assert (r.completion_ids[:, 5:] != plain.completion_ids[:, 5:]).any()
  assert plain.versions is None  # without `weights` nothing changes


def test_partial_rollouts_are_dated_by_their_oldest_token():
  """The queue with partial rollouts: a unit starts on the newest published version, picks up
  newer ones between decode calls (the stand-in sampler waits for one mid-unit), and each
  group's version is its oldest token's, so staleness stays within k; rollout/partial_frac
  counts the sequences that span versions."""
  B, G, k = 2, 2, 2
  started, published = threading.Event(), threading.Event()

  def sample(params, prompts, unit, weights):
    v_start, _ = weights()
    if unit == 2:  # wait, mid-unit, for the learner's next version (published after take 0)
      started.set()
      assert published.wait(timeout=30)
    v_end, _ = weights()
    versions = np.array([[v_start] * 3 + [v_end] * 2, [v_start] * 5] * B, np.int32)
    rollout = type("R", (), {"versions": versions})()
    rewards = np.random.default_rng(unit).random(B * G)
    return rollout, rewards, {}

  records = [{"prompt": str(i)} for i in range(40)]
  q = RolloutQueue(sample=sample, stream=PromptStream(records, B, seed=0), batch=B, group=G,
                   max_staleness=k, partial=True, end_step=4)
  try:
    q.publish(0, "v0")
    taken = [q.take(0)]
    assert started.wait(timeout=30)  # units 1 and 2 began on version 0
    q.publish(1, "v1")
    published.set()
    for step in (1, 2, 3):
      taken.append(q.take(step))
      q.publish(step + 1, f"v{step + 1}")
  finally:
    q.close()
  # Unit 2 started on version 0 and finished on 1: its groups are dated 0 (the oldest token),
  # half their sequences span two versions.
  assert [g.version for g in taken[2].groups] == [0, 0]
  assert taken[2].metrics["rollout/partial_frac"] == 0.5
  assert taken[2].metrics["staleness/max"] == 2
  for step, t in enumerate(taken):
    assert all(step - g.version <= k for g in t.groups)
    assert "rollout/partial_frac" in t.metrics


def test_two_processes_switch_weights_at_the_same_decode_call():
  """Partial rollouts across processes, simulated by two queues in two threads: "process 1"
  publishes each version later than "process 0" does, so the newest copy it holds often
  differs from process 0's. With `agree` (process 0's newest, as the trainer's one-integer
  collective over the sampler's devices returns it) both producers use the same version at
  every prefill and decode call, process 1 waiting for a version it has not published yet, and
  neither deadlocks although process 1's learner takes before it publishes."""
  B, G, k, steps, calls_per_unit = 2, 2, 2, 6, 4
  decided: list[int] = []  # process 0's choice at each call, in call order
  cond = threading.Condition()

  def agree(rank):
    def fn(newest):
      with cond:
        if rank == 0:
          decided.append(newest)
          cond.notify_all()
          return newest
        n = len(seen[1])
        assert cond.wait_for(lambda: len(decided) > n, timeout=30)
        return decided[n]
    return fn

  seen = {0: [], 1: []}  # per process: (its newest before agreeing, the version used)

  def sampler(rank):
    def sample(params, prompts, unit, weights):
      used = []
      for _ in range(calls_per_unit):
        v, copy = weights()
        assert copy == f"v{v}"  # the copy of the version agreed, never another's
        used.append(v)
        time.sleep(0.01)
      versions = np.array([used + [used[-1]]] * (B * G), np.int32)
      rollout = type("R", (), {"versions": versions})()
      return rollout, np.random.default_rng(unit).random(B * G), {}
    return sample

  queues = []
  for rank in (0, 1):
    q = RolloutQueue(sample=sampler(rank), stream=PromptStream(
        [{"prompt": str(i)} for i in range(60)], B, seed=0), batch=B, group=G,
        max_staleness=k, partial=True, end_step=steps, agree=agree(rank))
    newest = q._newest

    def tracked(q=q, rank=rank, newest=newest):  # record the local newest before agreeing
      with q._cond:
        local = max(q._weights)
      v, copy = newest()
      seen[rank].append((local, v))
      return v, copy
    q._newest = tracked
    queues.append(q)

  taken = {0: [], 1: []}

  def learner(rank):
    q = queues[rank]
    q.publish(0, "v0")
    for step in range(steps):
      taken[rank].append(q.take(step))
      if step:
        time.sleep(0.05 * rank)  # process 1's weights arrive later
        q.publish(step, f"v{step}")

  threads = [threading.Thread(target=learner, args=(rank,)) for rank in (0, 1)]
  try:
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a learner is stuck"
  finally:
    for q in queues:
      q.close()
  used = {rank: [v for _, v in seen[rank]] for rank in (0, 1)}
  assert used[0] == used[1] == decided[:len(used[0])]
  assert len(used[0]) >= steps * calls_per_unit
  assert len(set(used[0])) > 1  # the weights did change under the units
  # Process 1 did hold a different newest copy at some calls, and still used process 0's.
  assert any(local != v for local, v in seen[1])
  for rank in (0, 1):
    assert [[g.version for g in t.groups] for t in taken[rank]] == [
        [g.version for g in t.groups] for t in taken[0]]
    assert all(s - g.version <= k for s, t in enumerate(taken[rank]) for g in t.groups)


@pytest.mark.parametrize("k", [1, 2])
def test_streaming_gives_the_non_streaming_groups_within_k(model, k):
  """Streaming (rollout.streaming) over a real engine with frozen weights (every version the
  same params): the next unit's groups take the slots the current unit's short completions
  free, and every step's groups are the non-streaming queue's, rewards and lengths group for
  group (each unit keeps its own key); every group is at most k versions behind its step.
  About 20 s on 2 cores, both k."""
  from jaxrl.sampler.rollout import generate_stream
  mesh, cfg, graphdef, p0, _ = model
  # Every 7th token stops: most completions are short, a few run to 24 (the long tail).
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(
      max_new_tokens=24, stop_ids=tuple(range(0, 512, 7))))
  B, G, steps = 2, 3, 5
  records = [{"prompt": str(i), "ids": PROMPTS[i % 4] + [100 + i]} for i in range(40)]

  def score(rollout, prompts):  # a reward of the tokens, so equal rewards mean equal samples
    return (rollout.completion_ids.sum(1) % 5).astype(np.float32), {"timing_s/reward": 0.0}

  def sample(params, prompts, unit, weights=None):
    rollout = generate(engine, params, [x["ids"] for x in prompts], n=G, slots=4,
                       steps_per_call=4, seed=unit, max_prompt_len=16, weights=weights)
    return (rollout, *score(rollout, prompts))

  opened = []

  def stream(next_unit, weights):
    def opened_unit(wait):
      got = next_unit(wait)
      if got is not None:
        opened.append(wait)
        return got[0], [x["ids"] for x in got[1]], got[0][0]
      return None
    return generate_stream(engine, opened_unit, weights=weights, n=G, slots=4,
                           steps_per_call=4, max_prompt_len=16)

  def run(**kw):
    q = RolloutQueue(sample=sample, stream=PromptStream(records, B, seed=0), batch=B, group=G,
                     max_staleness=k, partial=True, end_step=steps, **kw)
    taken = []
    try:
      q.publish(0, p0)
      for step in range(steps):
        taken.append(q.take(step))
        if step:
          q.publish(step, p0)
    finally:
      q.close()
    return taken

  plain, streamed = run(), run(streamer=stream, score=score)
  # With k = 1 unit n waits for version n - 1, published once unit n - 1 is taken: it cannot
  # overlap. From k = 2 it can.
  assert k == 1 or any(not w for w in opened), "no unit was opened beside another's live slots"
  lengths = []
  for step, (a, b) in enumerate(zip(plain, streamed)):
    assert [(g.unit, g.index) for g in a.groups] == [(g.unit, g.index) for g in b.groups]
    for ga, gb in zip(a.groups, b.groups):
      ua, ub = a.units[ga.unit], b.units[gb.unit]
      np.testing.assert_array_equal(ua.rewards_bg[ga.index], ub.rewards_bg[gb.index])
      rows = slice(ga.index * G, (ga.index + 1) * G)
      np.testing.assert_array_equal(ua.rollout.lengths[rows], ub.rollout.lengths[rows])
      np.testing.assert_array_equal(ua.rollout.completion_ids[rows],
                                    ub.rollout.completion_ids[rows])
      lengths += ub.rollout.lengths[rows].tolist()
      assert step - gb.version <= k
    assert b.metrics["staleness/max"] <= k and b.metrics["rollout/dropped_stale"] == 0
  assert len(set(lengths)) > 3 and max(lengths) >= 4 * np.median(lengths), \
      "no long tail: the test shows nothing"
