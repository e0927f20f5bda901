"""Parameters from disk into a layout: jaxrl's own parameter checkpoint (what `jaxrl convert`
reads and writes on the jaxrl side) and the params of a training run's checkpoint.

A directory holding
  config.json   the ModelConfig (dataclass fields; rope_scaling nested)
  params/       the parameter tree, saved with orbax's StandardCheckpointer
  hf/           (optional) files carried over from a Hugging Face import: its config.json
                extras (bos/eos ids) and tokenizer files, so an export is servable as is.

Restoring takes the target shardings from the layout, so each process reads only its shards.
The training loop's checkpoints (jaxrl.train.checkpoint) hold params beside optimizer state;
`restore_params` reads only their params.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from jaxrl.errors import ConfigError
from jaxrl.models.config import ModelConfig, RopeScaling
from jaxrl.models.llama import abstract_model, stack_layers, unstack_layers
from jaxrl.parallel.layouts import abstract_layer, tree_shardings


# ----------------------------------------------------------------------------- structure


def _flat(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """{"layers.0.attn.q": (shape, dtype)} of a tree of arrays, ShapeDtypeStructs or orbax's
  ArrayMetadata."""
  leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
  return {".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path):
          (tuple(x.shape), str(np.dtype(x.dtype)))
          for path, x in leaves}


def check_structure(saved, target, *, where: str, fix: str) -> None:
  """Raises one sentence when the saved tree (orbax metadata, arrays or shapes) is not the
  target's: a tensor missing on either side, or a different shape or dtype. `where` names the
  checkpoint (e.g. "init.checkpoint='runs/sft'"), `fix` what to do about it. A restore never
  casts or drops silently: a model with fewer layers than its checkpoint is refused here."""
  a, b = _flat(saved), _flat(target)
  scanned = [any(".layers.attn." in f".{k}" for k in t) for t in (a, b)]
  if scanned[0] != scanned[1]:
    raise ConfigError(f"{where}: its layers were saved {'stacked' if scanned[0] else 'one by one'}"
                      f" (model.scan_layers={scanned[0]}) but this model has scan_layers="
                      f"{scanned[1]}: set --config.model.scan_layers={scanned[0]}.")
  for k in sorted(set(a) | set(b)):
    if k not in b:
      raise ConfigError(f"{where}: tensor {k} {list(a[k][0])} has no place in this model: {fix}.")
    if k not in a:
      raise ConfigError(f"{where}: tensor {k} {list(b[k][0])} of this model is not in the "
                        f"checkpoint: {fix}.")
    if a[k][0] != b[k][0]:
      raise ConfigError(f"{where}: tensor {k} has shape {list(a[k][0])} there but "
                        f"{list(b[k][0])} in this model: {fix}.")
    if a[k][1] != b[k][1]:
      raise ConfigError(f"{where}: tensor {k} is {a[k][1]} there but {b[k][1]} in this model: "
                        f"set model.param_dtype={a[k][1]!r}, or {fix}.")


def _saved_tree(path):
  """The tree of ArrayMetadata an orbax item directory holds, read without reading arrays.
  Through the item handler, not a Checkpointer: a Checkpointer looks for the step's
  _CHECKPOINT_METADATA inside the item (a run's checkpoints/N/state) and warns that it is
  missing on every restore; the file is one level up, where CheckpointManager wrote it."""
  md = ocp.PyTreeCheckpointHandler().metadata(epath.Path(path))
  md = getattr(md, "item_metadata", md)
  return getattr(md, "tree", md)


def config_to_dict(cfg: ModelConfig) -> dict:
  return dataclasses.asdict(cfg)


def config_from_dict(d: dict, where: str = "config.json") -> ModelConfig:
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(d) - fields)
  if unknown:
    raise ConfigError(f"{where}: {unknown[0]!r} is not a ModelConfig field; is this a jaxrl "
                      "checkpoint (a Hugging Face one needs `jaxrl convert hf-to-jaxrl`)?")
  d = dict(d)
  if d.get("rope_scaling") is not None:
    d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
  try:
    return ModelConfig(**d)
  except TypeError as e:
    raise ConfigError(f"{where}: not a complete ModelConfig: {e}.") from None


def save_params(path: str, cfg: ModelConfig, params) -> None:
  """Writes `path`/config.json and `path`/params (orbax). Every process must call it."""
  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(path, "params"), params, force=True)
  ckpt.wait_until_finished()
  if jax.process_index() == 0:
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(config_to_dict(cfg), f, indent=2)


def load_config(path: str) -> ModelConfig:
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file) or not os.path.isdir(os.path.join(path, "params")):
    raise ConfigError(f"{path!r} is not a jaxrl checkpoint: it needs config.json and params/ "
                      "(written by save_params or `jaxrl convert hf-to-jaxrl`).")
  with open(file) as f:
    return config_from_dict(json.load(f), where=file)


def load_params(path: str, mesh: Mesh, layout: str = "learner"):
  """(cfg, graphdef, params) restored straight into `layout` on `mesh`."""
  cfg = load_config(path)
  graphdef, shapes, axes = abstract_model(cfg)
  shardings = tree_shardings(shapes, axes, mesh, layout)
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
  where = os.path.join(os.path.abspath(path), "params")
  check_structure(_saved_tree(where), target, where=f"{path!r}",
                  fix="its params do not match its config.json; convert or save it again")
  params = ocp.StandardCheckpointer().restore(where, target)
  return cfg, graphdef, params


def restore_params(path: str, abstract_params, step: int | None = None, *,
                   key: str = "init.checkpoint"):
  """The params of a run's checkpoint (a run directory or its checkpoints/), placed with the
  abstract params' shardings; the optimizer state is not read. This is how RL and preference
  trainers start from an SFT run: `init.checkpoint=runs/sft`."""
  root = epath.Path(path).absolute()  # orbax refuses relative paths (e.g. runs/sft)
  if (root / "checkpoints").exists():
    root = root / "checkpoints"
  if not root.exists():
    raise ConfigError(f"{key}={path!r} does not exist: give a run directory that holds "
                      "checkpoints/ (e.g. the --workdir of a jaxrl sft run).")
  manager = ocp.CheckpointManager(root, item_names=("state", "data"))
  step = manager.latest_step() if step is None else step
  manager.close()
  if step is None:
    raise ConfigError(f"{key}={path!r} holds no checkpoint: train there first.")
  saved = _saved_tree(root / str(step) / "state")
  saved = saved.get("params", {}) if isinstance(saved, dict) else saved
  # A run of the other layer form (model.scan_layers) is read in its own form, then stacked
  # or unstacked into this model's, in its layout.
  want, read = abstract_params, _in_form_of(saved, abstract_params)
  check_structure(saved, read, where=f"{key}={path!r} (step {step})",
                  fix="give the model that run trained (its config's model section), or another "
                  "checkpoint")
  restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), read)
  out = ocp.PyTreeCheckpointHandler().restore(  # the handler: see _saved_tree
      epath.Path(root / str(step) / "state"), args=ocp.args.PyTreeRestore(
          item={"params": read}, restore_args={"params": restore_args},
          partial_restore=True))
  if read is want:
    return out["params"]
  layers = len(read["layers"]) if _scanned(want) else len(want["layers"])
  convert = stack_layers if _scanned(want) else lambda t: unstack_layers(t, layers)
  shardings = jax.tree.map(lambda a: a.sharding, want)
  # (Not donated: no stacked leaf has a layer's shape, so XLA could reuse none of them.)
  return jax.jit(convert, out_shardings=shardings)(out["params"])


def _scanned(tree) -> bool:
  """Whether a params tree (arrays, shapes or orbax metadata) holds stacked layers."""
  return any(".layers.attn." in f".{k}" for k in _flat(tree))


def _in_form_of(saved, abstract):
  """`abstract` (ShapeDtypeStructs with shardings) in the layer form of the saved tree: itself
  when they agree; else each layer's leaves stacked, or a stacked leaf's layers, each sharded
  as the stacked leaf is past its leading (replicated) layer axis."""
  if _scanned(saved) == _scanned(abstract) or "layers" not in abstract:
    return abstract
  if _scanned(abstract):  # saved one by one
    num = next(iter(jax.tree.leaves(abstract["layers"]))).shape[0]
    layer = jax.tree.map(abstract_layer, abstract["layers"])
    return {**abstract, "layers": {i: layer for i in range(num)}}
  num = len(abstract["layers"])
  return {**abstract, "layers": jax.tree.map(lambda a: abstract_layer(a, num),
                                             abstract["layers"][0])}


def save_safetensors(tensors: dict, path: str) -> None:
  """safetensors' save_file, then the file made readable as the umask allows, as open() makes
  the JSON beside it: save_file writes it owner-only (0600), which a server running as another
  user cannot read."""
  from safetensors.numpy import save_file
  save_file(tensors, path, metadata={"format": "pt"})
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)
