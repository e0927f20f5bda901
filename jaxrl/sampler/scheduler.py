"""The rollout scheduler: one owner of the decode slots, the admission policy, the page book
and the token records, fed by the rollout drivers: jaxrl.sampler.rollout's `generate` (a fixed
prompt set) and `generate_stream` (streamed units), and jaxrl.envs.rollout's `continued`
(conversations, whose slots are held while an environment steps and then extended).

    sched = Scheduler(engine, options, n=G, max_prompt_len=P)
    queue = deque(sched.open(Unit(tag, prompts, key, G)))  # every (unit, sample) to generate
    while queue or sched.busy():
      sched.admit(queue, params)                          # prefill + insert into free slots
      sched.preempt(queue)                                # paged, optimistic: pool outgrown
      sched.decode(params)                                # steps_per_call tokens, every slot

A unit is a set of prompts with one sampling key, each prompt's n samples numbered i * n + g.
The scheduler numbers every open unit's samples in one sequence (a unit whose first prompt is
the base-th opened: base * n + s), which the page book reads. The queue holds samples, not
groups: a free slot takes the queue's next sample, and a prompt's prefix (one prefill, shared
by its group unless options.share_prefix is off) is kept while any of its samples still waits.
A token's key is (unit key, sample, token), whatever slot or call draws it, so how samples are
admitted changes the work, never the tokens.

With `kv_cache="paged"` the slots share a pool of `kv_pages` KV pages of `page_size` positions
(docs/design.md, "The paged KV cache") instead of a dense [slots, window] cache: a group's
prompt pages are shared by its samples, and a finished sample's pages go back to the pool, so
the number of live samples is bounded by pages, not by slots x max_len. `kv_admission` says
when a waiting sample takes a free slot (_PageBook): "optimistic" (the default) when the free
pages hold its prompt and its first decode call's growth, and before each decode call the most
recently admitted samples are preempted (their pages freed, their tokens dropped, back to the
front of the queue) until the others' next call fits; "reserve" only while the unreserved
pages hold its worst case (prompt + max_new tokens, its group's shared prompt pages counted
once), so nothing is ever preempted. A preempted sample is generated again from its prompt,
and since its tokens' keys are (seed, sample, token) it comes back the same: either way the
samples are the dense cache's, token for token.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from itertools import islice
from typing import Any, Callable

import numpy as np

from jaxrl.errors import ConfigError
from jaxrl.parallel.distributed import to_host
from jaxrl.sampler.engine import Engine, bucket, window, window_bucket

ADMISSIONS = ("optimistic", "reserve")  # rollout.kv_admission (see _PageBook)
PEAKS = ("live_peak", "kv_positions_peak", "kv_pages_peak")  # counters that are maxima


@dataclasses.dataclass(frozen=True)
class Options:
  """How the scheduler batches, built once from config.rollout (`from_config`).

  grow_cache=False allocates the whole cache up front: one decode compile instead of up to two
  per doubling of the sequence, for accelerators where a compile costs more than the reads
  the growing window saves. kv_cache="paged": a paged KV cache of kv_pages pages (default:
  enough for every slot at max_len, so no slot ever waits for one) of page_size positions,
  admitting samples by kv_admission ("optimistic" or "reserve", see the module docstring).
  continuous=False batches statically (refills only when every slot is free) and
  share_prefix=False prefills each sample's own copy of its prompt: the baselines
  benchmarks/sampler.py compares against (the same samples either way)."""

  slots: int = 16
  steps_per_call: int = 8
  pad_id: int = 0
  grow_cache: bool = True
  kv_cache: str = "dense"
  kv_pages: int | None = None
  page_size: int = 16
  kv_admission: str = "optimistic"
  continuous: bool = True
  share_prefix: bool = True

  @classmethod
  def from_config(cls, rollout, pad_id: int) -> "Options":
    return cls(slots=rollout.slots, steps_per_call=rollout.steps_per_call, pad_id=pad_id,
               grow_cache=rollout.grow_cache, kv_cache=rollout.get("kv_cache", "dense"),
               kv_pages=rollout.get("kv_pages", 0) or None,
               page_size=rollout.get("page_size", 16),
               kv_admission=rollout.get("kv_admission", "optimistic"))


class Unit:
  """Prompts sampled under one key: their samples' tokens, log-probs and weight versions."""

  def __init__(self, tag, prompts, key, n: int):
    self.tag, self.prompts, self.key = tag, [list(map(int, p)) for p in prompts], key
    num = len(self.prompts) * n
    self.toks: list[list[int]] = [[] for _ in range(num)]
    self.lps: list[list[float]] = [[] for _ in range(num)]
    self.vers: list[list[int]] = [[] for _ in range(num)]
    self.left = num  # samples not finished
    self.base = 0  # the scheduler's number of its first prompt (set by Scheduler.open)
    self.t0 = time.perf_counter()
    self.at_open: dict = {}  # the scheduler's counters when it opened


class Scheduler:
  """The slots of one decode state and what occupies them (see the module docstring).
  `weights`, where given, is called before every prefill and decode call and returns
  (version, params) to use from there on (partial rollouts: a sequence in flight continues
  under newer weights, its KV cache as it was written); each token records its version.
  `key`: one key for every decode call (a single unit's, as `generate` has), or None, each
  slot drawing with its own unit's (Engine.generate_steps with key=None). narrow=True also
  narrows the dense window when the longest live sequence has left (a stream of units).

  Multi-turn sources (jaxrl.envs.rollout.continued) pass `on_done(unit, sample, slot)`, called
  when a sample's turn ends: True holds the slot (occupied, not decoding) until the source
  `extend`s it with the environment's answer or `release`s it; `whole_groups` admits a
  prompt's n samples together or not at all; `max_len` replaces prompt + max_new_tokens. With
  a paged cache a held slot keeps its pages (it is freed when its sample finishes), and
  admission must be "reserve", each sample's worst case counted to max_len: preempting a
  conversation would replay its environment."""

  def __init__(self, engine: Engine, opts: Options, *, n: int, max_prompt_len: int,
               key=None, narrow: bool = False, on_done: Callable | None = None,
               whole_groups: bool = False, max_len: int | None = None):
    sp = engine.sampling
    self.engine, self.opts, self.n, self.key, self.narrow = engine, opts, n, key, narrow
    self.on_done, self.whole_groups = on_done, whole_groups
    replicas = engine.mesh.shape["data"] * engine.mesh.shape["fsdp"]
    if opts.slots % replicas:
      raise ConfigError(f"slots={opts.slots} is not divisible by the replica count data x "
                        f"fsdp = {replicas}: choose a multiple of {replicas}.")
    self.max_prompt_len = max_prompt_len
    self.max_len = max_len or max_prompt_len + sp.max_new_tokens
    self.paged = _check_cache(opts.kv_cache, opts.kv_admission)
    self.keep_pages = self.paged and on_done is not None  # held slots keep their KV
    if on_done is not None:
      check_multi_turn(opts.kv_cache, opts.kv_admission)
    self.finished: list[int] = []  # keep_pages: finished slots whose pages are still held
    self.kv_pages = (_check_pages(opts.kv_pages, opts.page_size, opts.slots, self.max_len)
                     if self.paged else None)
    if self.paged:
      self.state = engine.init_paged_state(opts.slots, self.max_len, pages=self.kv_pages,
                                           page_size=opts.page_size)
    else:
      self.state = engine.init_decode_state(
          opts.slots, self.max_len, length=self.fit(max_prompt_len + opts.steps_per_call))
    self.occupant: list = [None] * opts.slots  # slot -> (unit, sample)
    self.held: set[int] = set()  # occupied slots whose turn ended (see on_done)
    self.prompts: dict[int, list[int]] = {}  # open units' prompts, by number
    self.toks: dict[int, list[int]] = {}  # their samples' token lists (the units' own lists)
    self.opened = 0  # prompts opened so far
    self.prefixes: dict = {}  # prefix key -> (prefix, row, version), while samples wait
    self.version = -1
    self.stalled = False  # a live slot waited for a page in the last decode call
    self.counters = dict(prefill_s=0.0, decode_s=0.0, prefill_calls=0, prefill_prompts=0,
                         prefill_tokens=0, decode_steps=0, slot_steps=0, live_slot_steps=0,
                         live_peak=0)
    if self.paged:
      self.counters.update(kv_pages_peak=0, page_wait_calls=0, kv_preemptions=0,
                           kv_preempted_tokens=0)
    else:
      self.counters.update(kv_positions_peak=0)
    self.book = _PageBook(self.prompts, self.toks, n=n, share_prefix=opts.share_prefix,
                          page_size=opts.page_size, num_pages=self.kv_pages or 0,
                          max_new=self.max_len if self.keep_pages else sp.max_new_tokens,
                          max_len=self.max_len,
                          steps=opts.steps_per_call, reserve=opts.kv_admission == "reserve")

  def fit(self, need: int) -> int:
    """The cache window for `need` positions."""
    return min(self.max_len, window_bucket(need)) if self.opts.grow_cache else self.max_len

  def busy(self) -> bool:
    return any(o is not None for o in self.occupant)

  def live(self) -> list[int]:
    """The slots that decode: occupied and not held."""
    return [b for b, o in enumerate(self.occupant) if o is not None and b not in self.held]

  def free(self) -> list[int]:
    return [b for b, o in enumerate(self.occupant) if o is None]

  def open(self, unit: Unit) -> list[tuple]:
    """Registers a unit; returns its samples, (unit, sample), in order, for the queue."""
    longest = max(map(len, unit.prompts), default=1)
    if longest > self.max_prompt_len:
      raise ConfigError(f"a prompt has {longest} tokens, more than max_prompt_len="
                        f"{self.max_prompt_len}: raise it or shorten the prompt.")
    unit.base, unit.at_open = self.opened, dict(self.counters)
    self.prompts.update((self.opened + i, p) for i, p in enumerate(unit.prompts))
    self.toks.update((self.opened * self.n + s, t) for s, t in enumerate(unit.toks))
    self.opened += len(unit.prompts)
    return [(unit, s) for s in range(len(unit.toks))]

  def close(self, unit: Unit) -> None:
    """Forgets a finished unit (its records stay on the unit)."""
    for i in range(len(unit.prompts)):
      del self.prompts[unit.base + i]
    for s in range(len(unit.toks)):
      del self.toks[unit.base * self.n + s]

  def _gid(self, unit: Unit, s: int) -> int:
    return unit.base * self.n + s

  def _prefix_key(self, unit: Unit, s: int):  # the prefix row a sample is inserted from
    g = self._gid(unit, s)
    return g // self.n if self.opts.share_prefix else ("s", g)

  def _params(self, params, weights):
    if weights is not None:
      self.version, params = weights()
    return params

  def _record(self, unit: Unit, s: int, b: int, tok, lp, version: int, done) -> None:
    unit.toks[s].append(int(tok))
    unit.lps[s].append(float(lp))
    unit.vers[s].append(version)
    if done:
      if self.on_done is not None and self.on_done(unit, s, b):
        self.held.add(b)
        return
      self._finish(b)

  def _finish(self, b: int) -> None:
    """Slot b's sample is finished: the slot is free (its pages, held by keep_pages, are freed
    before the next device call)."""
    u, s = self.occupant[b]
    u.left -= 1
    self.occupant[b] = None
    if self.paged:
      self.book.leave(self._gid(u, s))
    if self.keep_pages:
      self.finished.append(b)

  def _free_finished(self) -> None:
    if self.finished:
      self.state = self.engine.evict(self.state, self.finished)
      self.finished = []

  def release(self, b: int) -> None:
    """Frees held slot b: its sample is finished."""
    self.held.discard(b)
    self._finish(b)

  def extend(self, entries, params=None, weights=None) -> None:
    """Continues held slots: entries are (slot, token ids to append, the next turn's sample
    number). One Engine.extend call writes each slot's pending token and the appended ids
    into its own KV (right-padded to a bucket of the longest) and draws the next turn's
    first token (Engine.extend)."""
    opts, c = self.opts, self.counters
    self._free_finished()
    t0 = time.perf_counter()
    T = bucket(max(len(m) for _, m, _ in entries), minimum=8)
    E = min(bucket(len(entries), minimum=1), opts.slots)
    tokens = np.full((E, T), opts.pad_id, np.int32)
    lengths = np.zeros((E,), np.int32)
    where = np.full((E,), opts.slots, np.int32)  # padding entries: dropped
    samples = np.zeros((E,), np.int32)
    for e, (b, m, k) in enumerate(entries):
      tokens[e, :len(m)], lengths[e], where[e], samples[e] = m, len(m), b, k
    # A slot's pending token sits at prompt + (its tokens so far) - 1.
    pos = max(len(u.prompts[s // self.n]) + len(u.toks[s]) - 1
              for u, s in (self.occupant[b] for b, _, _ in entries))
    self.state = self.engine.grow(self.state, self.fit(pos + 1 + T + opts.steps_per_call))
    params = self._params(params, weights)
    self.state, out = self.engine.extend(params, self.state, self.key, slots=where,
                                         tokens_et=tokens, length_e=lengths, samples=samples)
    out = to_host({k: v for k, v in out.items() if k != "logits"})
    c["extend_calls"] = c.get("extend_calls", 0) + 1
    c["prefill_tokens"] += int(lengths.sum())
    c["prefill_s"] += time.perf_counter() - t0
    for e, (b, m, _) in enumerate(entries):
      u, s = self.occupant[b]
      self.held.discard(b)
      u.toks[s] += list(m)
      u.lps[s] += [0.0] * len(m)
      u.vers[s] += [-1] * len(m)
      self._record(u, s, b, out["tokens"][e], out["logprobs"][e], self.version, out["done"][e])

  def admit(self, queue: deque, params=None, weights=None) -> int:
    """Inserts the queue's first samples into free slots (as many as the admission policy
    takes): one prefill per prompt not already held, bucketed by length, then one insert
    per prefix batch. Returns how many were admitted."""
    opts, engine = self.opts, self.engine
    self._free_finished()
    free = self.free()
    count = 0
    if (opts.continuous or len(free) == opts.slots) and not self.stalled:
      count = min(len(free) // self.n * self.n if self.whole_groups else len(free), len(queue))
    if self.paged and count:
      live = [self._gid(*o) for o in self.occupant if o is not None]
      count = self.book.admit([self._gid(u, s) for u, s in islice(queue, count)], count,
                                 live)
      if not count and len(free) == opts.slots:
        u, s = queue[0]
        raise ConfigError(f"rollout.kv_pages={self.kv_pages} cannot hold the next prompt "
                          f"({len(u.prompts[s // self.n])} tokens) and a page to grow into: "
                          f"raise rollout.kv_pages.")
    if not count:
      return 0
    t0 = time.perf_counter()
    take = [queue.popleft() for _ in range(count)]
    owners = [self._prefix_key(u, s) for u, s in take]
    units: dict[int, tuple] = {}  # unit -> (unit, its prompts to prefill), in order
    for (u, s), k in zip(take, owners):
      need = units.setdefault(id(u), (u, []))[1]
      if k not in self.prefixes and k not in need:
        need.append(k)
    for u, need in units.values():
      for batch in _prefill_batches(need, lambda k: len(self._prompt(k)), opts.slots):
        ids = [self._prompt(k) for k in batch]
        T, P = bucket(max(map(len, ids))), bucket(len(ids), minimum=1)
        tokens = np.full((P, T), opts.pad_id, np.int32)
        lengths = np.ones((P,), np.int32)
        for r, p in enumerate(ids):
          tokens[r, :len(p)], lengths[r] = p, len(p)
        params = self._params(params, weights)
        prefix = engine.prefill(params, tokens, lengths, u.key)
        self.counters["prefill_calls"] += 1
        self.counters["prefill_prompts"] += len(ids)
        self.counters["prefill_tokens"] += int(sum(map(len, ids)))
        for r, k in enumerate(batch):
          self.prefixes[k] = (prefix, r, self.version)  # its first tokens' (it may wait)
    # One window for the prefixes placed now (not those whose samples still wait) and their
    # first scan, then one insert per prefix batch placing every row its samples need.
    need = max(max(window(self.prefixes[k][0]) for k in owners),
               max(len(u.prompts[s // self.n]) for u, s in take) + opts.steps_per_call)
    self.state = engine.grow(self.state, self.fit(need))
    by_prefix: dict[int, tuple] = {}
    for (u, s), k, b in zip(take, owners, free):
      prefix, r, v = self.prefixes[k]
      entry = by_prefix.setdefault(id(prefix), (prefix, [], [], [], u, v))
      entry[1].append(r)
      entry[2].append(b)
      entry[3].append(s)  # the unit's own sample number keys its draws
      self.occupant[b] = (u, s)
    firsts = []
    for prefix, rows, bs, ss, _, _ in by_prefix.values():
      self.state, first = engine.insert_many(prefix, self.state, rows=rows, slots=bs,
                                             samples=ss)
      firsts.append(first)
    waiting = {self._prefix_key(u, s) for u, s in queue}
    for k in [k for k in self.prefixes if k not in waiting]:
      del self.prefixes[k]  # every sample of this prompt is placed: free its prefix
    if self.paged:
      self.book.placed([self._gid(u, s) for u, s in take])
      self.book.in_use = engine.pages_in_use(self.state)
      self.counters["kv_pages_peak"] = max(self.counters["kv_pages_peak"], self.book.in_use)
    firsts = to_host(firsts)
    self.counters["prefill_s"] += time.perf_counter() - t0
    for (_, _, bs, ss, u, v), first in zip(by_prefix.values(), firsts):
      for b, s, tok, lp, done in zip(bs, ss, first["tokens"], first["logprobs"], first["done"]):
        self._record(u, s, b, tok, lp, v, done)
    return count

  def _prompt(self, k) -> list[int]:
    return self.prompts[k if isinstance(k, int) else k[1] // self.n]

  def preempt(self, queue: deque) -> None:
    """Preemption by recompute, before a decode call (paged, optimistic admission): when the
    live slots' next scan needs more pages than are free, the most recently admitted samples
    give theirs back (Engine.evict) and go to the front of the queue, to be generated again
    from their prompts, token for token the same (a token's key is its sample's and index's)."""
    if not (self.paged and self.opts.kv_admission == "optimistic" and self.busy()):
      return
    slot_of = {self._gid(*o): b for b, o in enumerate(self.occupant) if o is not None}
    victims = self.book.victims(list(slot_of))  # newest first
    if not victims:
      return
    self.state = self.engine.evict(self.state, [slot_of[g] for g in victims])
    for g in victims:
      u, s = self.occupant[slot_of[g]]
      self.counters["kv_preempted_tokens"] += len(u.toks[s])
      for seq in (u.toks[s], u.lps[s], u.vers[s]):
        seq.clear()  # in place: the page account holds the same lists
      self.occupant[slot_of[g]] = None
      queue.appendleft((u, s))  # newest first in, so the oldest victim leads the queue
    self.counters["kv_preemptions"] += len(victims)
    self.book.in_use = self.engine.pages_in_use(self.state)

  def decode(self, params=None, weights=None) -> None:
    """One decode call of steps_per_call steps over every slot, its tokens recorded (the one
    host sync per steps_per_call tokens). The window first grows (and with narrow=True
    narrows) to the longest live sequence's next scan."""
    self.stalled = False
    live_now = self.live()
    if not live_now:
      return
    opts, c = self.opts, self.counters
    t0 = time.perf_counter()
    # A live slot's last token sits at position prompt + generated - 1; the scan writes there
    # and at the next steps_per_call - 1 positions.
    need = max(len(u.prompts[s // self.n]) + len(u.toks[s]) - 1 + opts.steps_per_call
               for u, s in (self.occupant[b] for b in live_now))
    self.state = self.engine.grow(self.state, self.fit(need))
    if self.narrow:  # the longest live sequence may have left
      self.state = self.engine.narrow(self.state, self.fit(need))
    c["live_peak"] = max(c["live_peak"], len(live_now))
    if not self.paged:
      c["kv_positions_peak"] = max(c["kv_positions_peak"], opts.slots * window(self.state))
    params = self._params(params, weights)
    self._free_finished()
    self.state, out = self.engine.generate_steps(params, self.state, self.key,
                                                 steps=opts.steps_per_call,
                                                 keep_pages=self.keep_pages)
    out = to_host(out)
    if self.paged:
      self.stalled = self.book.after_call(out, live_now, c)
    count_decode(c, out, time.perf_counter() - t0)
    for t in range(opts.steps_per_call):
      for b in np.flatnonzero(out["valid"][t]):
        u, s = self.occupant[b]
        self._record(u, s, b, out["tokens"][t, b], out["logprobs"][t, b], self.version,
                     out["done"][t, b])

  def stats(self, since: dict | None = None) -> dict:
    """The counters (less `since`'s, peaks excepted), with the cache's settings."""
    st = {k: v - since[k] if since is not None and k not in PEAKS else v
          for k, v in self.counters.items()}
    st.update(kv_cache=self.opts.kv_cache)
    if self.paged:
      st.update(kv_pages=self.kv_pages, page_size=self.opts.page_size,
                kv_admission=self.opts.kv_admission)
    return st


def _check_cache(kv_cache: str, kv_admission: str) -> bool:
  """Whether the rollout's cache is paged, once its settings are valid."""
  if kv_cache not in ("dense", "paged"):
    raise ConfigError(f"rollout.kv_cache={kv_cache!r} is not valid: use 'dense' or 'paged'.")
  if kv_admission not in ADMISSIONS:
    raise ConfigError(f"rollout.kv_admission={kv_admission!r} is not valid: use "
                      f"'optimistic' or 'reserve'.")
  return kv_cache == "paged"


def check_multi_turn(kv_cache: str, kv_admission: str) -> None:
  """Multi-turn rollouts over a paged cache admit by reserve: optimistic admission preempts
  by recompute, which would replay a conversation's environment steps."""
  if kv_cache == "paged" and kv_admission != "reserve":
    raise ConfigError("multi-turn rollouts (data.env / env_module) over rollout.kv_cache=paged "
                      "admit by reserve (a preempted conversation cannot replay its "
                      "environment): set rollout.kv_admission=reserve.")


def _check_pages(kv_pages: int | None, page_size: int, slots: int, max_len: int) -> int:
  """The paged cache's pool size (default: every slot at max_len), once it holds a sequence."""
  if page_size < 1:
    raise ConfigError(f"rollout.page_size={page_size} is not valid: use at least 1.")
  pages_per_seq = -(-max_len // page_size)
  kv_pages = slots * pages_per_seq if kv_pages is None else kv_pages
  if kv_pages < pages_per_seq:
    raise ConfigError(f"rollout.kv_pages={kv_pages} cannot hold one sequence of {max_len} "
                      f"positions ({pages_per_seq} pages of {page_size}): raise it to at "
                      f"least {pages_per_seq}.")
  return kv_pages


class _PageBook:
  """The driver's host-side account of a paged state's pages, mirroring what the device
  allocates (paged.prompt_pages at insert, a page per P positions in decode, paged.release) so
  that admission and preemption need no sync beyond the pages-in-use count each call returns.

  An insert group is the samples of one prompt placed by one insert call: they share the
  prompt's full pages, which are freed when the last of them lets go. A live sample that has
  generated g tokens writes next at position p = prompt + g - 1 and holds ceil(p / P) pages,
  the group's shared ones among them.

  reserve=True ("reserve" admission): a sample is admitted only while the unreserved pages
  hold its worst case (its group's full prompt pages once, and its own up to prompt +
  max_new), so no slot ever waits and nothing is preempted. reserve=False ("optimistic"): a
  sample is admitted while the free pages, less what the live slots' next scan takes, hold its
  prompt pages and its own first scan's; `victims` then names whom to preempt when the live
  slots outgrow the pool.
  """

  def __init__(self, prompts, toks, *, n, share_prefix, page_size, num_pages, max_new, max_len,
               steps, reserve):
    self.prompts, self.toks, self.n, self.share_prefix = prompts, toks, n, share_prefix
    self.page_size, self.num_pages, self.steps, self.reserve = page_size, num_pages, steps, reserve
    self.max_new, self.max_len = max_new, max_len
    self.group_of: dict[int, tuple] = {}  # live sample -> its insert group
    self.groups: dict[tuple, list[int]] = {}  # insert group -> [live samples, shared pages]
    self.reserved_own: dict[int, int] = {}  # reserve: live sample -> its own pages reserved
    self.reserved = 0  # reserve: pages reserved for the live samples
    self.order: dict[int, int] = {}  # live sample -> when it was admitted (newest: largest)
    self.admitted = 0
    self.inserts = 0
    self.in_use = 0  # pages held after the last device call (its returned count)

  def _length(self, s: int) -> int:
    return len(self.prompts[s // self.n])

  def _key(self, s: int):  # the prefix row a sample's prompt pages come from
    return s // self.n if self.share_prefix else ("s", s)

  def growth(self, s: int, generated: int | None = None) -> int:
    """The pages sample s's slot takes in the next scan of `steps` decode steps, having
    generated `generated` tokens (default: what it has; 1 right after its insert)."""
    P = self.page_size
    g = len(self.toks[s]) if generated is None else generated
    pos = self._length(s) + g - 1
    steps = min(self.steps, self.max_new - g, self.max_len - pos)
    return max(0, -(-(pos + steps) // P) - -(-pos // P))

  def admit(self, queue, count: int, live) -> int:
    """How many of the queue's first `count` samples to insert now (see the class)."""
    P = self.page_size
    if self.reserve:
      free = self.num_pages - self.reserved
    else:
      free = self.num_pages - self.in_use - sum(self.growth(s) for s in live)
    seen, need = set(), 0
    for i in range(count):
      s = queue[i]
      length = self._length(s)
      prompt = (length // P if self._key(s) not in seen else 0) + (length % P > 0)
      if self.reserve:
        extra = prompt - (length % P > 0) + self._worst_own(s)
      else:
        extra = prompt + self.growth(s, 1)
      if need + extra > free:
        return i
      need += extra
      seen.add(self._key(s))
    return count

  def _worst_own(self, s: int) -> int:
    """The most pages sample s can hold beyond its prompt's full ones: from its partial prompt
    page to prompt + max_new positions."""
    length = self._length(s)
    P = self.page_size
    return -(-min(length + self.max_new, self.max_len) // P) - length // P

  def placed(self, samples):
    """Records one insert round of these samples."""
    self.inserts += 1
    for s in samples:
      g = (self.inserts, self._key(s))
      if g not in self.groups:
        self.groups[g] = [0, self._length(s) // self.page_size]
        self.reserved += self.groups[g][1] if self.reserve else 0
      self.groups[g][0] += 1
      self.group_of[s] = g
      self.order[s] = self.admitted
      self.admitted += 1
      if self.reserve:
        self.reserved_own[s] = self._worst_own(s)
        self.reserved += self.reserved_own[s]

  def leave(self, s: int) -> int:
    """Sample s's slot lets go of its pages (it finished, or is preempted): the pages that
    frees, its group's shared ones when it was the last of the group."""
    g = self.group_of.pop(s)
    del self.order[s]
    self.reserved -= self.reserved_own.pop(s, 0)
    live, shared = self.groups[g]
    freed = -(-(self._length(s) + len(self.toks[s]) - 1) // self.page_size) - shared
    self.groups[g][0] = live - 1
    if live == 1:
      del self.groups[g]
      freed += shared
      self.reserved -= shared if self.reserve else 0
    return freed

  def after_call(self, out: dict, live_now: list[int], stats: dict) -> bool:
    """Reads a decode call's host outputs into the account and the rollout's counters: the
    pages in use after each step's allocation and freeing (their peak), and whether a live
    slot waited for a page (returned: the driver admits nothing before the next call). Every
    live slot waiting with no token made is a pool too small for the run: one sentence."""
    stats["kv_pages_peak"] = max(stats["kv_pages_peak"], int(out["pages_used"].max()))
    self.in_use = int(out["pages_used"][-1])
    waited = [b for b in live_now if not out["valid"][:, b].all()
              and not out["done"][:, b].any()]
    stats["page_wait_calls"] += bool(waited)
    if waited and len(waited) == len(live_now) and not out["valid"].any():
      raise ConfigError(f"rollout.kv_pages={self.num_pages} is too small: every live sequence "
                        f"waits for a free KV page ({len(live_now)} live, pages of "
                        f"{self.page_size} positions): raise rollout.kv_pages.")
    return bool(waited)

  def victims(self, live) -> list[int]:
    """The live samples to preempt, newest first, so that the others' next scan finds its
    pages free: the most recently admitted ones, until it does (never the last one, which a
    pool of at least one sequence's pages always holds)."""
    need = {s: self.growth(s) for s in live}
    total, free = sum(need.values()), self.num_pages - self.in_use
    out = []
    while total > free and len(need) > 1:
      s = max(need, key=self.order.__getitem__)
      total -= need.pop(s)
      free += self.leave(s)
      out.append(s)
    return out


def _prefill_batches(keys, length_of, max_rows):
  """Groups prefill rows by length bucket (so short prompts are not padded to long ones), in
  calls of at most max_rows."""
  groups: dict[int, list] = {}
  for k in keys:
    groups.setdefault(bucket(length_of(k)), []).append(k)
  for group in groups.values():
    for i in range(0, len(group), max_rows):
      yield group[i:i + max_rows]


def count_decode(stats: dict, out: dict, seconds: float) -> None:
  """Adds one decode call (`generate_steps`' host outputs) to a rollout's counters: its
  seconds, its steps, the slot-steps it ran and those that made a token."""
  steps, slots = out["valid"].shape
  stats["decode_s"] += seconds
  stats["decode_steps"] += steps
  stats["slot_steps"] += steps * slots
  stats["live_slot_steps"] += int(out["valid"].sum())
