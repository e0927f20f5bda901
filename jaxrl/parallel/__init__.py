"""The device mesh, layouts (logical-axis rules), sharded parameter creation and weight sync."""

from jaxrl.parallel.layouts import (LAYOUTS, activation_sharding, batch_sharding,
                                    cache_sharding, get_rules, init_params, logical_spec,
                                    param_shardings, param_table, shard_activations,
                                    tree_shardings)
from jaxrl.parallel.mesh import AUTO, MESH_AXES, describe, make_mesh, mesh_from_config, mesh_shape

__all__ = [
    "AUTO", "LAYOUTS", "MESH_AXES", "activation_sharding", "batch_sharding", "cache_sharding",
    "describe", "get_rules", "init_params", "logical_spec", "make_mesh", "mesh_from_config",
    "mesh_shape", "param_shardings", "param_table", "shard_activations", "tree_shardings",
]
