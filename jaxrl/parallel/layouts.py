"""Layouts: rule sets that map logical axis names to mesh axes, and what follows from them.

Two layouts share one mesh:
  * learner: FSDP over data x fsdp on the embed dimension, tensor parallelism on `tensor`
    (heads, mlp, vocab). Used for training and for scoring.
  * sampler: tensor parallelism inside a replica; parameters replicated over data and fsdp,
    which both act as replica axes; the KV cache is sharded by slot over data x fsdp and by KV
    head over tensor.

A dimension whose size its mesh axes do not divide is replicated, and the parameter table marks
it; query heads are the exception, since an uneven head split is a config mistake.
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl.errors import ConfigError, check_choice
from jaxrl.models import CACHE_AXES, ModelConfig, Transformer, abstract_model, cache_shape
from jaxrl.models import attention

Rule = str | tuple[str, ...] | None

_TP = {"vocab": "tensor", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
       "head_dim": None, "norm": None, "layers": None}
LAYOUTS: dict[str, dict[str, Rule]] = {
    "learner": {**_TP, "embed": ("data", "fsdp"), "batch": ("data", "fsdp"),
                "cache_batch": ("data", "fsdp"), "cache_seq": None},
    "sampler": {**_TP, "embed": None, "batch": ("data", "fsdp"),
                "cache_batch": ("data", "fsdp"), "cache_seq": None},
}

# Logical names whose uneven split is an error: (what, which mesh size, the key that fixes it).
_MUST_DIVIDE = {
    "heads": ("model.num_heads", "the tensor-parallel size", "mesh.tensor"),
    "cache_batch": ("the number of decode slots", "the replica count data x fsdp",
                    "mesh.data/mesh.fsdp (or the slot count)"),
}


def get_rules(layout: str) -> dict[str, Rule]:
  return LAYOUTS[check_choice("layout", layout, LAYOUTS)]


def logical_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], rules: dict[str, Rule],
                 mesh: Mesh, *, name: str = "") -> tuple[P, list[str]]:
  """PartitionSpec for one array, and notes on dimensions replicated because uneven."""
  spec, notes, used = [], [], set()
  for size, logical in zip(shape, axes):
    rule = rules.get(logical) if logical is not None else None
    mesh_axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
    mesh_axes = tuple(a for a in mesh_axes if a not in used)
    ways = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
    if ways > 1 and size % ways:
      if logical in _MUST_DIVIDE:
        what, which, key = _MUST_DIVIDE[logical]
        raise ConfigError(f"{what}={size} is not divisible by {which} {ways}: choose "
                          f"{key} so that it divides {size}.")
      notes.append(f"{name}: {logical}={size} not divisible by {'x'.join(mesh_axes)}={ways}, "
                   "replicated")
      mesh_axes = ()
    used.update(mesh_axes)
    spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec), notes


def _path_name(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def tree_shardings(shapes, axes, mesh: Mesh, layout: str):
  """NamedShardings for a tree of arrays (or ShapeDtypeStructs) given its logical-axes tree."""
  rules = get_rules(layout)

  def one(path, x, ax):
    spec, _ = logical_spec(ax, x.shape, rules, mesh, name=_path_name(path))
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, shapes, axes)


def param_shardings(cfg: ModelConfig, mesh: Mesh, layout: str):
  _, shapes, axes = abstract_model(cfg)
  return tree_shardings(shapes, axes, mesh, layout)


def init_params(cfg: ModelConfig, mesh: Mesh, layout: str = "learner", *, seed: int = 0):
  """(graphdef, params): parameters born sharded. The shapes come from eval_shape; the init runs
  under jit with out_shardings, so each device materialises only its own shards."""
  graphdef, shapes, axes = abstract_model(cfg)
  shardings = tree_shardings(shapes, axes, mesh, layout)

  @partial(jax.jit, out_shardings=shardings)
  def init(key):
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=key))))

  return graphdef, init(jax.random.key(seed))


def abstract_layer(x, num_layers: int = 0):
  """A scanned model's stacked leaf as one layer, abstract ([L, ...] -> [...], sharded as the
  stack is past its replicated layer axis); num_layers > 0: the reverse, a layer's leaf as
  the stack of num_layers ([...] -> [L, ...])."""
  spec = tuple(x.sharding.spec) if getattr(x, "sharding", None) is not None else None
  if num_layers:
    shape, spec = (num_layers, *x.shape), None if spec is None else (None, *spec)
  else:
    shape, spec = x.shape[1:], None if spec is None else spec[1:]
  return jax.ShapeDtypeStruct(shape, x.dtype, sharding=None if spec is None else
                              NamedSharding(x.sharding.mesh, P(*spec)))


def cache_sharding(mesh: Mesh, cfg: ModelConfig, slots: int, max_len: int,
                   layout: str = "sampler") -> NamedSharding:
  """Sharding of each [B, K, S, H] KV-cache array (a layer's keys, and its values): slots over
  data x fsdp, KV heads over tensor (replicated when the KV-head count is smaller than the
  tensor size)."""
  shape = cache_shape(cfg, slots, max_len)
  spec, _ = logical_spec(CACHE_AXES, shape, get_rules(layout), mesh, name="kv_cache")
  return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh, ndim: int = 2, layout: str = "learner") -> NamedSharding:
  """Sharding of a [B, ...] batch: B over the layout's batch axes."""
  rule = get_rules(layout)["batch"]
  return NamedSharding(mesh, P(rule, *([None] * (ndim - 1))))


def activation_sharding(mesh: Mesh, layout: str = "learner"):
  """A scope for tracing a full-sequence program (a train step, a reference or reward forward):
  the model's residual stream [B, T, D] keeps its rows split over the layout's batch axes and D
  whole, as FSDP needs: each device runs its own rows and all-gathers each weight it multiplies
  (see jaxrl.models.attention.Tracing).

  A batch whose rows the axes do not divide is left to propagation, as is every array on a mesh
  without batch parallelism (one device, or tensor only), so those programs are unchanged.
  Cached decoding (the sampler, the greedy eval) does not use it: a decode step has a few rows,
  and for them the partial products' all-reduce moves less than the weights would."""
  return attention.tracing(pin_rows=_row_constraint(mesh, layout))


def _row_constraint(mesh: Mesh, layout: str):
  rule = get_rules(layout)["batch"]
  axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
  ways = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1

  def constrain(x):
    if ways == 1 or x.shape[0] % ways:
      return x
    spec = P(rule, *[None] * (x.ndim - 1))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  return constrain


def shard_activations(fn, mesh: Mesh, layout: str = "learner"):
  """`fn`, traced with its rows pinned as activation_sharding(mesh, layout) pins them and with
  the backend's full-sequence attention kernel for the layout (on CPU the C++ kernels; see
  jaxrl.models.attention): wrap it before jax.jit."""
  rules = get_rules(layout)

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    kernel = attention.attention_kernel(mesh, batch=rules["batch"], kv_heads=rules["kv_heads"])
    with attention.tracing(pin_rows=_row_constraint(mesh, layout), attention=kernel):
      return fn(*args, **kwargs)

  return traced


# ----------------------------------------------------------------------------- inspection


def _spec_str(spec: P) -> str:
  parts = []
  for s in spec:
    parts.append("-" if s is None else s if isinstance(s, str) else "(" + ",".join(s) + ")")
  return "(" + ", ".join(parts) + ")" if parts else "replicated"


def param_table(cfg: ModelConfig, mesh: Mesh, layout: str) -> str:
  """A table of parameter names, shapes, logical axes, mesh spec and bytes per device.

  Built from eval_shape alone, so it works for full-size presets without allocating them.
  """
  _, shapes, axes = abstract_model(cfg)
  rules = get_rules(layout)
  rows, notes = [], []
  total_params = total_bytes = per_device = 0
  flat_s = jax.tree_util.tree_flatten_with_path(shapes)[0]
  flat_a = jax.tree_util.tree_structure(shapes).flatten_up_to(axes)
  for (path, x), ax in zip(flat_s, flat_a):
    name = _path_name(path)
    spec, n = logical_spec(ax, x.shape, rules, mesh, name=name)
    notes += n
    ways = 1
    for s in spec:
      for a in ((s,) if isinstance(s, str) else (s or ())):
        ways *= mesh.shape[a]
    nbytes = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    total_params += int(np.prod(x.shape))
    total_bytes += nbytes
    per_device += nbytes // ways
    rows.append((name, "x".join(map(str, x.shape)), ",".join(str(a) for a in ax),
                 _spec_str(spec), str(np.dtype(x.dtype)), _fmt_bytes(nbytes // ways)))
  if cfg.num_layers > 4:  # collapse identical layers 1..L-2 so big presets stay readable
    rows = [r for r in rows if not _middle_layer(r[0], cfg.num_layers)]
    shown = f"  (layers 1..{cfg.num_layers - 2} have the same rows as layer 0)"
  else:
    shown = ""
  head = ("parameter", "shape", "logical axes", f"{layout} spec", "dtype", "bytes/device")
  widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
  fmt = "  ".join(f"{{:<{w}}}" for w in widths)
  lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
  lines += [fmt.format(*r) for r in rows]
  if shown:
    lines.append(shown)
  lines.append(f"total: {total_params:,} parameters, {_fmt_bytes(total_bytes)}; "
               f"{_fmt_bytes(per_device)} per device on {mesh.devices.size} devices "
               f"(mesh {' x '.join(f'{k}={v}' for k, v in mesh.shape.items())}, layout {layout})")
  seen = set()
  for note in notes:
    key = note.split(": ", 1)[1]
    if key not in seen:
      seen.add(key)
      lines.append(f"note: {key} (e.g. {note.split(':', 1)[0]})")
  return "\n".join(lines)


def _middle_layer(name: str, num_layers: int) -> bool:
  parts = name.split(".")
  return (len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit()
          and 0 < int(parts[1]) < num_layers - 1)


def _fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
    n /= 1024
  return f"{n:.2f} TiB"
