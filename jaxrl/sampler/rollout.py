"""The rollout driver: n samples for each prompt, continuously batched over decode slots.

    out = generate(engine, params, prompts, n=G, seed=step_seed, slots=64)

Sample i * n + g is prompt i's g-th sample. The driver keeps a queue of samples. Whenever slots
are free it prefills the prompts they need (several per call, bucketed by length) and inserts
each prompt's prefix into as many free slots as it has samples waiting, so a group of G shares
one prefill. Then it runs `steps_per_call` decode steps in one jitted scan, reads the tokens and
done flags back in one transfer, and frees finished slots for the next round. One long sample
never holds up the batch, and the host syncs once per `steps_per_call` tokens, not per token.
Before each insert and each scan it widens the KV cache's window just enough for the longest
live sequence (Engine.grow, in half-octave steps: see `window_bucket`), so that early decode
steps do not read cache positions no slot has reached.

With `continuous=False` the driver batches statically instead: it refills only when every slot
is free (the baseline the benchmark compares against). With `share_prefix=False` each sample
prefills its own copy of the prompt (the baseline for group insert). Both settings return the
same samples as the defaults, because a token's key depends only on (seed, sample, token).

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
from typing import Any, Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrl.errors import ConfigError
from jaxrl.parallel.distributed import to_host
from jaxrl.sampler.engine import Engine, bucket, window, window_bucket

ADMISSIONS = ("optimistic", "reserve")  # rollout.kv_admission (see _PageBook)


@dataclasses.dataclass
class Rollout:
  """Padded rollout arrays, N = prompts x n rows (prompt-major), plus the driver's stats.

  prompt_ids [N, Lp] and completion_ids [N, Lc] are right-padded with pad_id; completion_mask
  [N, Lc] is 1 on generated tokens (the stop token included); logprobs [N, Lc] are the
  sampler's log pi(token) under temperature before truncation (0 on padding). A multi-turn
  rollout (jaxrl.envs.rollout) holds the whole conversation after the prompt in completion_ids
  and `lengths`; its completion_mask is 1 on the model's tokens only, 0 on template and tool
  tokens (whose logprobs are 0), and the learner trains on the mask. finish_reasons
  is "stop" (eos or a stop id) or "length" (max_new_tokens or the cache's end).
  """

  prompt_ids: np.ndarray
  prompt_lengths: np.ndarray
  completion_ids: np.ndarray
  completion_mask: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray
  finish_reasons: list[str]
  prompt_index: np.ndarray
  stats: dict
  # [N, Lc] the policy version that sampled each token (-1 on padding), when generate() was
  # given `weights` (partial rollouts: the weights may change between decode calls).
  versions: np.ndarray | None = None


def generate(engine: Engine, params, prompts, *, n: int = 1, seed: int = 0, slots: int = 16,
             steps_per_call: int = 8, max_prompt_len: int | None = None,
             continuous: bool = True, share_prefix: bool = True, pad_id: int = 0,
             grow_cache: bool = True, progress: bool = False, kv_cache: str = "dense",
             kv_pages: int | None = None, page_size: int = 16,
             kv_admission: str = "optimistic",
             weights: Callable[[], tuple[int, Any]] | None = None) -> Rollout:
  """Generates n samples per prompt (lists of token ids) with `engine`'s sampling settings.

  grow_cache=False allocates the whole cache up front: one decode compile instead of up to two
  per doubling of the sequence, for accelerators where a compile costs more than the reads
  the growing window saves. kv_cache="paged": a paged KV cache of kv_pages pages (default:
  enough for every slot at max_len, so no slot ever waits for one) of page_size positions,
  admitting samples by kv_admission ("optimistic" or "reserve", see the module docstring).
  weights: called before every prefill and decode call, returns (version, params) to use from
  there on instead of `params` (partial rollouts: a sequence in flight continues under newer
  weights, its KV cache as it was written); Rollout.versions then says which version sampled
  each token."""
  sp = engine.sampling
  prompts = [list(map(int, p)) for p in prompts]
  if n < 1:
    raise ConfigError(f"n={n} is not valid: ask for at least 1 sample per prompt.")
  for i, p in enumerate(prompts):
    if not p:
      raise ConfigError(f"prompt {i} is empty: every prompt needs at least one token (e.g. bos).")
  replicas = engine.mesh.shape["data"] * engine.mesh.shape["fsdp"]
  if slots % replicas:
    raise ConfigError(f"slots={slots} is not divisible by the replica count data x fsdp = "
                      f"{replicas}: choose a multiple of {replicas}.")
  longest = max(map(len, prompts), default=1)
  max_prompt_len = bucket(max_prompt_len or longest)
  if longest > max_prompt_len:
    raise ConfigError(f"a prompt has {longest} tokens, more than max_prompt_len="
                      f"{max_prompt_len}: raise it or shorten the prompt.")
  max_len = max_prompt_len + sp.max_new_tokens
  num = len(prompts) * n
  is_paged = _check_cache(kv_cache, kv_admission)
  if is_paged:
    kv_pages = _check_pages(kv_pages, page_size, slots, max_len)
  key = jax.random.key(seed)

  def fit(need: int) -> int:  # the cache window for `need` positions
    return min(max_len, window_bucket(need)) if grow_cache else max_len

  t_start = time.perf_counter()
  if is_paged:
    state = engine.init_paged_state(slots, max_len, pages=kv_pages, page_size=page_size)
  else:
    state = engine.init_decode_state(slots, max_len,
                                     length=fit(max_prompt_len + steps_per_call))
  queue = deque(range(num))
  prefixes: dict[int, tuple] = {}  # prompt -> (prefix batch, row), while samples still wait
  slot_sample = [-1] * slots
  toks: list[list[int]] = [[] for _ in range(num)]
  lps: list[list[float]] = [[] for _ in range(num)]
  vers: list[list[int]] = [[] for _ in range(num)]
  version = -1  # the weights' version (partial rollouts), with each prefix it made
  finished = [False] * num
  stats = dict(prefill_s=0.0, decode_s=0.0, prefill_calls=0, prefill_prompts=0,
               prefill_tokens=0, decode_steps=0, slot_steps=0, live_slot_steps=0,
               live_peak=0, kv_cache=kv_cache)
  if is_paged:
    stats.update(kv_pages=kv_pages, kv_pages_peak=0, page_size=page_size, page_wait_calls=0,
                 kv_admission=kv_admission, kv_preemptions=0, kv_preempted_tokens=0)
  else:
    stats.update(kv_positions_peak=0)
  stalled = False  # a live slot waited for a page in the last decode call
  bar = tqdm(total=num, desc="sampling", unit="sample", disable=not progress, leave=False)
  book = _PageBook(prompts, toks, n=n, share_prefix=share_prefix, page_size=page_size,
                   num_pages=kv_pages or 0, max_new=sp.max_new_tokens, max_len=max_len,
                   steps=steps_per_call, reserve=kv_admission == "reserve")

  def finish(s: int):
    finished[s] = True
    bar.update(1)
    if is_paged:
      book.leave(s)

  while queue or any(x >= 0 for x in slot_sample):
    free = [b for b in range(slots) if slot_sample[b] < 0]
    firsts, first_versions = [], []
    count = 0
    if (continuous or len(free) == slots) and not stalled:
      count = min(len(free), len(queue))
    if is_paged and count:
      count = book.admit(queue, count, [x for x in slot_sample if x >= 0])
      if not count and len(free) == slots:
        raise ConfigError(f"rollout.kv_pages={kv_pages} cannot hold the next prompt "
                          f"({len(prompts[queue[0] // n])} tokens) and a page to grow into: "
                          f"raise rollout.kv_pages.")
    if count:
      t0 = time.perf_counter()
      take = [queue.popleft() for _ in range(count)]
      # Prefill what is needed: one row per prompt (shared by its group), or per sample.
      owners = {}  # sample -> the row key its prefix lives under
      need = []
      for s in take:
        k = s // n if share_prefix else ("s", s)
        owners[s] = k
        if k not in prefixes and k not in need:
          need.append(k)
      for batch in _prefill_batches(need, lambda k: len(prompts[k if isinstance(k, int)
                                                                 else k[1] // n]), slots):
        ids = [prompts[k if isinstance(k, int) else k[1] // n] for k in batch]
        T = bucket(max(map(len, ids)))
        P = bucket(len(ids), minimum=1)
        tokens = np.full((P, T), pad_id, np.int32)
        lengths = np.ones((P,), np.int32)
        for r, p in enumerate(ids):
          tokens[r, :len(p)], lengths[r] = p, len(p)
        if weights is not None:
          version, params = weights()
        prefix = engine.prefill(params, tokens, lengths, key)
        stats["prefill_calls"] += 1
        stats["prefill_prompts"] += len(ids)
        stats["prefill_tokens"] += int(sum(map(len, ids)))
        for r, k in enumerate(batch):
          prefixes[k] = (prefix, r, version)  # its first tokens' (it may wait a round)
      # Insert: one call per prefix batch, each placing every row its samples need, into a
      # window that holds the prefixes placed now (not those whose samples still wait) and
      # their first scan.
      need = max(max(window(prefixes[owners[s]][0]) for s in take),
                 max(len(prompts[s // n]) for s in take) + steps_per_call)
      state = engine.grow(state, fit(need))
      by_prefix: dict[int, tuple] = {}
      for s, b in zip(take, free):
        prefix, r, v = prefixes[owners[s]]
        entry = by_prefix.setdefault(id(prefix), (prefix, [], [], [], v))
        entry[1].append(r)
        entry[2].append(b)
        entry[3].append(s)
        slot_sample[b] = s
      for prefix, rows, bs, ss, v in by_prefix.values():
        state, first = engine.insert_many(prefix, state, rows=rows, slots=bs, samples=ss)
        firsts.append((bs, ss, first))
        first_versions.append(v)
      waiting = {s // n if share_prefix else ("s", s) for s in queue}
      for k in [k for k in prefixes if k not in waiting]:
        del prefixes[k]  # every sample of this prompt is placed: free its prefix
      firsts = to_host(firsts)
      if is_paged:
        book.placed(take)
        book.in_use = engine.pages_in_use(state)
        stats["kv_pages_peak"] = max(stats["kv_pages_peak"], book.in_use)
      stats["prefill_s"] += time.perf_counter() - t0
      for (bs, ss, first), v in zip(firsts, first_versions):
        for b, s, tok, lp, done in zip(bs, ss, first["tokens"], first["logprobs"],
                                       first["done"]):
          toks[s].append(int(tok))
          lps[s].append(float(lp))
          vers[s].append(v)
          if done:
            finish(s)
            slot_sample[b] = -1
    if not any(x >= 0 for x in slot_sample):
      continue  # every inserted sample finished on its first token
    if is_paged and kv_admission == "optimistic":
      state = _preempt(engine, state, book, queue, slot_sample, toks, lps, vers, stats)
    t0 = time.perf_counter()
    # A live slot's last token sits at position prompt + generated - 1; the scan writes there
    # and at the next steps_per_call - 1 positions.
    need = max(len(prompts[s // n]) + len(toks[s]) - 1 + steps_per_call
               for s in slot_sample if s >= 0)
    state = engine.grow(state, fit(need))
    live_now = [b for b in range(slots) if slot_sample[b] >= 0]
    stats["live_peak"] = max(stats["live_peak"], len(live_now))
    if not is_paged:
      stats["kv_positions_peak"] = max(stats["kv_positions_peak"], slots * window(state))
    if weights is not None:
      version, params = weights()
    state, out = engine.generate_steps(params, state, key, steps=steps_per_call)
    out = to_host(out)  # the one host sync per steps_per_call tokens
    if is_paged:
      stalled = book.after_call(out, live_now, stats)
    count_decode(stats, out, time.perf_counter() - t0)
    for t in range(steps_per_call):
      for b in np.flatnonzero(out["valid"][t]):
        s = slot_sample[b]
        toks[s].append(int(out["tokens"][t, b]))
        lps[s].append(float(out["logprobs"][t, b]))
        vers[s].append(version)
        if out["done"][t, b]:
          finish(s)
          slot_sample[b] = -1
  bar.close()
  wall = time.perf_counter() - t_start
  rollout = _assemble(prompts, n, toks, lps, sp, pad_id, stats, wall)
  return _with_versions(rollout, vers) if weights is not None else rollout


def _check_cache(kv_cache: str, kv_admission: str) -> bool:
  """Whether the rollout's cache is paged, once its settings are valid."""
  if kv_cache not in ("dense", "paged"):
    raise ConfigError(f"rollout.kv_cache={kv_cache!r} is not valid: use 'dense' or 'paged'.")
  if kv_admission not in ADMISSIONS:
    raise ConfigError(f"rollout.kv_admission={kv_admission!r} is not valid: use "
                      f"'optimistic' or 'reserve'.")
  return kv_cache == "paged"


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


def _preempt(engine, state, book, queue, slot_sample, toks, lps, vers, stats):
  """Preemption by recompute, before a decode call: when the live slots' next scan needs more
  pages than are free, the most recently admitted samples give theirs back (Engine.evict) and
  go to the front of the queue, to be generated again from their prompts. A token's key is
  fold_in(seed, sample, token), so the sample comes back token for token the same. Returns
  the state."""
  victims = book.victims([s for s in slot_sample if s >= 0])
  if not victims:
    return state
  slot_of = {s: b for b, s in enumerate(slot_sample) if s >= 0}
  state = engine.evict(state, [slot_of[s] for s in victims])
  for s in victims:
    stats["kv_preempted_tokens"] += len(toks[s])
    toks[s], lps[s], vers[s] = [], [], []
    slot_sample[slot_of[s]] = -1
  queue.extendleft(victims)  # newest first in, so the oldest victim leads the queue
  stats["kv_preemptions"] += len(victims)
  book.in_use = engine.pages_in_use(state)
  return state


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


def _with_versions(rollout: Rollout, vers: list[list[int]]) -> Rollout:
  """The rollout with each completion token's policy version (-1 past its end)."""
  versions = np.full(rollout.completion_ids.shape, -1, np.int32)
  for s, v in enumerate(vers):
    versions[s, :len(v)] = v
  return dataclasses.replace(rollout, versions=versions)


def _assemble(prompts, n, toks, lps, sp, pad_id, stats, wall) -> Rollout:
  num = len(toks)
  lp_max = max(map(len, prompts), default=1)
  lc_max = max(map(len, toks), default=1)
  prompt_ids = np.full((num, lp_max), pad_id, np.int32)
  completion_ids = np.full((num, lc_max), pad_id, np.int32)
  mask = np.zeros((num, lc_max), np.int32)
  logprobs = np.zeros((num, lc_max), np.float32)
  stops = set(sp.stop_tokens)
  reasons = []
  for s in range(num):
    p, c = prompts[s // n], toks[s]
    prompt_ids[s, :len(p)] = p
    completion_ids[s, :len(c)] = c
    mask[s, :len(c)] = 1
    logprobs[s, :len(c)] = lps[s]
    reasons.append("stop" if c and c[-1] in stops else "length")
  lengths = mask.sum(1).astype(np.int32)
  generated = int(lengths.sum())
  stats = dict(stats, tokens_generated=generated, wall_s=wall,
               tokens_per_s=generated / max(wall, 1e-9),
               decode_tokens_per_s=int(stats["live_slot_steps"]) / max(stats["decode_s"], 1e-9),
               slot_utilisation=stats["live_slot_steps"] / max(stats["slot_steps"], 1))
  return Rollout(prompt_ids=prompt_ids,
                 prompt_lengths=np.array([len(prompts[s // n]) for s in range(num)], np.int32),
                 completion_ids=completion_ids, completion_mask=mask, logprobs=logprobs,
                 lengths=lengths, finish_reasons=reasons,
                 prompt_index=np.arange(num, dtype=np.int32) // n, stats=stats)


def metrics(rollout: Rollout) -> dict:
  """The rollout's stats under docs/design.md's metric names, for trainers to log."""
  st = rollout.stats
  # Over the model's own tokens: a multi-turn rollout's completion also holds template and
  # tool tokens (completion_mask 0; single-turn, the mask covers `lengths` exactly).
  model_tokens = rollout.completion_mask.sum(1)
  return {"timing_s/gen": st["wall_s"], "perf/gen_tokens_per_s": st["tokens_per_s"],
          "response_length/mean": float(model_tokens.mean()) if len(model_tokens) else 0.0,
          "sampler/prefill_s": st["prefill_s"], "sampler/decode_s": st["decode_s"],
          "sampler/slot_utilisation": st["slot_utilisation"],
          "response_length/clip_ratio": float(np.mean([r == "length" for r in rollout.finish_reasons])) if rollout.finish_reasons else 0.0,
          "sampler/tokens_generated": st["tokens_generated"],
          "sampler/live_peak": st.get("live_peak", 0),
          **({"sampler/kv_pages": st["kv_pages"], "sampler/kv_pages_peak": st["kv_pages_peak"],
              "sampler/kv_preemptions": st["kv_preemptions"]} if "kv_pages" in st else {}),
          # Multi-turn rollouts (jaxrl.envs.rollout): the environments' counts and seconds.
          **({"env/turns/mean": st["env_turns"], "env/tool_calls/mean": st["env_tool_calls"],
              "env/bad_tool_calls": st["env_bad_tool_calls"], "timing_s/env": st["env_s"]}
             if "env_turns" in st else {})}


def generate_stream(engine: Engine, next_unit: Callable, *, weights: Callable[[], tuple[int, Any]],
                    n: int, slots: int = 16, steps_per_call: int = 8, max_prompt_len: int,
                    pad_id: int = 0, grow_cache: bool = True, kv_cache: str = "dense",
                    kv_pages: int | None = None, page_size: int = 16,
                    kv_admission: str = "optimistic"):
  """Streaming continuous batching over a sequence of units (the async producer's partial
  rollouts): yields (tag, Rollout) per unit, in the order the units were opened.

  next_unit(wait) -> (tag, prompts, seed) | None opens the next unit: its prompts' n samples
  each, keyed by its own seed (so sample i * n + g of a unit is token for token what
  generate(..., seed=seed) samples for it with the same weights). It is asked whenever n
  slots are free and no opened unit has a group waiting; wait=False while other slots are
  live (None: not now, go on decoding), wait=True when none is (None: there is no next unit,
  the stream ends). A group's n samples are admitted together, one prefill per prompt shared
  by them (insert_many), as soon as n slots are free, so a unit's short completions free
  slots for the next unit's groups instead of idling beside its long ones. Each slot carries
  its unit's key (Engine.generate with key=None). weights() is called before every prefill
  and decode call, as generate()'s `weights` (every token's version is in Rollout.versions).

  One state serves every unit. The dense cache's window follows the longest live sequence:
  grown before a call that needs more, and narrowed (Engine.narrow) when that sequence has left,
  so that a unit's short completions do not decode over the window a long one needed. kv_cache="paged" takes generate()'s kv_pages, page_size and
  kv_admission, with one page account (_PageBook) over every unit's samples: a group whose
  pages are not free is admitted as far as they are, and the rest of its samples wait, like
  the samples a preemption sends back, to be admitted one by one before any new group (each
  prefills its prompt again; its tokens come back the same under the same weights).
  A unit's Rollout.stats count the driver's work from its opening to its emission (decode
  calls are shared by the units in flight, so two units' counts overlap), except gen_s: the
  prefill and decode seconds since the previous unit's emission, which the producer sums as
  busy time (each second counted once)."""
  sp = engine.sampling
  replicas = engine.mesh.shape["data"] * engine.mesh.shape["fsdp"]
  if slots % replicas or slots < n:
    raise ConfigError(f"slots={slots} must be a multiple of the replica count data x fsdp = "
                      f"{replicas} and hold a group of {n}: raise rollout.slots.")
  max_prompt_len = bucket(max_prompt_len)
  max_len = max_prompt_len + sp.max_new_tokens
  is_paged = _check_cache(kv_cache, kv_admission)
  if is_paged:
    kv_pages = _check_pages(kv_pages, page_size, slots, max_len)

  def fit(need: int) -> int:
    return min(max_len, window_bucket(need)) if grow_cache else max_len

  if is_paged:
    state = engine.init_paged_state(slots, max_len, pages=kv_pages, page_size=page_size)
  else:
    state = engine.init_decode_state(slots, max_len,
                                     length=fit(max_prompt_len + steps_per_call))
  units: deque = deque()  # opened units, not yet emitted, in order
  occupant: list = [None] * slots  # slot -> (unit, sample)
  counters = dict(prefill_s=0.0, decode_s=0.0, prefill_calls=0, prefill_prompts=0,
                  prefill_tokens=0, decode_steps=0, slot_steps=0, live_slot_steps=0,
                  live_peak=0)
  peaks = ("live_peak", "kv_positions_peak", "kv_pages_peak")
  if is_paged:
    counters.update(kv_pages_peak=0, page_wait_calls=0, kv_preemptions=0,
                    kv_preempted_tokens=0)
  else:
    counters.update(kv_positions_peak=0)
  since = dict(counters)  # the counters at the last emission
  version = -1
  # The page account numbers every unit's samples in one sequence: sample s of a unit whose
  # first prompt is the base-th opened is base * n + s, so its prompt is that number // n.
  all_prompts: dict[int, list[int]] = {}  # the units in flight's, by number
  all_toks: dict[int, list[int]] = {}  # their own token lists (the same objects)
  opened = 0  # prompts opened so far
  book = _PageBook(all_prompts, all_toks, n=n, share_prefix=True, page_size=page_size,
                   num_pages=kv_pages or 0, max_new=sp.max_new_tokens, max_len=max_len,
                   steps=steps_per_call, reserve=kv_admission == "reserve")
  waiting: deque = deque()  # (unit, sample): paged only, admitted one by one before new groups
  stalled = False  # a live slot waited for a page in the last decode call

  def gid(u, s):
    return u["base"] * n + s

  def record(u, s, tok, lp, v, done):
    u["toks"][s].append(int(tok))
    u["lps"][s].append(float(lp))
    u["vers"][s].append(v)
    if done:
      u["left"] -= 1
      if is_paged:
        book.leave(gid(u, s))
    return done

  def fits(want: list[int], live: list[int]) -> int:
    """How many of `want` (new samples, in order) the free pages admit now; all when dense."""
    return book.admit(want, len(want), live) if is_paged else len(want)

  while True:
    # Admit: waiting samples first, then whole groups into free slots, oldest unit first.
    free = [b for b in range(slots) if occupant[b] is None]
    live = [gid(*o) for o in occupant if o is not None]
    admits = []  # (unit, samples, slots)
    want: list[int] = []  # the admitted samples' numbers
    blocked = stalled
    while waiting and free and not blocked:
      u, s = waiting[0]
      if fits(want + [gid(u, s)], live) <= len(want):
        blocked = True
        break
      waiting.popleft()
      admits.append((u, [s], free[:1]))
      want.append(gid(u, s))
      free = free[1:]
    while len(free) >= n and not blocked and not waiting:
      u = next((u for u in units if u["next"] < len(u["prompts"])), None)
      if u is None:
        got = next_unit(not live and not admits)
        if got is None:
          break
        tag, prompts, seed = got
        prompts = [list(map(int, x)) for x in prompts]
        if max(map(len, prompts)) > max_prompt_len:
          raise ConfigError(f"a prompt has {max(map(len, prompts))} tokens, more than "
                            f"max_prompt_len={max_prompt_len}: raise it or shorten the prompt.")
        num = len(prompts) * n
        u = dict(tag=tag, prompts=prompts, key=jax.random.key(seed), next=0, left=num,
                 base=opened, toks=[[] for _ in range(num)],
                 lps=[[] for _ in range(num)], vers=[[] for _ in range(num)],
                 t0=time.perf_counter(), at_open=dict(counters))
        all_prompts.update((opened + i, x) for i, x in enumerate(prompts))
        all_toks.update((opened * n + s, x) for s, x in enumerate(u["toks"]))
        opened += len(prompts)
        units.append(u)
        continue
      group = [u["next"] * n + g for g in range(n)]
      k = fits(want + [gid(u, s) for s in group], live) - len(want)
      u["next"] += 1
      if k < n:  # the pages hold only part of the group: the rest waits
        waiting.extend((u, s) for s in group[k:])
        blocked = True
      if k > 0:
        admits.append((u, group[:k], free[:k]))
        want += [gid(u, s) for s in group[:k]]
        free = free[k:]
    if not admits and not live:
      if waiting or any(u["next"] < len(u["prompts"]) for u in units):
        raise ConfigError(f"rollout.kv_pages={kv_pages} cannot hold the next prompt and a page "
                          f"to grow into: raise rollout.kv_pages.")
      break  # nothing in flight and no next unit: the stream has ended
    if admits:
      t0 = time.perf_counter()
      firsts = []
      for u in [u for u in units if any(a[0] is u for a in admits)]:
        mine = [(s, b) for v, ss, bs in admits if v is u for s, b in zip(ss, bs)]
        for batch in _prefill_batches(list(dict.fromkeys(s // n for s, _ in mine)),
                                      lambda i: len(u["prompts"][i]), slots):
          ids = [u["prompts"][i] for i in batch]
          T, P = bucket(max(map(len, ids))), bucket(len(ids), minimum=1)
          tokens = np.full((P, T), pad_id, np.int32)
          lengths = np.ones((P,), np.int32)
          for r, x in enumerate(ids):
            tokens[r, :len(x)], lengths[r] = x, len(x)
          version, params = weights()
          prefix = engine.prefill(params, tokens, lengths, u["key"])
          counters["prefill_calls"] += 1
          counters["prefill_prompts"] += len(ids)
          counters["prefill_tokens"] += int(sum(map(len, ids)))
          state = engine.grow(state, fit(max(T, max(map(len, ids)) + steps_per_call)))
          row = {i: r for r, i in enumerate(batch)}
          placed = [(s, b) for s, b in mine if s // n in row]
          ss, bs = [s for s, _ in placed], [b for _, b in placed]
          for s, b in placed:
            occupant[b] = (u, s)
          state, first = engine.insert_many(prefix, state, rows=[row[s // n] for s in ss],
                                            slots=bs, samples=ss)
          if is_paged:
            book.placed([gid(u, s) for s in ss])  # one insert call: its prompts' pages shared
          firsts.append((u, bs, ss, version, first))
      if is_paged:
        book.in_use = engine.pages_in_use(state)
        counters["kv_pages_peak"] = max(counters["kv_pages_peak"], book.in_use)
      # (the units stay out of the transfer: only the arrays go through to_host)
      for (u, bs, ss, v, _), first in zip(firsts, to_host([f[-1] for f in firsts])):
        for b, s, tok, lp, done in zip(bs, ss, first["tokens"], first["logprobs"],
                                       first["done"]):
          if record(u, s, tok, lp, v, done):
            occupant[b] = None
      counters["prefill_s"] += time.perf_counter() - t0
    if is_paged and kv_admission == "optimistic" and any(o is not None for o in occupant):
      slot_of = {gid(*o): b for b, o in enumerate(occupant) if o is not None}
      victims = book.victims(list(slot_of))  # newest first
      if victims:
        state = engine.evict(state, [slot_of[g] for g in victims])
        for g in victims:
          u, s = occupant[slot_of[g]]
          counters["kv_preempted_tokens"] += len(u["toks"][s])
          for seq in (u["toks"][s], u["lps"][s], u["vers"][s]):
            seq.clear()  # in place: the page account holds the same lists
          occupant[slot_of[g]] = None
          waiting.appendleft((u, s))  # newest first in, so the oldest victim leads
        counters["kv_preemptions"] += len(victims)
        book.in_use = engine.pages_in_use(state)
    stalled = False
    if any(o is not None for o in occupant):
      t0 = time.perf_counter()
      need = max(len(u["prompts"][s // n]) + len(u["toks"][s]) - 1 + steps_per_call
                 for u, s in filter(None, occupant))
      state = engine.grow(state, fit(need))
      state = engine.narrow(state, fit(need))  # the longest live sequence may have left
      live_now = [b for b in range(slots) if occupant[b] is not None]
      counters["live_peak"] = max(counters["live_peak"], len(live_now))
      if not is_paged:
        counters["kv_positions_peak"] = max(counters["kv_positions_peak"],
                                            slots * window(state))
      version, params = weights()
      state, out = engine.generate_steps(params, state, None, steps=steps_per_call)
      out = to_host(out)
      if is_paged:
        stalled = book.after_call(out, live_now, counters)
      count_decode(counters, out, time.perf_counter() - t0)
      for t in range(steps_per_call):
        for b in np.flatnonzero(out["valid"][t]):
          u, s = occupant[b]
          if record(u, s, out["tokens"][t, b], out["logprobs"][t, b], version,
                    out["done"][t, b]):
            occupant[b] = None
    # Emit the finished units at the front, in order.
    while units and units[0]["next"] == len(units[0]["prompts"]) and not units[0]["left"]:
      u = units.popleft()
      for i in range(len(u["prompts"])):
        del all_prompts[u["base"] + i]
        for g in range(n):
          del all_toks[(u["base"] + i) * n + g]
      stats = {k: counters[k] - u["at_open"][k] if k not in peaks else counters[k]
               for k in counters}
      stats.update(kv_cache=kv_cache, gen_s=counters["prefill_s"] + counters["decode_s"]
                   - since["prefill_s"] - since["decode_s"])
      if is_paged:
        stats.update(kv_pages=kv_pages, page_size=page_size, kv_admission=kv_admission)
      since = dict(counters)
      rollout = _assemble(u["prompts"], n, u["toks"], u["lps"], sp, pad_id, stats,
                          time.perf_counter() - u["t0"])
      yield u["tag"], _with_versions(rollout, u["vers"])
