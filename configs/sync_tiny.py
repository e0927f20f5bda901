"""Weight sync for a model on this machine's devices.

    jaxrl bench sync --config configs/sync_tiny.py                # colocated fsdp=8 -> data x tensor
    jaxrl bench sync --config configs/sync_tiny.py:disaggregated  # 4 learner + 4 sampler devices
    jaxrl bench sync --config configs/sync_tiny.py:qwen3-8b --config.placement.sampler_mesh.tensor=4

(The memory plan is a trainer's: `jaxrl plan --config configs/grpo_tiny.py`.)

arg: "", "disaggregated", or a model preset name (e.g. "qwen3-8b", which also sets bf16 params).
"""

from jaxrl.config import base_config
from jaxrl.models import PRESETS
from jaxrl.parallel.sync import placement_config


def get_config(arg=None):
  c = base_config()
  c.model.preset = "tiny"
  c.placement = placement_config()
  c.placement.sampler_mesh.tensor = 4  # colocated: fsdp=8 for training, data=2 x tensor=4
  if arg == "disaggregated":
    c.placement.mode = "disaggregated"
    c.placement.learner_devices = 4
  elif arg in PRESETS:
    c.model.preset = arg
    c.model.param_dtype = c.model.dtype = "bfloat16"
  elif arg not in (None, ""):
    raise ValueError(f"unknown arg {arg!r}: use '', 'disaggregated' or a preset name")
  return c


def sweep():
  for mode in ("colocated", "disaggregated"):
    for dtype in ("", "bfloat16"):
      yield {"placement.mode": mode, "placement.sync_dtype": dtype}
