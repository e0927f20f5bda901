"""Async GRPO's rollout producer: a background thread on the sampler's devices that keeps
generating finished groups into a bounded queue, at most `max_staleness` (k) policy versions
behind the learner step that consumes them.

    queue = RolloutQueue(sample=..., stream=..., batch=B, max_staleness=k, ...)
    queue.publish(version, sampler_params)   # the learner, each step (k = 1: after take)
    taken = queue.take(step)                 # the learner: step's B groups, in order

The producer works in *units*: unit j is the prompt stream's next B prompts, sampled with the
seed of (run seed, j) (the synchronous run's step-j seed) and scored. Each finished group is
then filtered (dynamic sampling drops groups whose G rewards are all equal), assigned to the
learner step its queue position falls in (the step of kept group q is q // B), and tagged with
the policy version that sampled it.

Reproducibility. Nothing here depends on thread timing: the producer is sequential, and the
version a unit is sampled with is fixed by the queue position of its first group (step s),
    version(unit) = max(floor, s - k), or max(floor, s - k + 1) when k > 1 and the unit starts
    mid-step (dynamic sampling), so that its tail, which may fall in step s + 1, is k stale
(floor: the version the run started or resumed at), never "the newest weights at hand". The
producer waits for that version to be published: this is the bound that keeps the queue
(about (k + 1) x B groups) and the sampler copies alive (up to k + 1) bounded. A group whose
step minus that version (before the floor) would exceed k is dropped and counted
(rollout/dropped_stale): it happens only with k = 1 and dynamic sampling, when a unit
straddles two steps (its version could not be one later: that is the step being filled). With
k = 1 and no filtering this is the previous async mode exactly: step n's rollout is sampled
with step n-1's weights.

Dynamic sampling: a step's groups come from as many units as it takes to fill B with groups of
non-equal rewards; the (1 + algo.max_refill_rounds)-th unit started for one step keeps its
all-equal groups too (zero advantage), as the synchronous refill does, so a task the policy
always solves cannot stall the run.

Partial rollouts (partial=True): a unit starts on the newest version published (at least its
own), and generate() asks for the newest again before every decode call, so a sequence in
flight continues under newer weights; each token carries its version (Rollout.versions) and a
group is dated by its oldest token, which keeps it within k. The switch points follow thread
timing: reproducible only with frozen weights. Across processes every process's producer runs
the same decode program, so all must switch at the same call: `agree(v)` returns process 0's
newest version (through jax.distributed's key-value store, made by the trainer), and
a process that has not yet published that version waits for it. Its learner is never waiting
on this producer then: process 0 published v after taking step v - 1's groups (step v's with
k = 1), which come from units every process had finished by the call that read v, so each
process's learner publishes v too (the weight sync is a collective of the learners). Agreed
versions only grow, so the copy waited for is never freed.

Streaming (streamer=..., with partial rollouts): instead of one generate() call per unit, one
streaming driver (jaxrl.sampler.rollout.generate_stream) keeps the sampler's slots busy across
units: when a unit's short completions finish, the next unit's groups take their slots (a
group's G slots together, sharing its prompt's prefill), while the unit's long completions
still decode. Each slot keeps its own unit's key, so a group's tokens are the non-streaming
ones for the same weights. A unit is opened (its prompts drawn from the stream) when the driver
has G free slots and no opened unit's group waits, and once the newest published version is at
least its gate: max(floor, L - k) while other opened units are in flight, max(floor,
min(L - k, F - 1)) when none is. L is the step its last group can fall in (every opened unit's
groups counted as kept), F the step its first group falls in (the same count; with dynamic
sampling, where it is not known, none of them counted). Without dynamic sampling L = F = the
unit's step, so the gate is the non-streaming version step - k (with k = 1 units cannot
overlap: streaming helps from k = 2). F - 1 is published once the learner waits for step F, so
with nothing in flight the producer never waits for a version the learner publishes only
after it; with units in flight it does not wait at all (it decodes them, and asks again).
With k >= 2 no group is then ever too stale (L <= F + 1 when nothing is in flight). Units
are emitted in order when their last group finishes, and scored, filtered, assigned to steps
and checkpointed exactly as above (step, round and stream positions are decided then, in unit
order); a group is dated by its oldest token and dropped (counted) if that is more than k
before its step, which the gate prevents except with dynamic sampling and k = 1 (as without
streaming). The queue then runs ahead of the learner by about as many units as without
streaming. Across processes the admissions must be
the same on every process (each runs the same decode programs): whether a unit opens while
others are in flight (wait=False) is decided by process 0's newest version (the same `agree`,
at the same driver call everywhere, since every process's driver state is the same
tokens), and a process that has not yet published the version it waits for.

Taking turns (serial=True: several processes on CPU). Multi-process JAX on CPU (gloo
collectives) hangs when two threads of a process run programs with collectives at once, even on
disjoint device sets: 2 processes x 4 CPU devices, one thread looping a sharded matmul-and-sum
over 2 devices of each process and another over the other 2, hang within a few hundred calls
where the same calls one thread after the other finish (jax 0.12; tools/gloo_two_threads.py).
Every learner and sampler program of a multi-process run has collectives, so there the producer
and the learner take turns, at points every process reaches with the same queue: the learner
hands the producer the turn when take() finds its step's groups not yet in, and the producer
hands it back after putting the unit that completes them (nothing of its own is in flight then:
the streaming driver is suspended at its yield). Nothing overlaps, so each process runs the
same programs in the same order, and the run is the same as with overlap (the versions a unit
may use follow the queue, not the timing; with partial rollouts the newest version at each
decode call is then fixed too). On TPU and GPU the queue is not serial: the threads overlap as
above (untested across hosts here: no multi-host accelerator).

Resume rule (checkpoint_state / RolloutQueue(resume=...)): a checkpoint after step n records
the unit that step n's last group came from (its index, the stream position before it, the
reward normaliser's state before it) and how many of its groups the learner has handled. A
resumed run generates that unit again, whole (same prompts, same seed), and discards its
first `skip` groups; every later unit follows. Prompts are thus neither lost nor used twice;
the groups in flight are regenerated with the resumed weights (so with a moving policy the
first steps after a resume are fresher than they would have been; with frozen weights the
resumed run is the uninterrupted one, group for group).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import threading
import time
from typing import Any, Callable

import numpy as np

from jaxrl.objectives import advantages as adv_lib


@dataclasses.dataclass
class Group:
  """One prompt's G completions, as the learner takes them."""
  unit: int               # the unit that sampled it
  index: int              # its prompt's index in the unit (0..B-1)
  version: int            # the policy version that sampled it
  step: int               # the learner step that takes it
  zero_std: bool          # its G rewards are all equal (kept only to fill a step)
  partial: float = 0.0    # the fraction of its G sequences sampled by more than one version


@dataclasses.dataclass
class Unit:
  """B prompts sampled and scored together, and what a resume needs to sample them again."""
  index: int
  version: int
  rollout: Any            # the Rollout of B x G rows
  rewards_bg: np.ndarray  # [B, G]
  reward_stats: dict
  t_gen: float            # its generation's wall time, scoring excluded
  start: dict             # the prompt stream's state before it: epoch, pos, extras
  end: dict | None = None  # ... and after it (the next unit's start)
  step: int = 0           # the step its first group fell in
  nominal: int = 0        # the version the drop rule holds it to (before the floor)
  round: int = 1          # it is the round-th unit started for that step


@dataclasses.dataclass
class Taken:
  """A learner step's B groups (`units` holds every unit they came from) and the queue's
  metrics since the previous take."""
  groups: list[Group]
  units: dict[int, Unit]
  new: list[Unit]         # the units first taken from now (their generation is this step's)
  metrics: dict


class _Closed(Exception):
  """The queue closed while the producer waited for an agreed version."""


class RolloutQueue:
  """The producer thread and its bounded queue of finished groups (see the module docstring).

  `sample(params, prompts, unit[, weights=]) -> (rollout, rewards [B*G], reward_stats)`
  samples and scores one unit (`weights` only with partial rollouts); `stream` is a
  PromptStream whose position the producer advances (the learner's own stream stays the
  checkpointed one); `snapshot()` returns the host state scoring changes (the
  reward normaliser) for a resume; `release(params)` frees a sampler copy no unit needs any
  more; `agree(version) -> version` (partial rollouts across processes) is process 0's
  version, the same on every process. No unit is started for `end_step` (the run's
  train.steps) or later.

  Streaming (see the module docstring): `streamer(next_unit, weights)` yields (tag, rollout)
  per unit in the order next_unit(wait) -> (tag, prompts) opened them (generate_stream over
  the engine), and `score(rollout, prompts) -> (rewards [B*G], reward_stats)` scores one."""

  def __init__(self, *, sample: Callable, stream, batch: int, group: int, max_staleness: int,
               filter_zero_std: bool = False, max_refill_rounds: int = 3, partial: bool = False,
               start_step: int = 0, end_step: int | None = None, resume: dict | None = None,
               snapshot: Callable[[], dict] = dict,
               release: Callable[[Any], None] = lambda params: None,
               agree: Callable[[int], int] | None = None, streamer: Callable | None = None,
               score: Callable | None = None, serial: bool = False):
    self.sample, self.stream, self.B, self.G = sample, stream, batch, group
    self.k, self.filter, self.rounds = max_staleness, filter_zero_std, max_refill_rounds
    self.partial = partial
    self.streaming, self.score = streamer, score
    if streamer is not None and not (partial and score is not None):
      raise ValueError("RolloutQueue: streaming needs partial rollouts and a score function")
    self.snapshot, self.release, self.agree = snapshot, release, agree
    self.floor = start_step  # the oldest version this run will have: the one it starts with
    self.end_step = end_step  # no unit is started for this step or later (the run's end)
    self.unit = int((resume or {}).get("unit", start_step))
    self.skip = int((resume or {}).get("skip", 0))
    self.skip_unit = self.unit  # the unit whose first `skip` groups a resume discards
    if self.skip:
      self.resumed_step = int(resume["unit_step"])
      self.resumed_nominal = int(resume["nominal"])
      self.resumed_round = int(resume["round"])
    self.filled = start_step * batch  # kept groups assigned to steps, counted from step 0
    self.units_for_step: dict[int, int] = collections.Counter()
    self._cond = threading.Condition()
    self._weights: dict[int, Any] = {}
    self._queue: collections.deque[Group] = collections.deque()
    self._units: dict[int, Unit] = {}
    self._dropped: dict[int, int] = collections.Counter()  # step -> groups dropped for it
    self._busy_s = 0.0  # the producer's generation seconds since the last take
    self._since = time.perf_counter()
    self._error: BaseException | None = None
    self._closed = False
    self.last: Group | None = None  # the last group taken
    # serial (see "Taking turns" in the module docstring): whose turn it is to run programs.
    self.serial, self._turn, self._taking = serial, "learner", None
    self._thread = threading.Thread(target=self._run, name="jaxrl-sampler", daemon=True)
    self._thread.start()

  # ------------------------------------------------------------------------- the learner side

  def publish(self, version: int, params) -> None:
    """Makes the sampler's copy of policy `version` available to the producer."""
    with self._cond:
      self._weights[version] = params
      self._cond.notify_all()

  def take(self, step: int) -> Taken:
    """Blocks until step's B groups are queued and takes them (queue order: unit, index)."""
    t0 = time.perf_counter()
    with self._cond:
      if self.serial and not self._ready(step):  # the producer's turn, until step's are in
        self._taking, self._turn = step, "producer"
        self._cond.notify_all()
      while not (self._ready(step) and self._turn == "learner"):
        if self._error is not None:
          raise self._error
        if self._closed:
          raise RuntimeError("the rollout producer is closed")
        self._cond.wait(timeout=1.0)
      self._taking = None
      if self._queue[0].step != step:
        raise RuntimeError(f"the learner asked for step {step}'s groups, but the queue "
                           f"starts at step {self._queue[0].step}")
      groups = [self._queue.popleft() for _ in range(self.B)]
      dropped = sum(n for s, n in self._dropped.items() if s <= step)
      for s in [s for s in self._dropped if s <= step]:
        del self._dropped[s]
      units = {g.unit: self._units[g.unit] for g in groups}
      # A unit none of whose groups are queued any more is done with.
      left = {g.unit for g in self._queue}
      for u in [u for u in self._units if u <= groups[-1].unit and u not in left
                and u != groups[-1].unit]:
        del self._units[u]
      new = [u for u in units.values() if self.last is None or u.index > self.last.unit]
      busy, now = self._busy_s, time.perf_counter()
      self._busy_s, since, self._since = 0.0, self._since, now
      queue_len = len(self._queue)
      self._cond.notify_all()
    self.last = groups[-1]
    staleness = np.array([step - g.version for g in groups], np.float64)
    return Taken(groups, units, new, {
        "staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max()),
        "rollout/queue_len": float(queue_len), "rollout/dropped_stale": float(dropped),
        # Groups of equal rewards the step trains on (zero advantage): with dynamic sampling,
        # only when a step ran out of refill rounds.
        "rollout/zero_std_taken": float(np.mean([g.zero_std for g in groups])),
        **({"rollout/partial_frac": float(np.mean([g.partial for g in groups]))}
           if self.partial else {}),
        "timing_s/gen_wait": now - t0,
        # Generation seconds over wall seconds between two takes (capped: a unit counted when
        # it ends may have started in the previous window).
        "perf/sampler_busy": min(busy / max(now - since, 1e-9), 1.0)})

  def checkpoint_state(self) -> dict:
    """Where a resumed run's producer starts: the unit of the last group taken (its stream
    position and host state before it) and how many of its groups are handled."""
    g = self.last
    if g is None:
      return {}
    with self._cond:
      u = self._units[g.unit]
    done = g.index + 1 == self.B
    if done:
      return {**u.end, "unit": g.unit + 1, "skip": 0}
    return {**u.start, "unit": g.unit, "skip": g.index + 1, "unit_step": u.step,
            "nominal": u.nominal, "round": u.round}

  def close(self) -> None:
    """Stops the producer after the unit under way and frees the sampler copies it holds."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    self._thread.join()
    for params in self._weights.values():
      self.release(params)
    self._weights.clear()
    self._units.clear()  # their rollouts' arrays go now, not when a cycle is next collected
    self._queue.clear()

  def _ready(self, step: int) -> bool:
    return len(self._queue) >= self.B and self._queue[self.B - 1].step == step

  # ------------------------------------------------------------------------- the producer side

  def _run(self) -> None:
    """The producer thread: either loop below, with its end and its error handed to take()."""
    try:
      self._await_turn()
      if self.streaming is not None:
        self._produce_streaming()
      else:
        self._produce()
    except _Closed:
      return
    except BaseException as e:  # the learner re-raises it from take()
      with self._cond:
        self._error = e
        self._cond.notify_all()
    finally:
      with self._cond:  # nothing more to run: the learner's turn from now on
        self._turn = "learner"
        self._cond.notify_all()

  def _await_turn(self) -> None:
    """serial: blocks until the learner hands the producer its turn (take); raises _Closed
    when the queue closes meanwhile."""
    with self._cond:
      while self.serial and self._turn != "producer" and not self._closed:
        self._cond.wait()
      if self._closed:
        raise _Closed()

  def _hand_back(self) -> None:
    """serial: after a unit is put, the learner's turn once the step it waits for is in
    (a point every process reaches with the same queue); then waits for the next turn."""
    if not self.serial:
      return
    with self._cond:
      if self._taking is None or not self._ready(self._taking):
        return
      self._turn = "learner"
      self._cond.notify_all()
    self._await_turn()

  def _produce(self) -> None:
    """One unit at a time: wait for its gate version, sample it, put its groups."""
    while True:
      step = self.filled // self.B
      if self.end_step is not None and step >= self.end_step:
        return
      nominal = self._nominal(step)
      if self.skip:  # the partly handled unit a resume samples again: as it was decided
        step, nominal = self.resumed_step, self.resumed_nominal
        self.units_for_step[step] = self.resumed_round - 1
      version, params = self._wait_for(max(self.floor, nominal))
      if params is None:
        return
      start = {"epoch": self.stream.epoch, "pos": self.stream.pos, **self.snapshot()}
      prompts = next(self.stream)
      t0 = time.perf_counter()
      if self.partial:  # newer weights as they come, between decode calls
        rollout, rewards, reward_stats = self.sample(params, prompts, self.unit,
                                                     weights=self._newest)
      else:
        rollout, rewards, reward_stats = self.sample(params, prompts, self.unit)
      t_gen = time.perf_counter() - t0 - reward_stats.get("timing_s/reward", 0.0)
      self.units_for_step[step] += 1
      end = {"epoch": self.stream.epoch, "pos": self.stream.pos, **self.snapshot()}
      self._put(Unit(self.unit, version, rollout, np.asarray(rewards).reshape(-1, self.G),
                     reward_stats, t_gen, start, end, step, nominal,
                     self.units_for_step[step]), step, nominal)
      self.unit += 1
      self._hand_back()

  def _produce_streaming(self) -> None:
    """The producer with streaming (see the module docstring): units are opened by the
    driver's next_unit and put in order as it yields them."""
    self._open: collections.deque[dict] = collections.deque()  # opened, not yet put
    for (index, prompts), rollout in self.streaming(self._next_unit, self._stream_weights):
      info = self._open.popleft()
      step = self.filled // self.B
      nominal = self._nominal(step)
      if index == self.skip_unit and self.skip:  # as it was decided before the resume
        step, nominal = self.resumed_step, self.resumed_nominal
        self.units_for_step[step] = self.resumed_round - 1
      start = {**info["start"], **self.snapshot()}
      rewards, reward_stats = self.score(rollout, prompts)
      self.units_for_step[step] += 1
      end = {**info["end"], **self.snapshot()}
      versions = rollout.versions[rollout.versions >= 0]
      self._put(Unit(index, int(versions.min()) if versions.size else info["gate"],
                     rollout, np.asarray(rewards).reshape(-1, self.G), reward_stats,
                     rollout.stats["gen_s"], start, end, step, nominal,
                     self.units_for_step[step]), step, nominal)
      self._hand_back()  # (the driver is suspended at its yield: no program in flight)

  def _next_unit(self, wait: bool):
    """Streaming: (tag, prompts) of the next unit once its gate version is published (see the
    module docstring); None when it is not yet (wait=False), or there is none (the run's end,
    or the queue closed)."""
    ahead = sum(self.B - o["skip"] for o in self._open)  # the opened units' groups, all kept
    if self.end_step is not None and (
        self.filled + (0 if self.filter else ahead)) // self.B >= self.end_step:
      return None
    skip = self.skip if self.unit == self.skip_unit else 0
    last = (self.filled + ahead + self.B - 1 - skip) // self.B
    first = (self.filled + (0 if self.filter else ahead)) // self.B
    # With units in flight the learner's wait is theirs to end: the gate may be the strict one.
    gate = max(self.floor, last - self.k if ahead else min(last - self.k, first - 1))
    if self.agree is not None and not wait:
      # Across processes process 0's newest version decides (one store read, at the same
      # driver call on every process); a process that has not published it yet waits for it.
      with self._cond:
        newest = max(self._weights, default=-1)
      if self.agree(newest) < gate:
        return None
      wait = True
    with self._cond:
      while not self._closed and max(self._weights, default=-1) < gate:
        if not wait:
          return None
        self._cond.wait()
      if self._closed:
        return None
    start = {"epoch": self.stream.epoch, "pos": self.stream.pos}
    prompts = next(self.stream)
    self._open.append({"start": start, "end": {"epoch": self.stream.epoch,
                                               "pos": self.stream.pos},
                       "skip": skip, "gate": gate})
    self.unit += 1
    return (self.unit - 1, prompts), prompts

  def _stream_weights(self):
    """The newest weights, before each prefill and decode call of the streaming driver; a
    closed queue stops it there."""
    if self._closed:
      raise _Closed()
    return self._newest()

  def _nominal(self, step: int) -> int:
    """The version a unit whose first group falls in `step` is sampled with, before the
    floor: step - k; one later when it starts mid-step (it may then reach into step + 1, which
    must not see it more than k stale) and k > 1 (with k = 1 that version is published only
    after this step's groups are taken)."""
    return step - self.k + (self.k > 1 and self.filled % self.B != 0)

  def _wait_for(self, version: int):
    """(version, the sampler copy of it) once published: with partial rollouts the newest
    published, which may be later. Frees older copies (no unit needs them: versions only
    grow). (version, None) when closed."""
    with self._cond:
      # (Partial: any later one will do; the older ones may already be freed.)
      while not self._closed and not (
          version in self._weights or self.partial and max(self._weights, default=-1) > version):
        self._cond.wait()
      if self._closed:
        return version, None
    return self._newest() if self.partial else self._use(version)

  def _newest(self):
    """(version, params) of the newest copy published (across processes, process 0's newest,
    once published here); frees the older ones. Partial rollouts call it before every prefill
    and decode call (jaxrl.sampler.generate's `weights`)."""
    with self._cond:
      newest = max(self._weights)
    if self.agree is None:
      return self._use(newest)
    version = self.agree(newest)
    with self._cond:
      while not self._closed and version not in self._weights:
        self._cond.wait()
      if self._closed:  # the learner stopped: this unit is never taken
        raise _Closed()
      return self._use(version)

  def _use(self, version: int):
    with self._cond:
      for v in [v for v in self._weights if v < version]:
        self.release(self._weights.pop(v))
      return version, self._weights[version]

  def _put(self, u: Unit, step: int, nominal: int) -> None:
    """Filters, assigns and queues the unit's groups (see the module docstring)."""
    zero = np.asarray(adv_lib.zero_std_groups(rewards_bg=u.rewards_bg))
    # The last unit a step may start keeps its all-equal groups, to fill the step.
    keep_zero = not self.filter or self.units_for_step[step] > self.rounds
    groups, dropped = [], collections.Counter()
    versions = getattr(u.rollout, "versions", None)  # per token, with partial rollouts
    for i in range(self.B):
      if u.index == self.skip_unit and i < self.skip:
        continue  # handled before the resume this unit is regenerated for
      if zero[i] and not keep_zero:
        continue
      s = self.filled // self.B
      version, partial = u.version, 0.0
      if versions is not None:  # the group is as old as its oldest token
        rows = versions[i * self.G:(i + 1) * self.G]
        version = int(rows[rows >= 0].min())
        partial = float(np.mean([len(set(r[r >= 0].tolist())) > 1 for r in rows]))
      # By position, not the floor: a resume decides the same. Streaming: by its own date.
      if (s - version if self.streaming is not None else s - nominal) > self.k:
        dropped[s] += 1
        continue
      groups.append(Group(u.index, i, version, s, bool(zero[i]), partial))
      self.filled += 1
    self.skip = 0
    with self._cond:
      self._units[u.index] = u
      self._queue.extend(groups)
      for s, n in dropped.items():
        self._dropped[s] += n
      self._busy_s += u.t_gen
      self._cond.notify_all()
