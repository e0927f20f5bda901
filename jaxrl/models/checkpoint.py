"""jaxrl's own parameter checkpoint: what `jaxrl convert` reads and writes on the jaxrl side.

A directory holding
  config.json   the ModelConfig (dataclass fields; rope_scaling nested)
  params/       the parameter tree, saved with orbax's StandardCheckpointer
  hf/           (optional) files carried over from a Hugging Face import: its config.json
                extras (bos/eos ids) and tokenizer files, so an export is servable as is.

Restoring takes the target shardings from the layout, so each process reads only its shards.
The training loop's checkpoints hold params beside optimizer state; `load_params(dir/...)` is
meant to be pointed at their params item once that format lands.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from jax.sharding import Mesh

from jaxrl.errors import ConfigError
from jaxrl.models.config import ModelConfig, RopeScaling
from jaxrl.models.llama import abstract_model
from jaxrl.parallel.layouts import tree_shardings


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
  import orbax.checkpoint as ocp
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
  import orbax.checkpoint as ocp
  cfg = load_config(path)
  graphdef, shapes, axes = abstract_model(cfg)
  shardings = tree_shardings(shapes, axes, mesh, layout)
  target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shardings)
  params = ocp.StandardCheckpointer().restore(os.path.join(os.path.abspath(path), "params"),
                                              target)
  return cfg, graphdef, params
