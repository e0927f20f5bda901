"""The JetStream-style engine: prefill, insert, generate over decode slots.

    engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(...))
    state = engine.init_decode_state(slots, max_len, length=32)          # 32 positions so far
    state = engine.grow(state, 64)                                       # room for 64 now
    prefix = engine.prefill(params, tokens_pt, true_length_p, key)       # P prompts at once
    state, first = engine.insert(prefix, state, slot)                    # one prefix, one slot
    state, first = engine.insert_group(prefix, state, slots_g)          # one prefix, G slots
    state, out = engine.generate(params, state, key)                    # one step, every slot
    state, out = engine.generate(params, state)              # ... each slot with its own key
    state, out = engine.generate_steps(params, state, key, steps=k)     # k steps in one scan
    state = engine.evict(state, slots)                                  # preempt: free slots
    state, out = engine.extend(params, state, key, slots=e, tokens_et=obs, length_e=n)
                                                                        # append, keep decoding

Every phase is one jit of a pure function over nnx.split state. Params are an argument, so a
weight swap (same shapes and shardings) never recompiles; `engine.traces` counts traces so tests
can show it. The decode state is one pytree whose KV cache is a (keys, values) pair of
[B, K, W, H] arrays per layer (B slots, W positions), sharded for the sampler layout (slots over
data x fsdp, KV heads over tensor) and donated to every call that updates it, so it is updated
in place.

The cache window. W starts at `length` (default max_len) and `grow` widens it; it never needs
to exceed max_len, the longest sequence (prompt + completion) a slot may hold. Every decode
step reads each slot's whole window, masked to its own positions, and on CPU that read is a
third of a batch-64 step, so the rollout driver keeps W just ahead of the longest live sequence
(`generate_steps` with k steps needs W >= pos + k for every live slot) instead of allocating
max_len up front. A live slot that reaches the window's end stalls: its outputs are flagged
invalid and its state waits, unchanged, until the window grows.

The paged cache. `init_paged_state` gives a state whose cache is a pool of fixed-size pages
with a page table per slot, a group's prompt pages shared by its slots (jaxrl/sampler/paged.py,
docs/design.md "The paged KV cache"); every method below takes it as it takes a dense state,
and returns the same samples.

Decode-state fields, per slot b:
  tokens[b]  the last sampled token, the next step's input; it sits at position pos[b]
  pos[b]     that token's position (prompt length + tokens generated - 1)
  ngen[b]    tokens generated so far (the first one comes from the prefill)
  max_len[b] the sequence limit: a slot whose next position reaches it is done ("length")
  sample[b]  the global sample index that keys the slot's random draws (see sampling.py)
  key[b]     the slot's base key ([B, 2] key data): its prefix's key, set at insert. A decode
             call given a key draws every slot's tokens from that key; one given None draws
             slot b's from key[b], so slots of two rollouts (two seeds) decode in one call
             (the streaming producer, jaxrl.sampler.rollout.generate_stream). With every
             slot's key equal to the call's, the two are the same tokens.
  live[b]    the slot is generating; a finished or empty slot still runs but its output is
             flagged invalid and its state does not advance
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.backends import (compiler_options, decode_on_matrix_unit, heads_major_projections,
                            joins_decode_weights, writes_cache_per_head)
from jaxrl.models import ModelConfig, attention
from jaxrl.models.llama import PagedKV, init_cache, is_projection, to_heads_major
from jaxrl.parallel import batch_sharding, cache_sharding
from jaxrl.sampler import paged
from jaxrl.sampler.sampling import (SamplingParams, is_stop, sample_keys, sample_logits,
                                    step_keys, token_keys)

# {"cache": [per-layer ([B,K,W,H], [B,K,W,H])], "tokens"|"pos"|"ngen"|"sample"|"max_len":
#  [B] i32, "key": [B, 2] u32, "live": [B] bool}
DecodeState = dict
# {"kv": [per-layer ([P,K,T,H], [P,K,T,H])], "logits": [P,V], "length": [P], "tokens",
#  "logprobs": [P], "key"}
Prefix = dict


class Engine:
  """Prefill / insert / generate for one model architecture, mesh and sampling setting."""

  def __init__(self, graphdef, cfg: ModelConfig, mesh: Mesh, *, sampling: SamplingParams):
    self.graphdef, self.cfg, self.mesh, self.sampling = graphdef, cfg, mesh, sampling
    self.traces: collections.Counter = collections.Counter()
    self._prefill = jax.jit(self._prefill_fn)
    # The state (argument 0 of insert, 1 of the steps) is donated: the cache updates in place.
    self._insert = jax.jit(self._insert_fn, donate_argnums=0)
    steps_static = ("steps", "keep_pages")
    self._steps = jax.jit(self._steps_fn, donate_argnums=1, static_argnames=steps_static)
    # One slot per device on CPU: the decode step is a chain of matrix-vector products, which
    # XLA's own dot kernels run faster than its YNNPACK fusions (bench preset, batch 1: 0.86 vs
    # 1.01 ms per step). From two slots up the YNNPACK kernels win (batch 2: 1.24 vs 1.38 ms;
    # batch 64: 9.1 vs 17.3 ms), so only single-slot shards compile this way.
    self._steps_gemv = self._steps
    gemv_options = compiler_options(mesh.devices.flat, "decode_one_slot")
    if gemv_options is not None:
      self._steps_gemv = jax.jit(self._steps_fn, donate_argnums=1, static_argnames=steps_static,
                                 compiler_options=gemv_options)
    # A decode step's q, k and v (and gate and up) from one product against their joined
    # weights on CPU, one per weight elsewhere (jaxrl.backends.joins_decode_weights: on TPU the
    # join is a copy of the weights per call, half the compiler's estimate of a Qwen3-0.6B step).
    self.join_weights = joins_decode_weights(mesh.devices.flat)
    # The decode step's draw and rotary half swap as products on TPU (same tokens;
    # jaxrl.backends.decode_on_matrix_unit).
    self.mxu = decode_on_matrix_unit(mesh.devices.flat)
    # The dense cache written per KV head on TPU (jaxrl.backends.writes_cache_per_head).
    self.per_head = writes_cache_per_head(mesh.devices.flat)
    # The sampler's q, k and v weights heads-major on TPU, made once per weight sync by
    # decode_params (jaxrl.backends.heads_major_projections); every program reads either form.
    self.heads_major = heads_major_projections(mesh.devices.flat)
    self._to_heads_major = jax.jit(lambda ws: [to_heads_major(w) for w in ws])
    self._inits: dict[tuple[int, int], Callable] = {}  # (slots, length) -> jitted init
    # Not donated: a wider cache cannot reuse the old buffers (they are freed when the caller
    # drops the old state).
    self._grow = jax.jit(self._grow_fn, static_argnames="length")
    self._narrow = jax.jit(self._narrow_fn, static_argnames="length")
    self._insert_paged = jax.jit(self._insert_paged_fn, donate_argnums=0)
    self._evict = jax.jit(self._evict_fn, donate_argnums=0)
    self._extend = jax.jit(self._extend_fn, donate_argnums=1, static_argnames="restart")
    self._paged_inits: dict[tuple[int, int, int, int], Callable] = {}

  def decode_params(self, params, *, donate: bool = False):
    """`params` in the form this engine's decode steps read best: on TPU each layer's q, k
    and v weights heads-major (jaxrl.models.llama.heads_major_projections: one transpose of
    those weights, on the devices that hold them, paid once per weight sync instead of a
    copy per decode step); elsewhere `params` as they are. The other leaves are the same
    arrays. donate=True frees the replaced q, k and v arrays once their copies exist."""
    if not self.heads_major:
      return params
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    picked = [i for i, (path, x) in enumerate(leaves) if is_projection(path, x)]
    if not picked:
      return params
    old = [leaves[i][1] for i in picked]
    new = self._to_heads_major(old)
    out = [x for _, x in leaves]
    for i, w in zip(picked, new):
      out[i] = w
    if donate:
      jax.block_until_ready(new)
      for w in old:
        w.delete()
    return jax.tree_util.tree_unflatten(treedef, out)

  # --------------------------------------------------------------------------- state

  def init_decode_state(self, slots: int, max_len: int, *, length: int | None = None
                        ) -> DecodeState:
    """Empty slots for sequences of up to max_len positions, and a zeroed KV cache of `length`
    positions (default max_len; see "The cache window"), born sharded for the sampler layout."""
    length = max_len if length is None else length
    if not 0 < length <= max_len:
      raise ValueError(f"init_decode_state: length={length} must be in 1..max_len={max_len}")
    # One jitted init per shape, kept: a fresh jit per call recompiled every rollout (~50 ms,
    # a quarter of a 128-token rollout at batch 1).
    if (slots, length) not in self._inits:
      self._inits[slots, length] = self._init_fn(slots, length)
    return self._inits[slots, length](jnp.int32(max_len))

  def _init_fn(self, slots: int, length: int):
    cfg = self.cfg

    @functools.partial(jax.jit, out_shardings=self._state_shardings(slots, length))
    def init(max_len):
      self.traces["init"] += 1
      z = jnp.zeros((slots,), jnp.int32)
      return {"cache": init_cache(cfg, slots, length), "tokens": z, "pos": z, "ngen": z,
              "sample": z, "max_len": jnp.full((slots,), max_len, jnp.int32),
              "key": _empty_keys(slots), "live": jnp.zeros((slots,), bool)}

    return init

  def init_paged_state(self, slots: int, max_len: int, *, pages: int, page_size: int = 16
                       ) -> DecodeState:
    """Empty slots for sequences of up to max_len positions over a paged KV cache of `pages`
    pages of `page_size` positions (docs/design.md, "The paged KV cache"). insert, generate and
    the rest take it as they take a dense state; grow leaves it as it is."""
    if page_size < 1 or pages < 1:
      raise ValueError(f"init_paged_state: pages={pages} and page_size={page_size} must be >= 1")
    n = -(-max_len // page_size)
    shape = (slots, max_len, pages, page_size)
    if shape not in self._paged_inits:
      self._paged_inits[shape] = self._paged_init_fn(slots, n, pages, page_size)
    return self._paged_inits[shape](jnp.int32(max_len))

  def _paged_init_fn(self, slots: int, n: int, pages: int, page_size: int):
    cfg = self.cfg
    dtype = init_cache(cfg, 1, 1)[0][0].dtype
    pool = paged.pool_shape(pages, cfg.num_kv_heads, page_size, cfg.head_dim)

    @functools.partial(jax.jit, out_shardings=self._paged_shardings(slots))
    def init(max_len):
      self.traces["init"] += 1
      z = jnp.zeros((slots,), jnp.int32)
      return {"cache": [(jnp.zeros(pool, dtype), jnp.zeros(pool, dtype))
                        for _ in range(cfg.num_layers)],
              "pages": jnp.full((slots, n), -1, jnp.int32),
              "refs": jnp.zeros((pages,), jnp.int32), "tokens": z, "pos": z, "ngen": z,
              "sample": z, "max_len": jnp.full((slots,), max_len, jnp.int32),
              "key": _empty_keys(slots), "live": jnp.zeros((slots,), bool)}

    return init

  def _paged_shardings(self, slots: int):
    """The pool is replicated over the batch axes and split over KV heads as the dense cache
    is; the page table follows the slots; refs are replicated."""
    dense = cache_sharding(self.mesh, self.cfg, slots, 1).spec
    pool = NamedSharding(self.mesh, PartitionSpec(dense[1] if len(dense) > 1 else None))
    vec = batch_sharding(self.mesh, 1, "sampler")
    return {"cache": [(pool, pool)] * self.cfg.num_layers,
            "pages": batch_sharding(self.mesh, 2, "sampler"),
            "refs": NamedSharding(self.mesh, PartitionSpec()),
            "tokens": vec, "pos": vec, "ngen": vec, "sample": vec, "max_len": vec, "live": vec,
            "key": batch_sharding(self.mesh, 2, "sampler")}

  def pages_in_use(self, state: DecodeState) -> int:
    """Host side: the pages a paged state's slots hold now (0 for a dense state)."""
    return int(paged.count_used(state["refs"])) if is_paged(state) else 0

  def grow(self, state: DecodeState, length: int) -> DecodeState:
    """The state with its cache window widened to `length` positions (zeros past the old end);
    the same state when it is already that wide (a paged state always is)."""
    if is_paged(state) or length <= window(state):
      return state
    return self._grow(state, length=length)

  def narrow(self, state: DecodeState, length: int) -> DecodeState:
    """The state with its cache window cut to its first `length` positions; the same state when
    it is no wider (a paged state always is). The caller keeps every live slot's positions, and
    the next call's writes, under `length` (a slot whose write falls past the end waits, as at
    a grown window's end). generate_stream narrows when its longest live sequence has left, so
    that the next calls read only the positions their sequences need."""
    if is_paged(state) or length >= window(state):
      return state
    return self._narrow(state, length=length)

  def _narrow_fn(self, state, *, length):
    self.traces["narrow"] += 1
    cache = [tuple(c[:, :, :length] for c in layer) for layer in state["cache"]]
    return self._constrain(dict(state, cache=cache))

  def _grow_fn(self, state, *, length):
    self.traces["grow"] += 1
    pad = ((0, 0), (0, 0), (0, length - window(state)), (0, 0))
    cache = [tuple(jnp.pad(c, pad) for c in layer) for layer in state["cache"]]
    return self._constrain(dict(state, cache=cache))

  def _state_shardings(self, slots: int, length: int):
    vec = batch_sharding(self.mesh, 1, "sampler")
    shd = cache_sharding(self.mesh, self.cfg, slots, length)
    return {"cache": [(shd, shd)] * self.cfg.num_layers,
            "tokens": vec, "pos": vec, "ngen": vec, "sample": vec, "max_len": vec, "live": vec,
            "key": batch_sharding(self.mesh, 2, "sampler")}

  def _constrain(self, state: DecodeState) -> DecodeState:
    # Pin the state's layout inside each jit so the donated output keeps the input's shardings
    # (otherwise propagation may pick another layout and the next call recompiles).
    if is_paged(state):
      return jax.lax.with_sharding_constraint(
          state, self._paged_shardings(state["live"].shape[0]))
    return jax.lax.with_sharding_constraint(
        state, self._state_shardings(state["live"].shape[0], window(state)))

  # --------------------------------------------------------------------------- prefill

  def prefill(self, params, tokens_pt, true_length_p, key, *, sample_p=None) -> Prefix:
    """The KV of P right-padded prompts [P, T], their last-position logits, and a first token
    per prompt (with its logprob) drawn with the key of (sample_p, token 0).

    T should be a bucketed length (see `bucket`) so that the number of compiles stays bounded;
    `sample_p` defaults to 0..P-1.
    """
    tokens_pt = jnp.asarray(tokens_pt, jnp.int32)
    if sample_p is None:
      sample_p = np.arange(tokens_pt.shape[0], dtype=np.int32)
    return self._prefill(params, tokens_pt, jnp.asarray(true_length_p, jnp.int32),
                         jnp.asarray(sample_p, jnp.int32), key)

  def _prefill_fn(self, params, tokens_pt, length_p, sample_p, key):
    self.traces["prefill"] += 1
    model = nnx.merge(self.graphdef, params)
    h_ptd, kv = model.hidden(tokens_pt)
    # Only the last real position's logits are needed: [P, 1, D] -> [P, V].
    h_last = jnp.take_along_axis(h_ptd, (length_p - 1)[:, None, None], axis=1)
    logits_pv = model.logits(h_last)[:, 0]
    zeros = jnp.zeros_like(sample_p)
    token_p, logprob_p = sample_logits(logits_pv, token_keys(key, sample_p, zeros), self.sampling)
    return {"kv": kv, "logits": logits_pv, "length": length_p, "tokens": token_p,
            "logprobs": logprob_p, "key": key}

  # --------------------------------------------------------------------------- insert

  def insert(self, prefix: Prefix, state: DecodeState, slot: int, *, row: int = 0,
             sample: int | None = None):
    """Places prefix row `row` into `slot`. Returns (state, first) where first holds the
    slot's first token, its logprob and done flag ([1] arrays). With the default sample (the
    row's own) the first token is the one prefill returned."""
    return self.insert_many(prefix, state, rows=[row], slots=[slot],
                            samples=[row if sample is None else sample])

  def insert_group(self, prefix: Prefix, state: DecodeState, slots, *, row: int = 0,
                   samples=None):
    """One prefix into G slots: a GRPO group prefills its prompt once, not G times. Each slot
    draws its own first token from the shared last-position logits with its sample's key
    (samples default to row * G + g)."""
    g = len(slots)
    samples = [row * g + i for i in range(g)] if samples is None else samples
    return self.insert_many(prefix, state, rows=[row] * g, slots=slots, samples=samples)

  def insert_many(self, prefix: Prefix, state: DecodeState, *, rows, slots, samples):
    """The general insert: prefix row rows[m] goes to slot slots[m], keyed by samples[m].

    The index lists are padded to the slot count (padding targets slot B, which the scatter
    drops), so one compile serves any number of inserts.
    """
    num_slots = state["live"].shape[0]
    m = len(rows)
    if not m == len(slots) == len(samples) or m > num_slots:
      raise ValueError(f"insert_many: {m} rows, {len(slots)} slots and {len(samples)} samples "
                       f"must be equal in number and at most the {num_slots} slots")
    pad = num_slots - m
    rows_m = np.asarray(list(rows) + [0] * pad, np.int32)
    slots_m = np.asarray(list(slots) + [num_slots] * pad, np.int32)
    samples_m = np.asarray(list(samples) + [0] * pad, np.int32)
    if is_paged(state):
      # Entry m's lead: the first entry of its prefix row in this call, which allocates the
      # row's shared prompt pages (paged.prompt_pages).
      first_of = {}
      lead_m = np.asarray([first_of.setdefault(r, i) for i, r in enumerate(rows)] +
                          list(range(m, num_slots)), np.int32)
      lengths = np.asarray(jax.device_get(prefix["length"]))[list(rows)]
      need = paged.pages_needed(lengths, lead_m[:m] == np.arange(m),
                                page_size=state["cache"][0][0].shape[2])
      free = state["refs"].shape[0] - self.pages_in_use(state)
      if need > free:
        raise ValueError(f"insert: these {m} prompts take {need} KV pages but only {free} are "
                         f"free: insert fewer, or give the state more pages")
      state, first = self._insert_paged(state, prefix, rows_m, slots_m, samples_m, lead_m,
                                        np.arange(num_slots) < m)
      return state, {k: v[:m] for k, v in first.items()}
    state, first = self._insert(state, prefix, rows_m, slots_m, samples_m)
    return state, {k: v[:m] for k, v in first.items()}

  def _insert_fn(self, state, prefix, rows_m, slots_m, samples_m):
    self.traces["insert"] += 1
    T = window(prefix)
    if T > window(state):
      raise ValueError(f"insert: the prefix has {T} positions but the cache window only "
                       f"{window(state)}: grow the state first (Engine.grow)")
    cache = [tuple(c.at[slots_m, :, :T].set(x[rows_m].astype(c.dtype), mode="drop")
                   for c, x in zip(layer, prefix_layer))
             for layer, prefix_layer in zip(state["cache"], prefix["kv"])]
    # Positions T.. of a reused slot keep the previous occupant's KV: harmless, since a query
    # only attends to positions <= its own and each step writes its position before reading.
    return self._place_first(dict(state, cache=cache), prefix, rows_m, slots_m, samples_m)

  def _first_tokens(self, state, prefix, rows_m, slots_m, samples_m):
    """Each insert's first token, its logprob and done flag, and its prompt length."""
    sp = self.sampling
    logits_mv = prefix["logits"][rows_m]
    keys_m = token_keys(prefix["key"], samples_m, jnp.zeros_like(samples_m))
    token_m, logprob_m = sample_logits(logits_mv, keys_m, sp)
    length_m = prefix["length"][rows_m]
    # (padding entries target slot B: any slot's limit will do, their results are dropped)
    max_len_m = state["max_len"][jnp.minimum(slots_m, state["live"].shape[0] - 1)]
    done_m = is_stop(token_m, sp) | (sp.max_new_tokens <= 1) | (length_m >= max_len_m)
    return token_m, logprob_m, done_m, length_m

  def _place_first(self, state, prefix, rows_m, slots_m, samples_m, first=None):
    token_m, logprob_m, done_m, length_m = first or self._first_tokens(
        state, prefix, rows_m, slots_m, samples_m)

    def put(x, v):
      return x.at[slots_m].set(v.astype(x.dtype), mode="drop")

    state = dict(state, tokens=put(state["tokens"], token_m), pos=put(state["pos"], length_m),
                 ngen=put(state["ngen"], jnp.ones_like(token_m)),
                 sample=put(state["sample"], samples_m), live=put(state["live"], ~done_m),
                 key=_put_key(state["key"], slots_m, prefix["key"]))
    return self._constrain(state), {"tokens": token_m, "logprobs": logprob_m, "done": done_m}

  def _insert_paged_fn(self, state, prefix, rows_m, slots_m, samples_m, lead_m, valid_m):
    """insert over a paged state: each prefix row's full prompt pages written once and shared
    by its slots, each slot's partial last page its own copy (paged.prompt_pages)."""
    self.traces["insert"] += 1
    first = self._first_tokens(state, prefix, rows_m, slots_m, samples_m)
    done_m, length_m = first[2], first[3]
    page_size = state["cache"][0][0].shape[2]
    n = state["pages"].shape[1]
    T = window(prefix)
    if T > n * page_size:
      raise ValueError(f"insert: the prefix has {T} positions but a slot's page table only "
                       f"{n * page_size}: make the state with a larger max_len")
    tp = -(-T // page_size)
    refs, table_mj, write_mj = paged.prompt_pages(
        state["refs"], length_m, lead_m, valid_m, ~done_m, page_size=page_size, num_pages=tp)
    # Each row's prompt pages, written to the pages the entries allocated.
    cache = [tuple(paged.write_prompt(c, x, rows_m, write_mj)
                   for c, x in zip(layer, prefix_layer))
             for layer, prefix_layer in zip(state["cache"], prefix["kv"])]
    table_mn = jnp.pad(table_mj, ((0, 0), (0, n - tp)), constant_values=-1)
    pages = state["pages"].at[slots_m].set(table_mn, mode="drop")
    state = dict(state, cache=cache, pages=pages, refs=refs)
    return self._place_first(state, prefix, rows_m, slots_m, samples_m, first)

  # --------------------------------------------------------------------------- evict

  def evict(self, state: DecodeState, slots) -> DecodeState:
    """Ends the sequences in `slots` now, unfinished (preemption: the rollout driver
    regenerates them later from their prompts). Their slots are no longer live and, in a paged
    state, drop their pages as a finished slot does (a shared prompt page stays while another
    slot holds it)."""
    num_slots = state["live"].shape[0]
    mask_b = np.zeros((num_slots,), bool)
    mask_b[list(slots)] = True
    return self._evict(state, mask_b)

  def _evict_fn(self, state, mask_b):
    self.traces["evict"] += 1
    state = dict(state, live=state["live"] & ~mask_b)
    if is_paged(state):
      refs, pages = paged.release(state["refs"], state["pages"], mask_b)
      state = dict(state, refs=refs, pages=pages)
    return self._constrain(state)

  # --------------------------------------------------------------------------- extend

  def extend(self, params, state: DecodeState, key, *, slots, tokens_et, length_e,
             samples=None):
    """Continues E slots' sequences without re-prefilling them (a conversation's next turn):
    slot slots[e] feeds its pending token (the last one sampled, at pos) and then
    tokens_et[e, :length_e[e]] (an observation, right-padded to T), writing their KV after
    the slot's own, and draws its next token from the logits after the last of them. The slot
    is then live again at the position after that token. Returns (state, out): out's
    "tokens", "logprobs", "done" [E] and "logits" [E, V].

    samples=None: the slot goes on as one sample (key (its sample, tokens so far), and
    max_new_tokens counts all its turns). samples[e]: a new turn keyed as sample samples[e]
    from token 0, max_new_tokens counting from it (a conversation's turns draw distinct
    keys). A slot index >= the slot count is padding: its entry is computed and dropped.
    The window must hold pos + 1 + T for every slot extended (grow a dense state first). In a
    paged state the slot takes free pages for its new positions (the padding's writes that fall
    past them are dropped); the pool must hold them (the scheduler's reserve admission does)."""
    slots = np.asarray(slots, np.int32)
    tokens_et = np.asarray(tokens_et, np.int32)
    length_e = np.asarray(length_e, np.int32)
    num_slots = state["live"].shape[0]
    # Padding entries (slot >= num_slots) are dropped: only real slots must fit.
    pos = np.asarray(jax.device_get(state["pos"]))[slots[slots < num_slots]]
    if len(pos) and int((pos + 1 + tokens_et.shape[1]).max()) > window(state):
      raise ValueError(f"extend: the window holds {window(state)} positions but a slot needs "
                       f"{int((pos + 1 + tokens_et.shape[1]).max())}: grow the state first "
                       "(Engine.grow)")
    restart = samples is not None
    samples = np.asarray(slots if samples is None else samples, np.int32)
    return self._extend(params, state, key, jnp.asarray(slots), jnp.asarray(tokens_et),
                        jnp.asarray(length_e), jnp.asarray(samples), restart=restart)

  def _extend_fn(self, params, state, key, slots_e, tokens_et, length_e, samples_e, *,
                 restart):
    self.traces["extend"] += 1
    sp = self.sampling
    model = nnx.merge(self.graphdef, params)
    # Padding entries (slot >= B) read the last slot and are dropped by every scatter below.
    read_e = jnp.minimum(slots_e, state["live"].shape[0] - 1)
    start_e = state["pos"][read_e]
    seq_et = jnp.concatenate([state["tokens"][read_e][:, None], tokens_et], axis=1)
    positions_et = start_e[:, None] + jnp.arange(seq_et.shape[1])[None, :]
    # The slots' own rows of the cache, continued with the multi-token cached forward (each
    # row written at its own offset; padding past length_e lands after the last real token,
    # where the next decode step overwrites it before any query reads it). A paged state's
    # rows are gathered from its pages and the pages of the new positions written back.
    if is_paged(state):
      state, rows, put_rows = paged.extend_rows(state, slots_e, read_e, start_e, length_e,
                                                seq_et.shape[1])
    else:
      rows = [(k[read_e], v[read_e]) for k, v in state["cache"]]
    h_etd, rows = model.hidden(seq_et, positions_et, cache=rows)
    h_last = jnp.take_along_axis(h_etd, length_e[:, None, None], axis=1)  # [E, 1, D]
    logits_ev = model.logits(h_last)[:, 0]
    if restart:
      sample_e, ngen_e = samples_e, jnp.zeros_like(samples_e)
    else:
      sample_e, ngen_e = state["sample"][read_e], state["ngen"][read_e]
    token_e, logprob_e = sample_logits(logits_ev, token_keys(key, sample_e, ngen_e), sp)
    pos_e = start_e + length_e + 1
    done_e = is_stop(token_e, sp) | (ngen_e + 1 >= sp.max_new_tokens) | (
        pos_e >= state["max_len"][read_e])
    if is_paged(state):
      cache = put_rows(rows)
    else:
      cache = [(k.at[slots_e].set(rk, mode="drop"), v.at[slots_e].set(rv, mode="drop"))
               for (k, v), (rk, rv) in zip(state["cache"], rows)]

    def put(x, v):
      return x.at[slots_e].set(v.astype(x.dtype), mode="drop")

    state = dict(state, cache=cache, tokens=put(state["tokens"], token_e),
                 pos=put(state["pos"], pos_e), ngen=put(state["ngen"], ngen_e + 1),
                 sample=put(state["sample"], sample_e), live=put(state["live"], ~done_e),
                 key=_put_key(state["key"], slots_e, key) if restart else state["key"])
    return self._constrain(state), {"tokens": token_e, "logprobs": logprob_e, "done": done_e,
                                    "logits": logits_ev}

  # --------------------------------------------------------------------------- generate

  def generate(self, params, state: DecodeState, key=None):
    """One decode step for every slot: (state, out) with out's "tokens", "logprobs", "done"
    and "valid" (the slot was live, so the token is real) each [B]. key=None: each slot draws
    with its own key (the one its prefix was made with; see "key[b]" above)."""
    state, out = self._decode(state)(params, state, key, steps=1)
    return state, {k: v[0] for k, v in out.items()}

  def generate_steps(self, params, state: DecodeState, key=None, *, steps: int,
                     keep_pages: bool = False):
    """`steps` decode steps in one jitted lax.scan: out's arrays are [steps, B]. The host
    needs no sync between the steps; a slot that finishes mid-scan idles until the end.
    keep_pages=True (paged state): a slot that finishes keeps its pages, for a conversation's
    next turn (extend), until evict frees them."""
    return self._decode(state)(params, state, key, steps=steps, keep_pages=keep_pages)

  def _decode(self, state: DecodeState):
    """The jitted decode steps for this state: the GEMV-compiled ones when each device holds
    one slot (see __init__)."""
    live = state["live"]
    local_slots = live.sharding.shard_shape(live.shape)[0]
    return self._steps_gemv if local_slots == 1 else self._steps

  def _steps_fn(self, params, state, key, *, steps, keep_pages=False, unroll=False):
    self.traces["generate"] += 1
    model = nnx.merge(self.graphdef, params)
    width = window(state)
    join = self.join_weights
    if is_paged(state):
      with attention.tracing(paged=self._paged_kernel(state), join_weights=join,
                             rope_matmul=self.mxu):
        return self._scan_steps(model, state, key, steps, width, keep_pages, unroll)
    with attention.tracing(decode=self._attention_kernel(state), join_weights=join,
                           rope_matmul=self.mxu, write_per_head=self.per_head):
      return self._scan_steps(model, state, key, steps, width, unroll=unroll)

  def _attention_kernel(self, state: DecodeState):
    """The backend's decode-step attention kernel for this state's cache, or None (XLA's
    attention; see jaxrl.models.attention). On CPU the C++ kernel, for float32 models where it
    could be built: the GRPO anchor's rollout (bench preset, 64 slots, 64 tokens) took 920 ms
    against 1,065 with XLA's attention (median of 10 alternating pairs, benchmarks/sampler.py,
    2026-12-02)."""
    slots, width = state["live"].shape[0], window(state)
    return attention.decode_kernel(
        self.mesh, cache_sharding(self.mesh, self.cfg, slots, width).spec)

  def _paged_kernel(self, state: DecodeState):
    """The backend's paged decode attention kernel (Pallas paged attention on TPU and GPU,
    jaxrl.backends), or None: XLA's gather path (attention.xla_paged_decode_attention)."""
    slots = state["live"].shape[0]
    return attention.paged_decode_kernel(
        self.mesh, cache_sharding(self.mesh, self.cfg, slots, 1).spec)

  def _scan_steps(self, model, state, key, steps, width, keep_pages=False, unroll=False):
    sp = self.sampling

    paged_cache = is_paged(state)

    def step(state, _):
      # A slot generates this step if it is live and its next write (at pos) fits the window;
      # any other slot is fed position `width`, outside the cache, where its write is dropped.
      active_b = state["live"] & (state["pos"] < width)
      cache = state["cache"]
      if paged_cache:
        # The call's pages were taken before the scan (_take_pages): a slot whose write falls
        # on a page it was not given (none was left) stalls.
        page_size = cache[0][0].shape[2]
        pages_bn = state["pages"]
        j_b = jnp.minimum(state["pos"] // page_size, pages_bn.shape[1] - 1)
        held_b = jnp.take_along_axis(pages_bn, j_b[:, None], axis=1)[:, 0]
        active_b = active_b & (held_b >= 0)
        # The page each active slot writes, known here: the model need not read it back from
        # the table (an inactive slot writes nothing, -1).
        write_b = jnp.where(active_b, held_b, -1)
        cache = [PagedKV(k, v, pages_bn, write_b) for k, v in cache]
      logits, cache = model(state["tokens"][:, None],
                            jnp.where(active_b, state["pos"], width)[:, None],
                            cache=cache)
      if sample_keys_b is not None:
        keys_b = step_keys(sample_keys_b, state["ngen"])
      elif key is None:  # each slot's own key
        keys_b = jax.vmap(lambda k, s, t: token_keys(k, s[None], t[None])[0])(
            jax.random.wrap_key_data(state["key"]), state["sample"], state["ngen"])
      else:
        keys_b = token_keys(key, state["sample"], state["ngen"])
      # The barrier keeps the logits matmul a plain dot: XLA:CPU fused it with log_softmax's
      # max into one kernel that took 338 us per step at batch 64 (bench preset), ~4% of it.
      token_b, logprob_b = sample_logits(jax.lax.optimization_barrier(logits[:, 0]), keys_b, sp,
                                         mxu=self.mxu)
      ngen_b = state["ngen"] + active_b
      pos_b = state["pos"] + active_b
      done_b = active_b & (is_stop(token_b, sp) | (ngen_b >= sp.max_new_tokens) |
                           (pos_b >= state["max_len"]))
      new = dict(state, cache=cache, tokens=jnp.where(active_b, token_b, state["tokens"]),
                 pos=pos_b, ngen=ngen_b, live=state["live"] & ~done_b)
      out = {"tokens": token_b, "logprobs": logprob_b, "done": done_b, "valid": active_b}
      if paged_cache:
        refs, pages_bn = new["refs"], new["pages"]
        if not keep_pages:
          refs, pages_bn = paged.release(refs, pages_bn, done_b)
        new = dict(new, cache=[(c.keys, c.values) for c in cache], refs=refs, pages=pages_bn)
        out["pages_used"] = paged.count_used(refs)
      return new, out

    # On TPU (Engine.mxu) token_keys' first fold, fold_in(key, sample), once per call: no step
    # changes a slot's sample or key (one threefry hash per step fewer, the same keys). The
    # CPU's decode program stays as it was measured (benchmarks/sampler.py).
    sample_keys_b = None
    if self.mxu and key is None:  # each slot's own key
      sample_keys_b = jax.vmap(lambda k, s: sample_keys(k, s[None])[0])(
          jax.random.wrap_key_data(state["key"]), state["sample"])
    elif self.mxu:
      sample_keys_b = sample_keys(key, state["sample"])
    if paged_cache:
      state = self._take_pages(state, steps, width)
    # unroll: the steps written out one after another, for XLA's cost analysis, which counts a
    # loop's body once whatever its trip count (benchmarks/scale.py --decode-counts).
    state, out = jax.lax.scan(step, state, None, length=steps, unroll=steps if unroll else 1)
    return self._constrain(state), out

  def _take_pages(self, state, steps: int, width: int):
    """The pages the live slots write in the next `steps` decode steps, taken once for the
    call: slot b writes positions pos .. pos + k - 1, k = min(steps, max_new_tokens - ngen,
    max_len - pos, width - pos) (the rollout driver's count, scheduler._PageBook.growth), and
    takes a free page for each page of them it does not hold, in the order the steps reach
    them (then slot by slot), the k-th request the k-th free page (paged.allocate). A slot
    left without one stalls at that page's first position until a later call gives it one.
    Per step instead, the allocation was ~20 small ops of each decode step (Qwen3-0.6B on
    v5e:2x4, batch 64: 0.910 -> 0.889 ms of ops per step by libtpu's estimate); taken per
    call, a page freed by a slot that finishes mid-call is taken by the next call, not by a
    slot that needs it later in the same call."""
    pages_bn, pos_b, ngen_b = state["pages"], state["pos"], state["ngen"]
    B, n = pages_bn.shape
    P = state["cache"][0][0].shape[2]
    span = (steps - 1) // P + 2  # the most pages k <= steps positions can start or touch
    k_b = jnp.minimum(jnp.minimum(steps, self.sampling.max_new_tokens - ngen_b),
                      jnp.minimum(state["max_len"] - pos_b, width - pos_b))
    k_b = jnp.where(state["live"], jnp.maximum(k_b, 0), 0)
    j_bs = pos_b[:, None] // P + jnp.arange(span)[None, :]
    held_bs = jnp.take_along_axis(pages_bn, jnp.minimum(j_bs, n - 1), axis=1)
    want_bs = ((k_b > 0)[:, None] & (j_bs * P < (pos_b + k_b)[:, None]) & (j_bs < n) &
               (held_bs < 0))
    # Requests in the order the steps would make them: by the step that first writes the
    # page, then by slot.
    step_bs = jnp.maximum(j_bs * P - pos_b[:, None], 0)
    order = jnp.argsort((step_bs * B + jnp.arange(B)[:, None]).reshape(-1))
    page_o, got_o = paged.allocate(state["refs"], want_bs.reshape(-1)[order],
                                   method="compare_all")
    page_k = jnp.zeros_like(page_o).at[order].set(page_o)
    got_k = jnp.zeros_like(got_o).at[order].set(got_o)
    rows = jnp.where(got_k, jnp.repeat(jnp.arange(B), span), B)
    pages_bn = pages_bn.at[rows, j_bs.reshape(-1)].set(page_k, mode="drop")
    return dict(state, pages=pages_bn, refs=paged.hold(state["refs"], page_k, 1))


def _empty_keys(slots: int):
  """[B, 2] key data of jax.random.key(0): what an empty slot holds until an insert."""
  return jnp.tile(jax.random.key_data(jax.random.key(0))[None], (slots, 1))


def _put_key(keys_b, slots_m, key):
  """keys_b with the rows slots_m (>= B: padding, dropped) set to `key`'s data."""
  data = jax.random.key_data(key)
  return keys_b.at[slots_m].set(jnp.broadcast_to(data, (slots_m.shape[0],) + data.shape),
                                mode="drop")


def window(state_or_prefix) -> int:
  """The positions a decode state's KV cache holds now (see "The cache window"), or a
  prefix's KV length."""
  if is_paged(state_or_prefix):  # every position of the page table
    return state_or_prefix["pages"].shape[1] * state_or_prefix["cache"][0][0].shape[2]
  kv = state_or_prefix["cache" if "cache" in state_or_prefix else "kv"]
  return kv[0][0].shape[2]


def is_paged(state) -> bool:
  """Whether a decode state holds a paged KV cache (Engine.init_paged_state)."""
  return "refs" in state


def bucket(n: int, *, minimum: int = 16) -> int:
  """The power of two >= n (at least `minimum`): prompt lengths and prefill batch sizes are
  padded to these so the number of compiles grows with log(length), not with length."""
  b = minimum
  while b < n:
    b *= 2
  return b


def window_bucket(n: int, *, minimum: int = 16) -> int:
  """The smallest 2^j or 1.5 * 2^j >= n (at least `minimum`): cache windows grow in these half-
  octave steps, so a rollout compiles at most two decode scans per doubling of its length and
  reads at most 1.5x the positions its longest sequence needs."""
  b = minimum
  while b < n:
    b = b * 3 // 2 if b & (b - 1) == 0 else b // 3 * 4
  return b
