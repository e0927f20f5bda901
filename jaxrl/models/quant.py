"""The frozen base of a QLoRA run in int8: per-output-channel scales, dequantised in the forward.

With model.lora.quantize="int8" (ModelConfig.lora_quantize; LoRA on) every linear weight of
the decoder (q, k, v, o, gate, up, down, adapted or not) is held as int8 values with a float32
scale per output channel beside it, `<weight>_scale` (a parameter path reads
`layers/<i>/attn/q_scale`). The embedding, the LM head and the norms stay in the param
dtype, as bitsandbytes' QLoRA leaves them. The forward computes

    W = dequantize(q, scale) = (float32(q) * scale) cast to model.param_dtype

and uses W as a plain model uses its weight (jaxrl.models.llama `_Adapted.weight`), so a
QLoRA model with its adapters off computes exactly what a plain model of the dequantised
weights does (`dequantized_base`), bit for bit. The adapters stay float32 and are the only
thing that trains (the int8 leaves are part of the frozen base: no gradient, no optimizer
state), and the reference, the base with adapters off, is this same int8 tree.

Why qwix for the numerics, and not its model rewriting: `qwix.quantize` (absmax calibration
over the reduced axes, round-to-nearest into int8, a zero-safe scale) and `qwix.dequantize`
are pure functions of arrays, the kept library Tunix's QLoRA uses, and they open int4 / fp8
later by their qtype. qwix's model-level API (`quantize_model` with a `PtqProvider` or
`LoraProvider(weight_qtype=...)`) intercepts the dot_generals and einsums inside nnx modules
and swaps the modules' params for its QArray; jaxrl's forward runs over pure dict params through
its own products (weights reshaped and cast before the matmul, fused q/k/v and gate/up decode
products, the chunked LM head), its LoRA adapters are nnx.LoRA modules found by path, and its
layouts, memory plan and checkpoints read the param tree's leaves and logical axes. So the
QArray's two arrays are stored as two ordinary leaves with their own logical axes, sharded by
the same rules, and the forward dequantises them to the param dtype before each product (an
int8 x bf16 mixed product was not tried).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import qwix

SCALE = "_scale"
# The weights quantised, with the number of their leading axes that are input axes (the rest
# are output channels, each with its own scale): q, k, v [D, ., H]; o [N, H, D]; gate, up
# [D, F]; down [F, D].
IN_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def quantize(w, *, in_axes: int, qtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
  """(values in qtype [w's shape], float32 scales [1 x in_axes, out...]) of a weight, one
  scale per output channel: scale = max |w| over the input axes / 127, values =
  round(w / scale), so |dequantize(values, scale) - w| <= scale / 2 elementwise in float32."""
  # qwix maps max |w| to qmax + 0.5 (127.5), so the largest weight rounds to 128 and relies on
  # the int8 conversion saturating; scaling its absmax by 127.5 / 127 puts it at 127 exactly:
  # the values stay in [-127, 127] (symmetric, no overflow) at the same half-step error.
  bound = float(jnp.iinfo(qtype).max)
  qa = qwix.quantize(w.astype(jnp.float32), qtype,
                     channelwise_axes=tuple(range(in_axes, w.ndim)), scale_dtype=jnp.float32,
                     calibration_method=f"absmax,{(bound + 0.5) / bound!r}")
  return qa.qvalue, qa.scale


def dequantize(values, scale, dtype) -> jax.Array:
  """float32(values) * scale, cast to `dtype` (the model's param dtype): the weight the forward
  uses in place of a quantised one."""
  qa = qwix.QArray(values, scale.astype(jnp.float32), None, values.dtype)
  return qwix.dequantize(qa).astype(dtype)


def scale_axes(axes: tuple, in_axes: int) -> tuple:
  """The logical axes of a weight's scales: None (size 1) on the input axes, the weight's own
  on the output axes, so the scales shard as their channels do."""
  return (None,) * in_axes + tuple(axes[in_axes:])


def quantize_params(cfg, params) -> dict:
  """A plain (or LoRA, unquantised) param tree in the quantised structure of `cfg`: every
  weight of IN_AXES inside the decoder's layers replaced by its int8 values, its scales put
  beside it as `<weight>_scale`. Everything else (adapters, norms, embeddings) is the tree's
  own array. Used where a base arrives in plain form: a Hugging Face checkpoint, a plain or
  LoRA run's checkpoint."""
  if not cfg.lora_quantize:
    return params

  def walk(node, in_layers, stacked):
    out = {}
    for k, v in node.items():
      if isinstance(v, dict):
        top = str(k) == "layers"  # scanned (model.scan_layers): one tree of [L, ...] leaves
        out[k] = walk(v, in_layers or top, stacked or (top and not isinstance(next(iter(v)), int)))
      elif in_layers and str(k) in IN_AXES and not jnp.issubdtype(v.dtype, jnp.integer):
        one = functools.partial(quantize, in_axes=IN_AXES[str(k)])
        out[k], out[f"{k}{SCALE}"] = (jax.vmap(one) if stacked else one)(v)
      else:
        out[k] = v
    return out
  return walk(params, False, False)


def dequantized_base(cfg, params) -> dict:
  """The params with every quantised weight replaced by its dequantised array in
  model.param_dtype and the scales dropped: adapters and all else as they are. A model of
  cfg.replace(lora_quantize="") over it computes what the quantised one does, bit for bit."""
  pd = jnp.bfloat16 if cfg.param_dtype == "bfloat16" else jnp.float32

  def walk(node):
    out = {}
    for k, v in node.items():
      if is_scale_key(node, k):
        continue
      if isinstance(v, dict):
        out[k] = walk(v)
        continue
      scale = node.get(f"{k}{SCALE}")
      out[k] = v if scale is None else dequantize(v, scale, pd)
    return out
  return walk(params)


def is_scale_key(node: dict, k) -> bool:
  """Whether key k of a params dict is a quantised weight's scales (not RMSNorm's `scale`)."""
  k = str(k)
  return k.endswith(SCALE) and k[:-len(SCALE)] in node
