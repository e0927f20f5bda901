"""The paged KV cache's bookkeeping: page allocation, shared prompt pages, freeing
(docs/design.md, "The paged KV cache").

A paged decode state holds, beside the dense state's [B] vectors:
  cache      per layer a (keys, values) pair of page pools [K, N, P, H]: KV head first, the
             layout jax's TPU and GPU paged attention kernels read in place
             (jaxrl.models.attention.paged_write writes one position)
  pages      [B, n] int32, slot b's page table: position p lives on page pages[b, p // P]
             at offset p % P; -1 where the slot holds no page
  refs       [N] int32, how many slots hold each page; refs == 0 is the free list

Everything here is a pure function of arrays, traced inside the engine's jitted insert and
decode step, so allocating and freeing pages needs no host sync.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def allocate(refs_n, request_k, *, method: str = "scan"):
  """Free pages for the requests request_k [M] (bool): the k-th request (in order) takes the
  k-th free page by page id. Returns (page_k, granted_k): page_k is N (one past the pool,
  which scatters drop) where nothing was requested or no page was left.

  method: jnp.searchsorted's. "compare_all" ([M, N] comparisons in one pass) is the decode
  step's: the default "scan" is a loop of log2(N) rounds of small ops, which compiled for v5e
  took 40 us of a Qwen3-0.6B decode step (batch 64, 1,280 pages), ~2 us as one pass. Both find
  the same pages."""
  num_pages = refs_n.shape[0]
  free_n = refs_n == 0
  rank_k = jnp.cumsum(request_k.astype(jnp.int32)) - 1
  # The r-th free page is the first index whose running count of free pages reaches r + 1.
  page_k = jnp.searchsorted(jnp.cumsum(free_n.astype(jnp.int32)), rank_k + 1, side="left",
                            method=method)
  granted_k = request_k & (rank_k < free_n.sum())
  return jnp.where(granted_k, page_k, num_pages).astype(jnp.int32), granted_k


def hold(refs_n, pages_k, delta: int):
  """refs_n with `delta` added for each page id in pages_k (any shape); ids < 0 or >= N are
  skipped."""
  num_pages = refs_n.shape[0]
  idx = jnp.where(pages_k >= 0, pages_k, num_pages).reshape(-1)
  return refs_n.at[idx].add(delta, mode="drop")


def release(refs_n, pages_bn, done_b):
  """Slots done_b [B] drop their pages: (refs, pages) with one reference fewer on each page of
  their table rows, and those rows reset to -1. A shared prompt page is free when the last
  slot of its group lets go of it."""
  refs_n = hold(refs_n, jnp.where(done_b[:, None], pages_bn, -1), -1)
  return refs_n, jnp.where(done_b[:, None], -1, pages_bn)


def prompt_pages(refs_n, length_m, lead_m, valid_m, keep_m, *, page_size: int, num_pages: int):
  """The pages of M inserts of prompts of length_m [M] positions, T = num_pages * page_size
  positions of prefix at most.

  Entry m shares the full pages (length // P of them) of its lead entry lead_m[m] (the first
  entry of the same prefix row in this call; a lead is its own lead), which the lead allocates,
  and gets a page of its own for its last, partial prompt page (copy-on-write: it writes its
  completion there). Entries with valid_m False (padding) request nothing; entries with keep_m
  False (done on their first token) hold nothing.

  Returns (refs, table_mj [M, num_pages] each entry's page table row (-1 past its prompt),
  write_mj [M, num_pages] the page each entry writes its prefix's page j to (N: none, for a
  shared page that its lead writes)).
  """
  M = length_m.shape[0]
  j = jnp.arange(num_pages)[None, :]
  full_m = (length_m // page_size)[:, None]
  part_m = (length_m % page_size > 0)[:, None]
  is_lead = (lead_m == jnp.arange(M))[:, None]
  request_mj = valid_m[:, None] & ((is_lead & (j < full_m)) | ((j == full_m) & part_m))
  page_k, _ = allocate(refs_n, request_mj.reshape(-1))
  write_mj = page_k.reshape(M, num_pages)
  table_mj = jnp.where(j < full_m, write_mj[lead_m], jnp.where((j == full_m) & part_m,
                                                                write_mj, -1))
  table_mj = jnp.where((valid_m & keep_m)[:, None], table_mj, -1)
  return hold(refs_n, table_mj, 1), table_mj, write_mj


def pages_needed(lengths, leads, *, page_size: int) -> int:
  """Host side: the free pages an insert of prompts of these lengths takes (see prompt_pages),
  leads[m] True for the first entry of each prefix row."""
  return sum((n // page_size if lead else 0) + (n % page_size > 0)
             for n, lead in zip(lengths, leads))


def pool_shape(num_pages: int, kv_heads: int, page_size: int, head_dim: int):
  """One layer's key (or value) pool: [K, N, P, H]."""
  return (kv_heads, num_pages, page_size, head_dim)


def write_prompt(pool_knph, kv_pkth, rows_m, write_mj):
  """The pool with entry m's prefix row rows_m[m] of kv_pkth [P, K, T, H] written page by page:
  its page j (positions j*P..) to page write_mj[m, j] (N: not written, e.g. a shared page its
  lead writes). write_mj [M, tp] covers the prefix's first tp pages."""
  K, _, page, H = pool_knph.shape
  tp = write_mj.shape[1]
  pages_mjkph = to_pages(kv_pkth, page)[rows_m, :tp]
  pages_kxph = pages_mjkph.transpose(2, 0, 1, 3, 4).reshape(K, -1, page, H)
  return pool_knph.at[:, write_mj.reshape(-1)].set(pages_kxph.astype(pool_knph.dtype),
                                                   mode="drop")


def to_pages(kv_pkth, page_size: int):
  """A prefix's [P, K, T, H] keys or values as pages [P, ceil(T / P), K, page, H] (zeros past
  T)."""
  p, k, t, h = kv_pkth.shape
  n = -(-t // page_size)
  kv_pkth = jnp.pad(kv_pkth, ((0, 0), (0, 0), (0, n * page_size - t), (0, 0)))
  return kv_pkth.reshape(p, k, n, page_size, h).transpose(0, 2, 1, 3, 4)


def count_used(refs_n) -> jax.Array:
  """Pages in use (held by at least one slot)."""
  return (refs_n > 0).sum()


def extend_rows(state, slots_e, read_e, start_e, length_e, width: int):
  """Engine.extend over a paged decode state: (the state with free pages taken for each
  entry's positions start .. start + length (its pending token and appended tokens), the
  entries' dense cache rows [E, K, n * P, H] gathered from their page tables, and put(rows) ->
  the page pools with the rows' pages from start's on written back). Positions past start
  are the slot's own pages (a group shares only its prompt's full pages), so nothing shared
  is written; a page the padding alone reaches is not taken, and its writes are dropped."""
  B, n = state["pages"].shape
  K, N, P, H = state["cache"][0][0].shape
  E = slots_e.shape[0]
  span = -(-width // P) + 1  # the pages `width` positions from start can touch
  j_es = start_e[:, None] // P + jnp.arange(span)[None, :]
  held_es = jnp.take_along_axis(state["pages"][read_e], jnp.minimum(j_es, n - 1), axis=1)
  want_es = ((slots_e < B)[:, None] & (j_es * P <= (start_e + length_e)[:, None]) &
             (j_es < n) & (held_es < 0))
  page_k, got_k = allocate(state["refs"], want_es.reshape(-1))
  rows_k = jnp.where(got_k, jnp.repeat(slots_e, span), B)
  pages_bn = state["pages"].at[rows_k, j_es.reshape(-1)].set(page_k, mode="drop")
  state = dict(state, pages=pages_bn, refs=hold(state["refs"], page_k, 1))
  table_en = pages_bn[read_e]
  # Where each entry's pages j_es go: their page ids, N (dropped) past the table, for padding
  # entries, and for pages neither held nor taken.
  dest_es = jnp.take_along_axis(table_en, jnp.minimum(j_es, n - 1), axis=1)
  dest_es = jnp.where((slots_e < B)[:, None] & (j_es < n) & (dest_es >= 0), dest_es, N)

  def gather(pool_knph):  # unheld pages read page 0: positions no query reaches
    x = pool_knph[:, jnp.maximum(table_en, 0)]  # [K, E, n, P, H]
    return x.transpose(1, 0, 2, 3, 4).reshape(E, K, n * P, H)

  def put(rows):
    def scatter(pool_knph, row_ekth):
      pages_esk = row_ekth.reshape(E, K, n, P, H)[
          jnp.arange(E)[:, None], :, jnp.minimum(j_es, n - 1)]  # [E, span, K, P, H]
      x = pages_esk.reshape(E * span, K, P, H).transpose(1, 0, 2, 3)
      return pool_knph.at[:, dest_es.reshape(-1)].set(x.astype(pool_knph.dtype), mode="drop")
    return [(scatter(k, rk), scatter(v, rv)) for (k, v), (rk, rv) in zip(state["cache"], rows)]

  return state, [(gather(k), gather(v)) for k, v in state["cache"]], put
