"""Token log-probs and entropy straight from hidden states, the LM head applied in chunks of
positions, so that no [B, T, V] float32 logits array is ever live.

    logp_bt, entropy_bt = chunked_token_logprobs(h_btd, w, targets_bt, tied=True,
                                                 temperature=1.0, chunk=256, entropy=True)

The same quantity as `jaxrl.models.llama.token_logprobs(logits, targets)` with logits = the LM
head of h (log_softmax(logits / temperature)[target], and the entropy of that distribution),
equal within float32 rounding, values and gradients (tests/test_chunked.py).

Why a hand-written VJP, not jax.checkpoint around a scan body: the forward keeps only each
position's log-sum-exp and entropy ([B, T]); the backward recomputes one chunk's logits at a
time and writes the softmax's gradient in one elementwise pass (p - onehot for log pi, and
-p (log p + H) for the entropy), where autodiff of log_softmax left several [B, c, V]
temporaries per chunk. The LM head's gradient is summed over the chunks in float32 and cast
once at the end, so a bf16 head does not lose precision to a sum of bf16 partials.

Why not a library: tokamax's linear_softmax_cross_entropy_loss (the one kept JAX library with
a memory-efficient linear cross-entropy; a Mosaic TPU and a Triton kernel) returns one scalar
loss, sum or mean over all rows, with no per-token values, no weights or mask, no temperature
and no entropy, while GRPO needs per-token log pi (for its ratios) and the entropy, and SFT a
masked sum. Its XLA fallback materialises the full logits.

Memory (what jaxrl's plan counts): a few float32 arrays of B x chunk x V at a time (XLA's
count: about 2 on CPU, about 4 compiled for a TPU v5e; docs/guides/memory.md), plus the
[V, D] float32 sum of the head's gradient, sharded as the head.

Shapes: B rows, T positions, c = chunk, n = ceil(T / c) chunks, D embed, V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def lm_head(h_btd, w, *, tied: bool):
  """Logits [B, T, V] float32 of hidden states [B, T, D] (in their compute dtype) under the LM
  head: the tied embedding [V, D] or an untied head [D, V]. The matmul accumulates in float32.

  Tied weights contract the embedding on its own D axis. Written as h @ embed.T, XLA:CPU fused
  the transpose and the final norm into a loop fusion that recomputed the transposed table
  every decode step: 93 us of a 1.0 ms batch-1 step on the bench preset, ~20 us as this."""
  w = w.astype(h_btd.dtype)
  if tied:
    return jnp.einsum("BTD,VD->BTV", h_btd, w, preferred_element_type=jnp.float32)
  return jnp.einsum("BTD,DV->BTV", h_btd, w, preferred_element_type=jnp.float32)


def chunked_token_logprobs(h_btd, w, targets_bt, *, tied: bool, temperature: float = 1.0,
                           chunk: int, entropy: bool = True):
  """(log pi(target) [B, T], entropy [B, T] or None) of hidden states h under the LM head `w`,
  computed over chunks of `chunk` positions (the last one may be ragged)."""
  if chunk <= 0:
    raise ValueError(f"chunk must be positive, got {chunk}")
  out = _chunked(h_btd, w, targets_bt, bool(tied), float(temperature), int(chunk),
                 bool(entropy))
  return out if entropy else (out[0], None)


def _split(x_bt, n, c):
  """[B, T, ...] -> [n, B, c, ...], zero-padded to n * c positions: the scan's chunks."""
  B, T = x_bt.shape[:2]
  pad = [(0, 0), (0, n * c - T)] + [(0, 0)] * (x_bt.ndim - 2)
  x = jnp.pad(x_bt, pad).reshape(B, n, c, *x_bt.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _join(x_nbc, T):
  """[n, B, c, ...] -> [B, T, ...]: the inverse of _split, the padding dropped."""
  x = jnp.moveaxis(x_nbc, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T]


def _chunk_stats(h_bcd, w, t_bc, tied, temperature, entropy):
  """One chunk's (log pi(target), log-sum-exp, entropy or zeros) [B, c] from its logits."""
  s_bcv = lm_head(h_bcd, w, tied=tied) / temperature
  lse_bc = jax.nn.logsumexp(s_bcv, axis=-1)
  logp_bc = jnp.take_along_axis(s_bcv, t_bc[..., None], axis=-1)[..., 0] - lse_bc
  if entropy:
    # -sum p log p, not lse - sum p s: the latter cancels two numbers of the logits' size and
    # lost 20x the precision at logits of about 20 (and the entropy's gradient reuses it).
    logp_bcv = s_bcv - lse_bc[..., None]
    ent_bc = -jnp.sum(jnp.exp(logp_bcv) * logp_bcv, axis=-1)
  else:
    ent_bc = jnp.zeros_like(lse_bc)
  return logp_bc, lse_bc, ent_bc


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked(h_btd, w, targets_bt, tied, temperature, chunk, entropy):
  return _chunked_fwd(h_btd, w, targets_bt, tied, temperature, chunk, entropy)[0]


def _chunked_fwd(h_btd, w, targets_bt, tied, temperature, chunk, entropy):
  T = h_btd.shape[1]
  n = -(-T // chunk)

  def body(_, xs):
    h_bcd, t_bc = xs
    return None, _chunk_stats(h_bcd, w, t_bc, tied, temperature, entropy)

  _, (logp, lse, ent) = jax.lax.scan(body, None, (_split(h_btd, n, chunk),
                                                  _split(targets_bt, n, chunk)))
  logp_bt, lse_bt, ent_bt = _join(logp, T), _join(lse, T), _join(ent, T)
  return (logp_bt, ent_bt), (h_btd, w, targets_bt, lse_bt, ent_bt)


def _chunked_bwd(tied, temperature, chunk, entropy, res, cts):
  h_btd, w, targets_bt, lse_bt, ent_bt = res
  g_logp_bt, g_ent_bt = cts
  T = h_btd.shape[1]
  n = -(-T // chunk)
  dt = h_btd.dtype
  w_c = w.astype(dt)

  def body(dw, xs):
    h_bcd, t_bc, lse_bc, ent_bc, g_bc, gent_bc = xs
    s_bcv = lm_head(h_bcd, w_c, tied=tied) / temperature
    logp_bcv = s_bcv - lse_bc[..., None]
    p_bcv = jnp.exp(logp_bcv)
    # d log pi(t) / d s = onehot(t) - p;  d H / d s = -p (log p + H).
    onehot_bcv = jnp.arange(s_bcv.shape[-1]) == t_bc[..., None]
    ds_bcv = jnp.where(onehot_bcv, g_bc[..., None], 0.0) - g_bc[..., None] * p_bcv
    if entropy:
      ds_bcv = ds_bcv - gent_bc[..., None] * p_bcv * (logp_bcv + ent_bc[..., None])
    dz_bcv = ds_bcv / temperature  # float32, as autodiff hands the logits' gradient on
    # The two products as autodiff writes them: the float32 gradient against the compute-dtype
    # operand, accumulated in float32 (a bf16 dz would be faster on a TPU but would not be the
    # unchunked gradient).
    both = ((0, 1), (0, 1)), ((), ())
    if tied:  # w [V, D]
      dh_bcd = jax.lax.dot_general(dz_bcv, w_c, (((2,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
      dw = dw + jax.lax.dot_general(dz_bcv, h_bcd, both, preferred_element_type=jnp.float32)
    else:  # w [D, V]
      dh_bcd = jax.lax.dot_general(dz_bcv, w_c, (((2,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
      dw = dw + jax.lax.dot_general(h_bcd, dz_bcv, both, preferred_element_type=jnp.float32)
    return dw, dh_bcd.astype(dt)

  g_ent = g_ent_bt if entropy else jnp.zeros_like(g_logp_bt)
  xs = tuple(_split(x, n, chunk) for x in (h_btd, targets_bt, lse_bt, ent_bt,
                                             g_logp_bt.astype(jnp.float32),
                                             g_ent.astype(jnp.float32)))
  dw, dh = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
  return _join(dh, T), dw.astype(w.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
