"""One device mesh with axes (data, fsdp, tensor), built from config."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxrl.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
AUTO = -1  # an axis size of -1 ("auto") takes every device the other axes leave


def mesh_shape(data: int = 1, fsdp: int = AUTO, tensor: int = 1, *,
               num_devices: int) -> tuple[int, int, int]:
  """Resolves "auto" (-1) and checks the product equals the device count, in one sentence."""
  sizes = {"data": int(data), "fsdp": int(fsdp), "tensor": int(tensor)}
  autos = [k for k, v in sizes.items() if v == AUTO]
  bad = [k for k, v in sizes.items() if v == 0 or v < AUTO]
  if bad:
    raise ConfigError(f"mesh.{bad[0]}={sizes[bad[0]]} is not a valid axis size: use a positive "
                      "integer, or -1 (auto) to take the devices the other axes leave.")
  if len(autos) > 1:
    raise ConfigError(f"mesh.{autos[0]} and mesh.{autos[1]} are both -1 (auto): at most one "
                      "axis can be auto.")
  fixed = int(np.prod([v for v in sizes.values() if v != AUTO]))
  desc = " x ".join(f"{k}={'auto' if v == AUTO else v}" for k, v in sizes.items())
  if autos:
    if num_devices % fixed:
      raise ConfigError(f"mesh {desc} does not divide the {num_devices} devices: the fixed axes "
                        f"multiply to {fixed}; choose mesh.* sizes whose product divides "
                        f"{num_devices}.")
    sizes[autos[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(f"mesh {desc} needs {fixed} devices but there are {num_devices}: set "
                      f"mesh.data, mesh.fsdp and mesh.tensor so their product is {num_devices}, "
                      "or set one of them to -1 (auto).")
  return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(data: int = 1, fsdp: int = AUTO, tensor: int = 1, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh over `devices` (default: all). The defaults put every device on fsdp.

  Axis types are Auto (GSPMD propagation from the parameter and input shardings), stated
  explicitly because newer JAX defaults make_mesh to Explicit.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(data, fsdp, tensor, num_devices=len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_from_config(section) -> Mesh:
  """Builds the mesh of a config's `mesh` section (keys data, fsdp, tensor)."""
  return make_mesh(section["data"], section["fsdp"], section["tensor"])


def describe(mesh: Mesh) -> str:
  axes = " x ".join(f"{n}={s}" for n, s in mesh.shape.items())
  kinds = sorted({d.platform for d in mesh.devices.flat})
  return f"Mesh({axes}) over {mesh.devices.size} {'/'.join(kinds)} devices"
