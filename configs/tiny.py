"""The tiny model (under 0.5M parameters) on every device: runs on CPU in seconds.

    jaxrl model --config configs/tiny.py                 # learner layout, all devices on fsdp
    jaxrl model --config configs/tiny.py:tp              # 2 (fsdp) x 4 (tensor)
    jaxrl model --config configs/tiny.py:sampler --config.model.preset=tiny-qwen3
    jaxrl sweep --config configs/tiny.py --dry-run       # the runs sweep() would launch

arg: "" (fsdp only), "tp" (fsdp x tensor=4), "sampler" (sampler layout, tensor=4).
"""

from jaxrl.config import base_config


def get_config(arg=None):
  c = base_config()
  c.model.preset = "tiny"
  if arg in ("tp", "sampler"):
    c.mesh.tensor = 4
  if arg == "sampler":
    c.layout = "sampler"
  elif arg not in (None, "", "tp"):
    raise ValueError(f"unknown arg {arg!r}: use '', 'tp' or 'sampler'")
  return c


def sweep():
  for preset in ("tiny", "tiny-qwen2", "tiny-qwen3", "tiny-llama3"):
    for layout in ("learner", "sampler"):
      yield {"model.preset": preset, "layout": layout, "mesh.tensor": 2}
