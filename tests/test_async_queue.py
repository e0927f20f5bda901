"""Async GRPO's rollout queue (jaxrl/algorithms/grpo/producer.py) with a stand-in sampler: the version
each group is sampled with, the staleness bound, drops, dynamic sampling's refill and the resume
rule. No model: the stand-in's rewards are a function of (prompt, unit), so these run in
milliseconds; tests/test_async_grpo.py runs the real thing."""

import threading
import time

import numpy as np
import pytest

from jaxrl.data.prompts import PromptStream
from jaxrl.algorithms.grpo.producer import RolloutQueue

G = 4


def _records(n, zero_every=0):
  """n prompts; with zero_every, every zero_every-th one gets G equal rewards."""
  return [{"prompt": str(i), "id": i, "zero": bool(zero_every) and i % zero_every == 0}
          for i in range(n)]


def _sample(calls):
  """A stand-in sampler: G rewards per prompt from (prompt, unit); all equal for `zero`
  prompts. Records (params, prompt ids, unit) of every call."""
  def sample(params, prompts, unit):
    calls.append((params, [x["id"] for x in prompts], unit))
    rng = np.random.default_rng([unit, *[x["id"] for x in prompts]])
    rewards = rng.random((len(prompts), G))
    rewards[[x["zero"] for x in prompts]] = 1.0
    return {"ids": [x["id"] for x in prompts]}, rewards.reshape(-1), {"timing_s/reward": 0.0}
  return sample


def _run(queue, steps, start=0, released=None):
  """The learner's side: publish version `start` first, then take each step's groups and
  publish that step's version after (as queued_rollouts does)."""
  out = []
  queue.publish(start, start)
  for step in range(start, start + steps):
    taken = queue.take(step)
    out.append(taken)
    if step > start:
      queue.publish(step, step)
  return out


def _queue(records, B, k, calls, stream=None, **kw):
  stream = stream or PromptStream(records, B, seed=0)
  return RolloutQueue(sample=_sample(calls), stream=stream, batch=B, group=G, max_staleness=k,
                      **kw)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_versions_are_fixed_by_position_and_never_more_than_k_stale(k):
  """Without dynamic sampling, unit n is step n's B prompts in stream order, sampled with
  version max(0, n - k) (never the newest at hand), so staleness is exactly min(n, k)."""
  B, calls, released = 3, [], []
  stream = PromptStream(_records(20), B, seed=0)
  order = [x["id"] for x in PromptStream(_records(20), 6 * B, seed=0).__next__()]
  q = _queue(_records(20), B, k, calls, stream=stream, release=released.append, end_step=6)
  try:
    taken = _run(q, 6)
  finally:
    q.close()
  for step, t in enumerate(taken):
    assert [g.unit for g in t.groups] == [step] * B
    assert [g.version for g in t.groups] == [max(0, step - k)] * B
    assert t.metrics["staleness/max"] == t.metrics["staleness/mean"] == min(step, k)
    assert t.metrics["rollout/dropped_stale"] == 0
    assert 0.0 <= t.metrics["perf/sampler_busy"] <= 1.0 and t.metrics["timing_s/gen_wait"] >= 0
    assert t.metrics["rollout/queue_len"] <= k * B
  # The sampler ran on the version the position says, with the stream's prompts in order.
  assert [c[0] for c in calls] == [max(0, n - k) for n in range(6)]  # none past the end
  assert [i for c in calls for i in c[1]] == order
  # Every copy a unit no longer needs was freed, the rest at close.
  assert sorted(released) == sorted(set(released)) and set(released) == set(range(6))


@pytest.mark.parametrize("k", [1, 2])
def test_dynamic_sampling_refills_b_and_counts_what_it_drops(k):
  """Zero-variance groups are filtered at the queue and the producer samples more units until
  every step has B groups of varied rewards. With k = 1 a unit that straddles two steps has its
  tail dropped (it would be 2 stale), and counted; with k = 2 such a unit is sampled one
  version later and nothing is dropped. Every sampled group is taken, filtered or dropped,
  once."""
  B, calls = 4, []
  q = _queue(_records(64, zero_every=3), B, k, calls, filter_zero_std=True)
  try:
    taken = _run(q, 6)
  finally:
    q.close()
  dropped = sum(t.metrics["rollout/dropped_stale"] for t in taken)
  for step, t in enumerate(taken):
    assert len(t.groups) == B and not any(g.zero_std for g in t.groups)
    assert all(step - g.version <= k for g in t.groups)
    assert t.metrics["staleness/max"] <= k
  # With 1 in 3 groups filtered, units straddle steps.
  assert dropped > 0 if k == 1 else dropped == 0
  seen = [(g.unit, g.index) for t in taken for g in t.groups]
  assert len(seen) == len(set(seen))
  last = taken[-1].groups[-1]
  zero = sum(x["zero"] for _, ids, u in calls if u <= last.unit
             for x in _records(64, 3) if x["id"] in ids)
  # Units up to the last group's, whose groups before it were all decided.
  decided = sum(len(ids) for _, ids, u in calls if u < last.unit) + last.index + 1
  tail_zero = sum(_records(64, 3)[i]["zero"] for i in calls[last.unit][1][last.index + 1:])
  assert decided == len(seen) + dropped + (zero - tail_zero)


def test_a_step_that_cannot_be_refilled_keeps_its_equal_groups():
  """When every group scores the same, the (1 + max_refill_rounds)-th unit started for a step
  keeps its equal groups (zero advantage), as the synchronous refill does: the run goes on."""
  B, calls = 2, []
  q = _queue(_records(40, zero_every=1), B, 2, calls, filter_zero_std=True, max_refill_rounds=2)
  try:
    taken = _run(q, 2)
  finally:
    q.close()
  assert [g.unit for g in taken[0].groups] == [2, 2]  # units 0 and 1 were filtered whole
  assert all(g.zero_std for t in taken for g in t.groups)


@pytest.mark.parametrize("k, filter_zero_std", [(2, False), (2, True), (1, True)])
def test_resume_mid_queue_regenerates_in_flight_groups_and_loses_no_prompt(k, filter_zero_std):
  """Resume rule: the checkpoint after step n names the unit of step n's last group and how
  many of its groups are handled; the resumed producer samples that unit again (same prompts,
  same seed) and skips them. With frozen weights the resumed run takes the uninterrupted run's
  groups, prompt for prompt; no prompt is lost or taken twice."""
  B, records = 4, _records(50, zero_every=3)

  def prompts(taken, calls):
    ids = {c[2]: c[1] for c in calls}
    return [ids[g.unit][g.index] for t in taken for g in t.groups]

  calls = []
  q = _queue(records, B, k, calls, filter_zero_std=filter_zero_std)
  try:
    whole = prompts(_run(q, 6), calls)
  finally:
    q.close()
  whole_calls = calls

  calls = []
  stream = PromptStream(records, B, seed=0)
  q = _queue(records, B, k, calls, stream=stream, filter_zero_std=filter_zero_std)
  try:
    first = _run(q, 3)
    state = q.checkpoint_state()
  finally:
    q.close()
  before = prompts(first, calls)
  if filter_zero_std:
    assert state["skip"] > 0  # the interesting case: step 2 ended inside a unit
  resumed = PromptStream(records, B, seed=0)
  resumed.set_state(state)
  calls2 = []
  q = _queue(records, B, k, calls2, stream=resumed.clone(), resume=resumed.resume_queue,
             start_step=3, filter_zero_std=filter_zero_std)
  try:
    after = _run(q, 3, start=3)
  finally:
    q.close()
  assert calls2[0][2] == state["unit"] and calls2[0][1] == [
      c[1] for c in whole_calls if c[2] == state["unit"]][0]  # that unit, again
  assert before + prompts(after, calls2) == whole
  assert len(set(whole)) == len(whole)


def _rewards(prompts):
  """G rewards per prompt from its id alone (all equal for `zero` prompts)."""
  rng = np.random.default_rng([x["id"] for x in prompts])
  rewards = rng.random((len(prompts), G))
  rewards[[x["zero"] for x in prompts]] = 1.0
  return rewards.reshape(-1)


def _streamer(next_unit, weights):
  """A stand-in streaming driver: keeps two units in flight, emits them in order, each token
  dated by the weights at its emission."""
  pending = []
  while True:
    got = next_unit(not pending)  # wait only when nothing is in flight
    if got is not None:
      pending.append(got)
      if len(pending) < 2:
        continue
    if not pending:
      return
    tag, prompts = pending.pop(0)
    version, _ = weights()
    versions = np.full((len(prompts) * G, 3), version, np.int32)
    yield tag, type("R", (), {"versions": versions, "stats": {"gen_s": 0.0}})()


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("serial", [False, True])
def test_streaming_with_dynamic_sampling_refills_and_stays_within_k(k, serial):
  """Streaming (the producer's streamer path) with dynamic sampling: every step still gets B
  groups of unequal rewards and no group is more than k versions behind its step. With k = 2
  they are the same (unit, index) groups in the same order as without streaming, none dropped;
  with k = 1 both drop groups of units straddling two steps, the non-streaming queue by
  position and streaming by the tokens' date, which need not be the same groups. serial=True
  (the producer and learner taking turns, as on several CPU processes): the same, streamed."""
  B, steps = 3, 6

  def sample(params, prompts, unit, weights=None):
    versions = np.full((len(prompts) * G, 3), weights()[0], np.int32)
    return type("R", (), {"versions": versions})(), _rewards(prompts), {}

  def run(**kw):
    q = RolloutQueue(sample=sample, stream=PromptStream(_records(60, zero_every=3), B, seed=0),
                     batch=B, group=G, max_staleness=k, filter_zero_std=True, partial=True,
                     end_step=steps, **kw)
    try:
      return _run(q, steps)
    finally:
      q.close()

  plain = run()
  streamed = run(streamer=_streamer, score=lambda rollout, prompts: (_rewards(prompts), {}),
                 serial=serial)
  assert any(g.unit > s for s, t in enumerate(streamed) for g in t.groups)  # refills happened
  if k > 1:
    assert sum(t.metrics["rollout/dropped_stale"] for t in streamed) == 0
  for step, (a, b) in enumerate(zip(plain, streamed)):
    if k > 1:
      assert [(g.unit, g.index) for g in a.groups] == [(g.unit, g.index) for g in b.groups]
    assert not any(g.zero_std for g in b.groups)
    assert all(step - g.version <= k for g in b.groups)
    assert b.metrics["staleness/max"] <= k


@pytest.mark.parametrize("k,filter_zero_std", [(1, False), (2, False), (1, True), (2, True)])
def test_serial_turns_never_overlap_and_take_the_same_groups(k, filter_zero_std):
  """serial=True (several CPU processes, producer.py "Taking turns"): the stand-in sampler
  never runs while the learner holds its turn (between a take and the next, where its
  programs run), and the learner gets the groups, versions and drops of the overlapping
  queue."""

  def run(serial):
    calls, learner_busy, overlaps = [], threading.Event(), []
    inner = _sample(calls)

    def sample(params, prompts, unit):
      overlaps.append(learner_busy.is_set())
      time.sleep(0.002)  # time for the learner to overlap, were it allowed to
      return inner(params, prompts, unit)

    q = RolloutQueue(sample=sample, stream=PromptStream(_records(64, zero_every=3), 4, seed=0),
                     batch=4, group=G, max_staleness=k, filter_zero_std=filter_zero_std,
                     end_step=6, serial=serial)
    taken = []
    try:
      q.publish(0, 0)
      for step in range(6):
        taken.append(q.take(step))
        learner_busy.set()  # the learner's programs: weight sync, forwards, update
        if step > 0:
          q.publish(step, step)
        time.sleep(0.05)
        learner_busy.clear()
    finally:
      q.close()
    return [[(g.unit, g.index, g.version, g.step) for g in t.groups] for t in taken], \
        [t.metrics["rollout/dropped_stale"] for t in taken], overlaps

  groups, dropped, overlaps = run(serial=True)
  assert overlaps and not any(overlaps)
  groups_free, dropped_free, overlaps_free = run(serial=False)
  assert groups == groups_free and dropped == dropped_free
  assert any(overlaps_free)  # without turns the two do overlap: the check above can fail
