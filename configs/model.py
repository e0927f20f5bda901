"""Any model preset on the current devices: shapes, shardings and bytes per device.

Nothing is allocated (eval_shape only), so full-size presets work on a laptop:

    jaxrl model --config configs/model.py:qwen3-8b --config.mesh.tensor=4
    jaxrl model --config configs/model.py:llama-3.1-8b --config.layout=sampler \
        --config.model.param_dtype=bfloat16

arg: a preset name from jaxrl.models.PRESETS (default: tiny).
"""

from jaxrl.config import base_config


def get_config(arg=None):
  c = base_config()
  c.model.preset = arg or "tiny"
  return c


def sweep():
  for preset in ("qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b"):
    yield {"model.preset": preset, "model.param_dtype": "bfloat16"}
