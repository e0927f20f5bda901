"""A Llama-family decoder in flax.nnx: Llama 3.x, Qwen2.5 and Qwen3 from one ModelConfig.

Every parameter carries logical axis names in its `axes` metadata (`vocab`, `embed`, `heads`,
`kv_heads`, `head_dim`, `mlp`, `norm`); jaxrl.parallel maps them to mesh axes per layout. Layers
never name mesh axes.

Two forward modes share one code path:
  * full-sequence (cache=None): causal attention within the sequence (and within a segment when
    segment ids are given, for packing). Returns the logits and this sequence's own KV, which the
    sampler's prefill hands to insert.
  * cached decoding (cache=list of per-layer arrays): the new tokens' K/V are written into each
    slot's cache at that slot's position, and queries attend to every cache entry at or before
    their position. Prefill and single decode steps are both this mode.

Learner programs read log-probs, not logits: apply_logprobs and Transformer.token_logprobs run
the LM head in chunks of positions above cfg.chunk_min_vocab (jaxrl.models.logprobs), and
cfg.remat rematerialises each decoder block of a full-sequence forward. Neither changes a value.

Shapes use letters: B batch (or decode slots), T new tokens, S cache length, D embed, N query
heads, K kv heads, G = N // K, H head dim, F mlp, V vocab.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import quant
from jaxrl.models.attention import (Causal, attention, decode_attention, paged_decode_attention,
                                   join_weights, paged_write, pin_rows, rope_matmul,
                                   write_per_head)
from jaxrl.models.config import ModelConfig, RopeScaling
from jaxrl.models.logprobs import chunked_token_logprobs, lm_head

# A KV cache is a (keys, values) pair of [B, K, S, H] arrays per layer, donated and updated in
# place, never restacked (restacking a cache every step made decoding up to 3x slower at batch
# 64). Keys and values are separate arrays because XLA:CPU copies a slice of a stacked
# [2, B, K, S, H] array before each attention dot: at batch 64 on the bench shape, one
# layer's decode attention took 0.81 ms with the stacked array, 0.24 ms with the pair.
KVCache = list[tuple[jax.Array, jax.Array]]


class PagedKV(NamedTuple):
  """One layer's paged KV cache (jaxrl.sampler.paged): keys and values are pools of pages
  [K, N, P, H], and pages_bn [B, n] is each slot's page table (-1: no page), shared by every
  layer. Position p of slot b lives at [:, pages_bn[b, p // P], p % P]. Only the decode step
  (T = 1) takes it."""
  keys: jax.Array
  values: jax.Array
  pages_bn: jax.Array
  # The page each slot's new position goes to, when the caller has it (the engine's decode
  # step, from its page allocation; N or -1: not written); None: read from pages_bn.
  write_b: jax.Array | None = None

def _dtype(name: str):
  return jnp.bfloat16 if name == "bfloat16" else jnp.float32


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
  """Inverse frequencies [H/2] in float32, with Llama-3 scaling when given.

  Llama-3 scaling keeps high frequencies (wavelength < original_max / high_freq_factor),
  divides low frequencies (wavelength > original_max / low_freq_factor) by `factor`, and
  interpolates smoothly in between, as Meta's reference and HF's "llama3" rope_type do.
  """
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  inv_freq = inv_freq.astype(np.float32)
  if scaling is None:
    return inv_freq
  old = scaling.original_max_position
  low_wavelen = old / scaling.low_freq_factor
  high_wavelen = old / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions_bt: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [B, T, 1, H/2] of each position's rotation angles, in float32. A forward
  computes them once and every layer's q and k reuse them (computed per layer, the cos/sin
  took a sixth of a layer's attention time on the bench shape)."""
  freqs = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  return jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]


def rotate(x_btnh: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotates halves (HF's rotate_half convention, not interleaved pairs), in float32."""
  cos, sin = rope
  x = x_btnh.astype(jnp.float32)
  half = x.shape[-1] // 2
  # x * [cos, cos] + [x2, x1] * [-sin, sin]: one elementwise pass (as two half-width products
  # joined by a concatenate, XLA:CPU ran each half as its own kernel).
  if rope_matmul():
    # On TPU (jaxrl.backends.decode_on_matrix_unit) the half-lane slices and their concatenate
    # were fusions of their own; as a product with the permutation matrix (exact: one term of
    # each sum is x * 1, the rest x * 0) XLA fuses the swap into the projections' products.
    perm_hh = np.roll(np.eye(x.shape[-1], dtype=np.float32), half, axis=1)
    swapped = jnp.matmul(x, jnp.asarray(perm_hh), precision=jax.lax.Precision.HIGHEST)
  else:
    swapped = jnp.concatenate([x[..., half:], x[..., :half]], axis=-1)
  out = (x * jnp.concatenate([cos, cos], axis=-1) +
         swapped * jnp.concatenate([-sin, sin], axis=-1))
  return out.astype(x_btnh.dtype)


def apply_rope(x_btnh: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """RoPE of x [B, T, N, H] at the given positions."""
  return rotate(x_btnh, rope_angles(positions_bt, inv_freq))


# ----------------------------------------------------------------------------- layers


def _normal(rngs: nnx.Rngs, shape, fan_in: int, dtype):
  return (jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5).astype(dtype)


def _lora(cfg: ModelConfig, name: str, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.LoRA:
  """The adapter of weight `name` (jaxrl.models.lora): nnx.LoRA over its flattened [in, out]
  shape, A [in, r] with nnx.LoRA's default init, B [r, out] zeros, both float32 whatever the
  base's dtype (an update of lr * grad vanishes against a bf16 weight), with the weight's own
  logical axes on in and out (the rank axis is replicated). dtype is the compute dtype, so
  the adapter's product runs as the base's does."""
  d_in, d_out = cfg.lora_shape(name)
  return nnx.LoRA(d_in, cfg.lora_rank, d_out, dtype=_dtype(cfg.dtype), param_dtype=jnp.float32,
                  rngs=rngs, a_metadata={"axes": (axes[0], None)},
                  b_metadata={"axes": (None, axes[1])})


class _Adapted(nnx.Module):
  """A module whose weights may carry LoRA adapters `<weight>_lora` beside them."""

  def add_lora(self, cfg: ModelConfig, rngs: nnx.Rngs):
    for name in cfg.lora_targets:
      if name in self.LORA_AXES:
        setattr(self, f"{name}_lora", _lora(cfg, name, self.LORA_AXES[name], rngs))

  def quantize_base(self):
    """With model.lora.quantize: each of this module's linear weights as int8 values and a
    `<weight>_scale` of per-output-channel scales beside it (jaxrl.models.quant), quantised
    from the weight just initialised, so the int8 base is quantize(the plain model's)."""
    for name in self.LORA_AXES:
      w = getattr(self, name)
      axes = w.get_metadata()["axes"]
      values, scale = quant.quantize(w[...], in_axes=quant.IN_AXES[name])
      setattr(self, name, nnx.Param(values, axes=axes))
      setattr(self, f"{name}{quant.SCALE}",
              nnx.Param(scale, axes=quant.scale_axes(axes, quant.IN_AXES[name])))

  def weight(self, name: str, dtype):
    """Weight `name` in `dtype`: its own array, or, quantised, its int8 values dequantised to
    model.param_dtype first, so the product is a plain model's over the dequantised weight."""
    w = getattr(self, name)[...]
    scale = getattr(self, f"{name}{quant.SCALE}", None)
    if scale is not None:
      w = quant.dequantize(w, scale[...], _dtype(self.cfg.param_dtype))
    return w.astype(dtype)

  def lora_delta(self, name: str, x_md, key=None):
    """(alpha / r) * dropout(x) @ A @ B for weight `name`'s adapter, in x's dtype; None when it
    has none. x is [M, in]; `key` (the forward's dropout key, None at eval) drops inputs at
    cfg.lora_dropout."""
    lora = getattr(self, f"{name}_lora", None)
    if lora is None:
      return None
    cfg = self.cfg
    if key is not None and cfg.lora_dropout > 0:
      keep = jax.random.bernoulli(jax.random.fold_in(key, _LORA_SALT[name]),
                                  1.0 - cfg.lora_dropout, x_md.shape)
      x_md = jnp.where(keep, x_md / (1.0 - cfg.lora_dropout), 0).astype(x_md.dtype)
    return (lora(x_md) * (cfg.lora_alpha / cfg.lora_rank)).astype(x_md.dtype)

  def adapted(self, name: str, y_mf, x_md, key=None):
    """y (= x @ W, flattened [M, out]) plus weight `name`'s adapter's term, if it has one."""
    delta = self.lora_delta(name, x_md, key)
    return y_mf if delta is None else y_mf + delta


# Each adapter's dropout mask draws from its own fold of the layer's key.
_LORA_SALT = {name: i for i, name in enumerate(("q", "k", "v", "o", "gate", "up", "down"))}


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, param_dtype, axes=("norm",)):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=axes)

  def __call__(self, x):
    # Normalise in float32, cast back, then scale: the order HF uses, so bf16 runs match it.
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


class Attention(_Adapted):

  LORA_AXES = {"q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"),
               "o": ("heads", "embed")}

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = _dtype(cfg.param_dtype)
    self.cfg = cfg
    self.q = nnx.Param(_normal(rngs, (d, n, h), d, pd), axes=("embed", "heads", "head_dim"))
    self.k = nnx.Param(_normal(rngs, (d, k, h), d, pd), axes=("embed", "kv_heads", "head_dim"))
    self.v = nnx.Param(_normal(rngs, (d, k, h), d, pd), axes=("embed", "kv_heads", "head_dim"))
    self.o = nnx.Param(_normal(rngs, (n, h, d), n * h, pd), axes=("heads", "head_dim", "embed"))
    if cfg.qkv_bias:
      self.q_bias = nnx.Param(jnp.zeros((n, h), pd), axes=("heads", "head_dim"))
      self.k_bias = nnx.Param(jnp.zeros((k, h), pd), axes=("kv_heads", "head_dim"))
      self.v_bias = nnx.Param(jnp.zeros((k, h), pd), axes=("kv_heads", "head_dim"))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.norm_eps, pd, axes=("head_dim",))
      self.k_norm = RMSNorm(h, cfg.norm_eps, pd, axes=("head_dim",))

  def __call__(self, x_btd, positions_bt, rope, *, segment_ids_bt=None, cache=None,
               prompt=None, key=None):
    """rope: (cos, sin) of positions_bt, from rope_angles; cache: this layer's (keys, values),
    each [B, K, S, H]. Returns (out [B, T, D], kv): the updated cache, or without one the
    sequence's own (keys, values) [B, K, T, H] (a prefix for the sampler).

    prompt: (keys [P, K, Tp, H], values, valid [P, Tp], row_prompt [B] or None) of P prompts
    that the B rows continue: row b continues prompt row_prompt[b], or with None rows p*G ..
    p*G+G-1 continue prompt p, G = B / P (see Transformer.grouped_hidden): each row attends to
    its prompt's valid positions, then causally to its own (within its segment, with
    segment_ids_bt). key: the LoRA dropout key (None: no dropout)."""
    cfg = self.cfg
    dt = x_btd.dtype
    B, T = positions_bt.shape
    n, kh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # Projections as 2-D matmuls over the B*T rows (free reshapes; see MLP).
    x_md = x_btd.reshape(B * T, -1)
    if T == 1 and B > 1 and join_weights():
      q, k, v = self._fused_qkv(x_md, B)
      q, k, v = (self.adapted(name, y.reshape(B, -1), x_md, key).reshape(y.shape)
                 for name, y in (("q", q), ("k", k), ("v", v)))
    else:
      q = self.adapted("q", self._project("q", x_md), x_md, key)
      k = self.adapted("k", self._project("k", x_md), x_md, key)
      v = self.adapted("v", self._project("v", x_md), x_md, key)
      q, k, v = q.reshape(B, T, n, hd), k.reshape(B, T, kh, hd), v.reshape(B, T, kh, hd)
    if cfg.qkv_bias:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = rotate(q, rope)
    k = rotate(k, rope)

    if cache is None:
      # Full sequence: keys are this sequence's own, causal by index (and by segment), handed
      # back in the cache's layout.
      keys_bksh, values_bksh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
      new_kv = (keys_bksh, values_bksh)
      idx = jnp.arange(T)
      mask_bts = jnp.broadcast_to(idx[None, :, None] >= idx[None, None, :], (B, T, T))
      if segment_ids_bt is not None:
        mask_bts &= segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
      # The same mask by structure, for kernels that take it so (jaxrl.models.attention).
      causal = Causal(segment_ids_bt, segment_ids_bt)
      if prompt is not None:
        prompt_k, prompt_v, valid_ps, row_prompt = prompt
        if row_prompt is None:  # G consecutive rows per prompt
          rows = B // valid_ps.shape[0]
          per_row = lambda x: jnp.repeat(x, rows, axis=0)  # noqa: E731
        else:
          per_row = lambda x: jnp.take(x, row_prompt, axis=0)  # noqa: E731
        keys_bksh = jnp.concatenate([per_row(prompt_k), keys_bksh], axis=2)
        values_bksh = jnp.concatenate([per_row(prompt_v), values_bksh], axis=2)
        valid_bs = per_row(valid_ps)
        valid_bts = jnp.broadcast_to(valid_bs[:, None, :], (B, T, valid_ps.shape[1]))
        mask_bts = jnp.concatenate([valid_bts, mask_bts], axis=2)
        # One segment (1) of the prompt's valid keys and this row's own; padding is 0. Packed
        # rows (Transformer.packed_hidden) have segments below the prompt: every segment sees
        # the prompt's keys, which no pair of segment ids says, so only the dense mask does
        # (the XLA attention path).
        causal = None if segment_ids_bt is not None else Causal(
            jnp.ones((B, T), jnp.int32), jnp.concatenate(
                [valid_bs.astype(jnp.int32), jnp.ones((B, T), jnp.int32)], axis=1))
    elif isinstance(cache, PagedKV):
      if T != 1:
        raise ValueError(f"a paged KV cache takes one token per slot, not {T}")
      return self._decode_paged(q, k, v, positions_bt[:, 0], cache, key)
    elif T == 1:
      return self._decode_one(q, k, v, positions_bt[:, 0], cache, key)
    else:
      # Cached: write at each slot's own start position, then attend to entries <= position.
      start_b = positions_bt[:, 0]
      # vmapped over B, each slot's [K, S, H] takes its [K, T, H] at sequence offset s.
      write = jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=1))
      new_kv = tuple(write(c, x.transpose(0, 2, 1, 3).astype(c.dtype), start_b)
                     for c, x in zip(cache, (k, v)))
      keys_bksh, values_bksh = (c.astype(dt) for c in new_kv)
      S = keys_bksh.shape[2]
      mask_bts = jnp.arange(S)[None, None, :] <= positions_bt[:, :, None]
      causal = None  # by position: only the dense mask says

    out_btkgh = attention(q.reshape(B, T, kh, n // kh, hd), keys_bksh, values_bksh, mask_bts,
                          causal)
    out_mf = out_btkgh.reshape(B * T, n * hd)
    o_fd = self.weight("o", dt).reshape(n * hd, -1)
    return self.adapted("o", out_mf @ o_fd, out_mf, key).reshape(B, T, -1), new_kv

  def _heads_major(self, name: str) -> bool:
    """Whether weight `name` (q, k or v) is stored heads-major, [heads, H, D] (the sampler's
    TPU form, heads_major_projections), rather than [D, heads, H]: told apart by shape, which
    differs unless D, heads and H are all equal (then both forms are read the same way)."""
    w = getattr(self, name)
    heads = self.cfg.num_heads if name == "q" else self.cfg.num_kv_heads
    return (w.shape == (heads, self.cfg.head_dim, self.cfg.embed_dim) and
            w.shape != (self.cfg.embed_dim, heads, self.cfg.head_dim))

  def _weight_dnh(self, name: str, dtype):
    """Weight `name` (q, k or v) as [D, heads, H] in `dtype`, whichever form it is stored in."""
    w = self.weight(name, dtype)
    return w.transpose(2, 0, 1) if self._heads_major(name) else w

  def _project(self, name: str, x_md):
    """x [M, D] times weight `name` (q, k or v): [M, heads * H]. Stored heads-major, the
    weight is read as the product's [heads * H, D] operand with D minor, as it sits."""
    w = self.weight(name, x_md.dtype)
    if self._heads_major(name):
      return jnp.einsum("MD,FD->MF", x_md, w.reshape(-1, w.shape[-1]))
    return x_md @ w.reshape(w.shape[0], -1)

  def _fused_qkv(self, x_md, B):
    """q, k and v of a decode step ([B, 1, ., H]) from one matmul against the three weights
    joined per KV head as [D, K, G + 2, H] (each KV head's G query heads, its key, its value).

    A decode step's matmuls have few rows, so XLA:CPU's per-kernel cost weighs: one product
    instead of three (and one for gate and up, see MLP) took a batch-64 decode step of the bench
    preset from 7.2 to 6.6 ms. The join depends only on the weights, so XLA hoists it out of the
    decode loop: it runs once per jitted call, not per step. Joining along the head-dim side
    of each KV head keeps a tensor-sharded KV-head axis as it is."""
    cfg = self.cfg
    dt = x_md.dtype
    n, kh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    d, g = cfg.embed_dim, n // kh
    w_dkch = jnp.concatenate([self._weight_dnh("q", dt).reshape(d, kh, g, hd),
                              self._weight_dnh("k", dt).reshape(d, kh, 1, hd),
                              self._weight_dnh("v", dt).reshape(d, kh, 1, hd)], axis=2)
    qkv = (x_md @ w_dkch.reshape(d, -1)).reshape(B, 1, kh, g + 2, hd)
    q, k, v = qkv[:, :, :, :g], qkv[:, :, :, g], qkv[:, :, :, g + 1]
    return q.reshape(B, 1, n, hd), k, v

  def _decode_paged(self, q_b1nh, k_b1kh, v_b1kh, pos_b, cache: PagedKV, key=None):
    """_decode_one over a paged cache: the new K/V go to offset pos % P of the slot's page
    pos // P (a slot without that page, or fed a position past its table, writes nothing),
    and attention reads the slot's pages (attention.paged_decode_attention)."""
    cfg = self.cfg
    dt = q_b1nh.dtype
    B = q_b1nh.shape[0]
    _, num_pages, page_size, _ = cache.keys.shape
    n_pages = cache.pages_bn.shape[1]
    if cache.write_b is not None:
      page_b = jnp.where(cache.write_b >= 0, cache.write_b, num_pages)
    else:
      j_b = pos_b // page_size
      page_b = jnp.take_along_axis(cache.pages_bn, jnp.clip(j_b, 0, n_pages - 1)[:, None],
                                   axis=1)[:, 0]
      # An unheld page (-1) or a position past the table goes to page N: the scatter drops it.
      page_b = jnp.where((j_b < n_pages) & (page_b >= 0), page_b, num_pages)
    off_b = pos_b % page_size
    keys, values = (paged_write(c, page_b, off_b, x[:, 0])
                    for c, x in ((cache.keys, k_b1kh), (cache.values, v_b1kh)))
    keys, values = jax.lax.optimization_barrier((keys, values))
    n, kh = cfg.num_heads, cfg.num_kv_heads
    q_bkgh = q_b1nh.reshape(B, kh, n // kh, cfg.head_dim)
    # The pools as stored: a kernel reads them in place (a cast here would copy each whole
    # pool every step); the gather path casts what it gathers.
    out_bkgh = paged_decode_attention(q_bkgh, keys, values, cache.pages_bn, pos_b)
    o_fd = self.weight("o", dt).reshape(n * cfg.head_dim, cfg.embed_dim)
    out_bf = out_bkgh.reshape(B, n * cfg.head_dim)
    out_bd = self.adapted("o", out_bf @ o_fd, out_bf, key)
    return out_bd[:, None], PagedKV(keys, values, cache.pages_bn)

  def _decode_one(self, q_b1nh, k_b1kh, v_b1kh, pos_b, cache, key=None):
    """One new token per slot (the sampler's decode step), same result as the general path.

    Written for XLA:CPU, where the cache traffic dominates a decode step. Each write is one
    scatter of B rows, in place on the donated cache. Keys and values are [B, K, S, H], so
    each (slot, KV head) pair's keys are one contiguous [S, H] matrix, and both attention
    products are batched matmuls over (B, K) that read the cache as stored. (With a
    [2, B, S, K, H] layout the dots first transposed the cache; measured at batch 64 on the
    bench shape, attention took 1.6x longer.)
    """
    cfg = self.cfg
    dt = q_b1nh.dtype
    B = q_b1nh.shape[0]
    # Slot b's [K, H] goes to position pos_b[b] of its own [K, S, H]: one scatter with the slot
    # as a batching dimension, so that a mesh sharding the slots partitions it without
    # communication (written as c.at[arange(B), :, pos_b], the SPMD partitioner added two
    # all-gathers per write, 24 per decode step of the bench preset, each a round trip between
    # processes on a multi-host mesh). A position past the cache's end writes nothing (the
    # sampler feeds one to a slot that is not generating, so that its cache stays as it was).
    new_kv = tuple(_write_positions(c, x[:, 0].astype(c.dtype), pos_b, write_per_head())
                   for c, x in zip(cache, (k_b1kh, v_b1kh)))
    # The barrier keeps each write one in-place update that attention then reads. Without it,
    # at batch 1 XLA duplicated the write into both consumers and copied every cache array
    # three times per step (61 copies in the decode loop's body; 13 with the barrier).
    new_kv = jax.lax.optimization_barrier(new_kv)
    keys_bksh, values_bksh = (c.astype(dt) for c in new_kv)
    n, kh = cfg.num_heads, cfg.num_kv_heads
    q_bkgh = q_b1nh.reshape(B, kh, n // kh, cfg.head_dim)
    out_bkgh = decode_attention(q_bkgh, keys_bksh, values_bksh, pos_b)
    # As one [B, N*H] x [N*H, D] matmul over row-major reshapes (free): written as the general
    # path's einsum, XLA:CPU transposed the whole o weight every decode step.
    o_fd = self.weight("o", dt).reshape(n * cfg.head_dim, cfg.embed_dim)
    out_bf = out_bkgh.reshape(B, n * cfg.head_dim)
    out_bd = self.adapted("o", out_bf @ o_fd, out_bf, key)
    return out_bd[:, None], new_kv


# The attention weights a TPU decode step reads heads-major (heads_major_projections).
HEADS_MAJOR = ("q", "k", "v")


def heads_major_projections(params):
  """The sampler's TPU form of a model's params (as nnx.split gives them, or a pure dict):
  each layer's q, k and v weights [D, heads, H] stored heads-major, [heads, H, D], the layout
  of the o weight, which a decode step's product reads as it sits (D minor). Stored
  [D, heads, H], XLA:TPU copied the q, k and v weights of every layer into that layout on
  every decode step (Qwen3-0.6B on v5e:2x4, batch 64: 94 us of a 1.77 ms step), and a
  transpose made inside the decode program was no better (its result read from HBM by slower
  products). So the transpose is made once per weight sync (Engine.decode_params). The model
  reads either form (Attention._heads_major) and computes the same values. Quantised weights
  (int8 values beside their scales) are left as they are."""

  return jax.tree_util.tree_map_with_path(
      lambda path, x: to_heads_major(x) if is_projection(path, x) else x, params)


def is_projection(path, x) -> bool:
  """Whether the leaf at `path` of a params tree is a layer's q, k or v weight stored
  [D, heads, H] in a float dtype (what heads_major_projections transposes)."""
  keys = [getattr(k, "key", None) for k in path]
  if len(keys) > 1 and keys[0] == "layers" and not isinstance(keys[1], int):
    keys.insert(1, None)  # scanned (model.scan_layers): [L, D, heads, H], no layer index
  return (len(keys) >= 4 and keys[0] == "layers" and keys[2] == "attn" and keys[3] in HEADS_MAJOR
          and x.ndim == 3 + (keys[1] is None) and jnp.issubdtype(x.dtype, jnp.floating))


def to_heads_major(w_dnh):
  """[D, heads, H] -> [heads, H, D] (stacked [L, D, heads, H] -> [L, heads, H, D])."""
  lead = tuple(range(w_dnh.ndim - 3))
  return jnp.transpose(w_dnh, (*lead, *(n + len(lead) for n in (1, 2, 0))))


def _write_positions(cache_bksh, new_bkh, pos_b, per_head: bool = False):
  """cache_bksh with new_bkh[b] at [b, :, pos_b[b]]; out-of-range positions are dropped.
  `per_head`: one row of H per (slot, KV head), the heads a batching dimension too (the TPU's
  form, jaxrl.backends.writes_cache_per_head); else one [K, H] window per slot."""
  batching, idx = (0,), pos_b[:, None]
  if per_head:
    batching, idx = (0, 1), jnp.broadcast_to(pos_b[:, None, None], (*new_bkh.shape[:2], 1))
  dims = jax.lax.ScatterDimensionNumbers(
      update_window_dims=tuple(range(len(batching), 3)), inserted_window_dims=(2,),
      scatter_dims_to_operand_dims=(2,), operand_batching_dims=batching,
      scatter_indices_batching_dims=batching)
  return jax.lax.scatter(cache_bksh, idx, new_bkh, dims,
                         mode=jax.lax.GatherScatterMode.FILL_OR_DROP, indices_are_sorted=True,
                         unique_indices=True)


class MLP(_Adapted):

  LORA_AXES = {"gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed")}

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.embed_dim, cfg.mlp_dim
    pd = _dtype(cfg.param_dtype)
    self.cfg = cfg
    self.gate = nnx.Param(_normal(rngs, (d, f), d, pd), axes=("embed", "mlp"))
    self.up = nnx.Param(_normal(rngs, (d, f), d, pd), axes=("embed", "mlp"))
    self.down = nnx.Param(_normal(rngs, (f, d), f, pd), axes=("mlp", "embed"))

  def __call__(self, x_btd, key=None):
    # As 2-D matmuls over the B*T rows (a free reshape). Written as [B, T, D] einsums, XLA:CPU
    # fused silu into a batched dot whose backward ran at half speed: measured on the bench
    # shape (5120 rows), one MLP's forward + backward took 188 ms as einsums, 94 ms as this.
    dt = x_btd.dtype
    x_md = x_btd.reshape(-1, x_btd.shape[-1])
    B, T = x_btd.shape[:2]
    if T == 1 and B > 1 and join_weights():
      # A decode step on CPU: gate and up as one product against the weights stacked [D, 2, F]
      # (see Attention._fused_qkv; the stack is hoisted out of the decode loop, and a
      # tensor-sharded F axis stays as it is). XLA:TPU did not hoist it out of the decode scan:
      # it stacked the weights again every step (jaxrl.backends.joins_decode_weights).
      w_dcf = jnp.stack([self.weight("gate", dt), self.weight("up", dt)], axis=1)
      gu_mcf = jnp.einsum("MD,DCF->MCF", x_md, w_dcf)
      g_mf, u_mf = gu_mcf[:, 0], gu_mcf[:, 1]
    else:
      g_mf = x_md @ self.weight("gate", dt)
      u_mf = x_md @ self.weight("up", dt)
    g_mf = self.adapted("gate", g_mf, x_md, key)
    u_mf = self.adapted("up", u_mf, x_md, key)
    h_mf = swiglu(g_mf, u_mf)
    out_md = self.adapted("down", h_mf @ self.weight("down", dt), h_mf, key)
    return out_md.reshape(x_btd.shape)


@jax.custom_vjp
def swiglu(g, u):
  """silu(g) * u, with a hand-written backward: one pass over (dh, g, u) that recomputes
  sigmoid(g), instead of autodiff's chain of separately materialised products (on the bench
  shape XLA:CPU left several of them as unfused [rows, mlp] kernels)."""
  return jax.nn.silu(g) * u


def _swiglu_fwd(g, u):
  return swiglu(g, u), (g, u)


def _swiglu_bwd(res, dh):
  g, u = res
  sig = jax.nn.sigmoid(g)
  dg = dh * u * sig * (1 + g * (1 - sig))
  return dg.astype(g.dtype), (dh * g * sig).astype(u.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    pd = _dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pd)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pd)
    self.mlp = MLP(cfg, rngs)

  def adapt(self, cfg: ModelConfig, lora_rngs: nnx.Rngs | None):
    """LoRA adapters (cfg.lora_rank) drawn from lora_rngs, then the int8 base
    (cfg.lora_quantize), on this block just initialised."""
    for part in (self.attn, self.mlp):
      if cfg.lora_rank:
        part.add_lora(cfg, lora_rngs)
      if cfg.lora_quantize:
        part.quantize_base()

  def __call__(self, x, positions, rope, *, segment_ids=None, cache=None, prompt=None,
               key=None):
    """key: this layer's LoRA dropout key (None: no dropout)."""
    attn_key, mlp_key = (None, None) if key is None else jax.random.split(key)
    h, kv = self.attn(self.attn_norm(x), positions, rope, segment_ids_bt=segment_ids,
                      cache=cache, prompt=prompt, key=attn_key)
    x = x + h
    return x + self.mlp(self.mlp_norm(x), key=mlp_key), kv


# model.remat -> the jax.checkpoint policy of each decoder block (config.REMAT says what each
# keeps). "full" is policy None: nothing inside a block is saved, only its input.
REMAT_POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _remat(fn, cfg: ModelConfig):
  """fn(layer, ...) rematerialised under model.remat's policy; fn itself for "none". (Inside
  a scan's body XLA cannot merge the recomputation with the forward, so prevent_cse, which
  costs optimisation barriers, is only asked of unrolled layers.)"""
  if cfg.remat == "none":
    return fn
  return nnx.remat(fn, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)


# See first_layers. A context variable, so another thread tracing a program meanwhile (the
# async producer's, say) always sees every block.
_TRACED_LAYERS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "jaxrl_traced_layers", default=None)


@contextlib.contextmanager
def first_layers(n: int):
  """Full-sequence forwards traced inside run only their first n blocks (the later blocks'
  parameters are left unread), in this thread. For the memory plan alone
  (jaxrl.parallel.plan.residual_bytes): every block's backward residuals are the same, so
  tracing one and two blocks gives what the whole model's vjp keeps at a fraction of the
  tracing time. The cached decode path ignores it."""
  token = _TRACED_LAYERS.set(n)
  try:
    yield
  finally:
    _TRACED_LAYERS.reset(token)


def _call_block(layer, x, positions, rope, segment_ids, cache, key=None):
  return layer(x, positions, rope, segment_ids=segment_ids, cache=cache, key=key)


def _layer_key(key, i: int):
  """Layer i's LoRA dropout key; None stays None (no dropout)."""
  return None if key is None else jax.random.fold_in(key, i)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
  """The decoder's layers under cfg.scan_layers: one Block whose every variable has a leading
  [num_layers] axis (logical axis "layers"), initialised by one vmapped init, each layer from
  keys of its own (so the init traces one block, not num_layers)."""
  keys, lora_keys = (jax.random.split(rngs.params(), cfg.num_layers) for _ in range(2))
  graphdefs = []

  def one(key, lora_key):
    block = Block(cfg, nnx.Rngs(params=key))
    block.adapt(cfg, nnx.Rngs(params=lora_key))
    graphdef, state = nnx.split(block)
    graphdefs.append(graphdef)
    return state

  state = jax.vmap(one)(keys, lora_keys)
  state = jax.tree.map(lambda v: v.replace(axes=("layers", *v.get_metadata()["axes"])), state,
                       is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdefs[0], state)


def _layer(graphdef, state, i: int):
  """Layer i of a stacked block (nnx.split of it): its slice of every variable."""
  return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


class Transformer(nnx.Module):
  """Decoder-only transformer. `__call__` returns (logits [B,T,V] float32, kv)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = _dtype(cfg.param_dtype)
    # std 0.02 keeps tied-embedding logits near zero at init (uniform first predictions).
    self.embed = nnx.Param(
        (jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.embed_dim)) * 0.02).astype(pd),
        axes=("vocab", "embed"))
    if cfg.scan_layers:
      self.layers = _stacked_blocks(cfg, rngs)
    else:
      self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pd)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Param(_normal(rngs, (cfg.embed_dim, cfg.vocab_size), cfg.embed_dim, pd),
                               axes=("embed", "vocab"))
    if not cfg.scan_layers:
      # Adapters last, from one key of their own, so the base weights' init is the same with
      # LoRA on or off (a LoRA run starts from the base a plain run would).
      lora_rngs = nnx.Rngs(params=rngs.params()) if cfg.lora_rank else None
      for layer in self.layers:
        layer.adapt(cfg, lora_rngs)

  def hidden(self, tokens_bt, positions_bt=None, *, segment_ids_bt=None,
             cache: KVCache | None = None, dropout_key=None):
    """Final-normed hidden states [B, T, D] and the KV (the prefix's, or the updated cache).
    dropout_key: the LoRA dropout's key (training only; None, the default, drops nothing)."""
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    rope = self._rope(positions_bt)
    x = pin_rows(self._embed(tokens_bt))
    # Remat wraps the full-sequence forward only: the learner's programs differentiate it, and
    # forward-only programs (prefill, the reference) lower it unchanged; decoding never sees it.
    block = _call_block if cache is not None else _remat(_call_block, self.cfg)

    def step(layer, x, i, layer_cache):
      x, kv = block(layer, x, positions_bt, rope, segment_ids_bt, layer_cache,
                    _layer_key(dropout_key, i))
      return pin_rows(x), kv

    x, new_cache = self._decoder(step, x, cache)
    return self.final_norm(x), new_cache

  def grouped_hidden(self, prompt_pt, prompt_len_p, completion_nt, *, dropout_key=None):
    """Hidden states that predict the completions' tokens, for G = N / P completions per
    prompt, computing each prompt once instead of G times (a GRPO group's shared prompt).

    prompt_pt [P, Tp] right-padded, prompt_len_p [P] real lengths, completion_nt [N, Tc]
    with rows p*G .. p*G+G-1 continuing prompt p at position prompt_len_p[p]. Returns
    h [N, Tc, D] final-normed, where h[n, t] predicts completion_nt[n, t]: index 0 is the
    prompt's last real position, index t > 0 the completion's position t - 1. The same values
    as the full forward over each joined, unpadded prompt + completion. dropout_key: as in
    hidden (the prompt's pass and its completions' draw separate masks).
    """
    (P, _), (N, Tc) = prompt_pt.shape, completion_nt.shape
    # The completions' last token predicts nothing here: only tokens 0 .. Tc-2 are run.
    offsets = jnp.broadcast_to(jnp.arange(Tc - 1), (N, Tc - 1))
    last_p, x_n = self._below_prompts(prompt_pt, prompt_len_p, completion_nt[:, :-1], offsets,
                                      None, dropout_key)
    h = jnp.concatenate([jnp.repeat(last_p[:, None], N // P, axis=0), x_n], axis=1)
    return self.final_norm(h)

  def packed_hidden(self, prompt_pt, prompt_len_p, tokens_rw, offsets_rw, segments_rw,
                    row_prompt_r, *, dropout_key=None):
    """grouped_hidden with the completions packed into R rows of W positions, one after
    another (jaxrl.algorithms.grpo.batch.pack_completions builds them): row r holds completions
    of prompt row_prompt_r[r] only. tokens_rw are the completions' input tokens (a completion
    of L tokens runs its tokens 0 .. L-2), offsets_rw each token's index in its completion,
    segments_rw a per-row id of its completion (>= 1) and 0 on padding: a token attends to its
    prompt's valid positions and causally to its own completion's tokens, never another's.

    Returns (h_last [P, D], h [R, W, D]), final-normed: h_last is each prompt's last real
    position, which predicts its completions' token 0; h[r, w] predicts token offsets_rw[r, w]
    + 1 of its completion. The values grouped_hidden gives the same tokens, in fewer positions
    when completion lengths vary (a long tail pads every row to the longest)."""
    last_p, x_r = self._below_prompts(prompt_pt, prompt_len_p, tokens_rw, offsets_rw,
                                      segments_rw, dropout_key, row_prompt_r)
    return self.final_norm(last_p), self.final_norm(x_r)

  def _below_prompts(self, prompt_pt, prompt_len_p, tokens_bt, offsets_bt, segments_bt,
                     dropout_key, row_prompt_b=None):
    """The decoder over P prompts (each once) and B rows below them, row b continuing prompt
    row_prompt_b[b] (None: rows p*G .. p*G+G-1 continue prompt p, G = B / P), a row's token
    at position (its prompt's length) + offsets_bt: (the prompts' last real positions [P, D],
    the rows [B, T, D]), not final-normed. segments_bt: None (one completion per row), else as
    packed_hidden."""
    P, Tp = prompt_pt.shape
    if row_prompt_b is None:
      start_b = jnp.repeat(prompt_len_p, tokens_bt.shape[0] // P)
    else:
      start_b = jnp.take(prompt_len_p, row_prompt_b)
    pos_p = jnp.broadcast_to(jnp.arange(Tp), (P, Tp))
    pos_n = start_b[:, None] + offsets_bt
    rope_p, rope_n = self._rope(pos_p), self._rope(pos_n)
    valid_ps = jnp.arange(Tp)[None, :] < prompt_len_p[:, None]
    x_p, x_n = pin_rows(self._embed(prompt_pt)), pin_rows(self._embed(tokens_bt))
    def both(layer, x_p, x_n, key):
      # The prompt's own pass first (its padding comes after every real token, so it never
      # reaches a real position), then the rows attend to its valid keys.
      key_p, key_n = (None, None) if key is None else jax.random.split(key)
      x_p, kv_p = layer(x_p, pos_p, rope_p, key=key_p)
      x_n, _ = layer(x_n, pos_n, rope_n, segment_ids=segments_bt,
                     prompt=(*kv_p, valid_ps, row_prompt_b), key=key_n)
      return x_p, x_n

    both = _remat(both, self.cfg)

    def step(layer, x, i, _):
      x_p, x_n = both(layer, *x, _layer_key(dropout_key, i))
      return (pin_rows(x_p), pin_rows(x_n)), None

    (x_p, x_n), _ = self._decoder(step, (x_p, x_n))
    last_p = jnp.take_along_axis(x_p, (prompt_len_p - 1)[:, None, None], axis=1)[:, 0]
    return last_p, x_n

  def _decoder(self, step, carry, cache: KVCache | None = None):
    """carry, kv = step(layer, carry, i, cache[i] or None) over the decoder's layers in order:
    (the last carry, [kv of each layer]). A full-sequence forward of a scanned model
    (cfg.scan_layers) is one jax.lax.scan over the stacked block, traced and compiled once
    whatever the depth. The rest run one layer after another: unrolled models, cached
    forwards (the sampler's KV cache stays a list of per-layer arrays, see KVCache: each
    layer reads its slice of the stacked parameters) and first_layers' traces."""
    n, cfg = _TRACED_LAYERS.get(), self.cfg
    depth = cfg.num_layers if n is None or cache is not None else min(n, cfg.num_layers)
    if not cfg.scan_layers:
      layers = list(self.layers)[:depth]
    else:
      graphdef, state = nnx.split(self.layers)
      if cache is None and n is None:
        body = lambda c, xs: step(nnx.merge(graphdef, xs[1]), c, xs[0], None)
        carry, kv = jax.lax.scan(body, carry, (jnp.arange(depth), state))
        return carry, [jax.tree.map(lambda a, i=i: a[i], kv) for i in range(depth)]
      layers = [_layer(graphdef, state, i) for i in range(depth)]
    out = []
    for i, layer in enumerate(layers):
      carry, kv = step(layer, carry, i, None if cache is None else cache[i])
      out.append(kv)
    return carry, out

  def _embed(self, tokens_bt):
    return jnp.take(self.embed[...], tokens_bt, axis=0).astype(_dtype(self.cfg.dtype))

  def _rope(self, positions_bt):
    cfg = self.cfg
    return rope_angles(positions_bt, jnp.asarray(
        rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)))

  def logits(self, h_btd):
    """Logits [B, T, V] in float32; the matmul accumulates in float32 whatever the compute
    dtype (jaxrl.models.logprobs.lm_head)."""
    return lm_head(h_btd, self._head(), tied=self.cfg.tie_embeddings)

  def _head(self):
    """The LM head's weight: the embedding [V, D] when tied, else lm_head [D, V]."""
    return self.embed[...] if self.cfg.tie_embeddings else self.lm_head[...]

  def token_logprobs(self, h_btd, targets_bt, *, temperature: float = 1.0,
                     entropy: bool = True):
    """(log pi(target) [B, T], entropy [B, T] or None) of final-normed hidden states: what
    every learner program reads. With cfg.chunked_logits the LM head runs over chunks of
    cfg.logits_chunk positions (jaxrl.models.logprobs), so no [B, T, V] logits are live;
    otherwise it is token_logprobs(self.logits(h)), as it always was. entropy=False skips the
    entropy where it costs a pass (the chunked path); unchunked, XLA drops the unread value."""
    cfg = self.cfg
    if cfg.chunked_logits:
      return chunked_token_logprobs(h_btd, self._head(), targets_bt, tied=cfg.tie_embeddings,
                                    temperature=temperature, chunk=cfg.logits_chunk,
                                    entropy=entropy)
    logp_bt, ent_bt = token_logprobs(self.logits(h_btd), targets_bt, temperature=temperature)
    return logp_bt, ent_bt if entropy else None

  def __call__(self, tokens_bt, positions_bt=None, *, segment_ids_bt=None,
               cache: KVCache | None = None):
    h, kv = self.hidden(tokens_bt, positions_bt, segment_ids_bt=segment_ids_bt, cache=cache)
    return self.logits(h), kv


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
  """An empty KV cache: a (keys, values) pair of [B, K, S, H] arrays per layer (unsharded;
  see parallel.cache_sharding)."""
  dt = _dtype(cfg.dtype) if dtype is None else dtype
  shape = cache_shape(cfg, batch, max_len)
  return [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_layers)]


def cache_shape(cfg: ModelConfig, batch: int, max_len: int) -> tuple[int, ...]:
  """One of a layer's two KV-cache arrays: B slots x K heads x S positions x H."""
  return (batch, cfg.num_kv_heads, max_len, cfg.head_dim)


CACHE_AXES = ("cache_batch", "kv_heads", "cache_seq", "head_dim")


def token_logprobs(logits_btv, targets_bt, *, temperature: float = 1.0):
  """Per-token log pi(target) and entropy [B, T], from logits scaled by 1/temperature.

  This is the quantity the sampler returns (before top-k/top-p truncation), so importance
  ratios between the learner and the sampler compare like with like.
  """
  logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
  logp_bt = jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
  entropy_bt = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
  return logp_bt, entropy_bt


def apply(graphdef, params, tokens_bt, positions_bt=None, *, segment_ids_bt=None,
          cache: KVCache | None = None):
  """Pure forward over nnx.split state: (logits [B,T,V] float32, kv). Jit this, not the module:
  merging costs only trace time, while nnx.jit costs ~4 ms per call on CPU."""
  model = nnx.merge(graphdef, params)
  return model(tokens_bt, positions_bt, segment_ids_bt=segment_ids_bt, cache=cache)


def apply_logprobs(graphdef, params, tokens_bt, targets_bt, positions_bt=None, *,
                   segment_ids_bt=None, temperature: float = 1.0, entropy: bool = True,
                   dropout_key=None):
  """Pure full-sequence forward to (log pi(target) [B, T], entropy [B, T] or None): the
  learners' forward (Transformer.token_logprobs; chunked above cfg.chunk_min_vocab).
  dropout_key: the LoRA dropout's key in a train step (None: no dropout)."""
  model = nnx.merge(graphdef, params)
  h_btd, _ = model.hidden(tokens_bt, positions_bt, segment_ids_bt=segment_ids_bt,
                          dropout_key=dropout_key)
  return model.token_logprobs(h_btd, targets_bt, temperature=temperature, entropy=entropy)


def stack_layers(params):
  """Params of the unrolled model (a pure dict: "layers" maps 0 .. L-1 to each layer's tree)
  as the scanned model's (cfg.scan_layers: "layers" holds one tree, each leaf [L, ...]), at
  any depth (a reward model's "backbone" included). unstack_layers undoes it."""
  def walk(t):
    if not isinstance(t, dict):
      return t
    out = {}
    for k, v in t.items():
      if k == "layers" and isinstance(v, dict) and v and all(isinstance(i, int) for i in v):
        out[k] = jax.tree.map(lambda *xs: jnp.stack(xs), *(v[i] for i in range(len(v))))
      else:
        out[k] = walk(v)
    return out
  return walk(params)


def unstack_layers(params, num_layers: int):
  """The scanned model's params (stack_layers) as the unrolled model's: each layer's slice."""
  def walk(t):
    if not isinstance(t, dict):
      return t
    return {k: ({i: jax.tree.map(lambda x, i=i: x[i], v) for i in range(num_layers)}
                if k == "layers" and not all(isinstance(i, int) for i in v) else walk(v))
            for k, v in t.items()}
  return walk(params)


def is_stacked(path: tuple) -> bool:
  """Whether a params path (keys as a tuple) is a scanned model's stacked layer leaf,
  ("layers", "attn", "q") [L, ...], rather than one layer's ("layers", 0, "attn", "q")."""
  return len(path) > 1 and path[0] == "layers" and not isinstance(path[1], int)


def per_layer(flat: dict, num_layers: int) -> dict:
  """{path: array} with each stacked layer leaf split into one entry per layer, the paths the
  checkpoint formats (HF, PEFT) name layer by layer. Other entries stay as they are."""
  out = {}
  for path, x in flat.items():
    if is_stacked(path):
      out.update({("layers", i, *path[1:]): x[i] for i in range(num_layers)})
    else:
      out[path] = x
  return out


def _nest(pairs):
  out: dict = {}
  for path, value in pairs:
    d = out
    for k in path[:-1]:
      d = d.setdefault(k, {})
    d[path[-1]] = value
  return out


def abstract_model(cfg: ModelConfig, model=None):
  """(graphdef, shapes, axes) without allocating: shapes is a nested dict of ShapeDtypeStruct,
  axes the same tree holding each parameter's tuple of logical axis names. `model` is the
  module class built from (cfg, rngs=...): the Transformer by default, or e.g. RewardModel.
  Each call gets its own dicts; the tracing behind them is cached per (cfg, model)."""
  graphdef, flat = _abstract_flat(cfg, Transformer if model is None else model)
  return graphdef, _nest((p, v) for p, v, _ in flat), _nest((p, a) for p, _, a in flat)


@functools.lru_cache(maxsize=16)
def _abstract_flat(cfg: ModelConfig, build):
  """(graphdef, ((path, ShapeDtypeStruct, axes), ...)) of build(cfg): a real-size plan asks
  for the same model 6-10 times, and each trace of a 36-block init takes seconds."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0))))
  return graphdef, tuple((p, v.get_value(), v.get_metadata()["axes"])
                         for p, v in nnx.to_flat_state(state))
