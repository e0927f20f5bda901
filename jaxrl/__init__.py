"""jaxrl: JAX-native post-training for language models on one device mesh.

The public API is small; everything else is importable from its module.
"""

# First, before jax starts a backend: with neither a TPU nor a GPU here, jax on the CPU alone.
# Otherwise it loads libtpu (the test extra installs it for `jaxrl plan --compile`) only to
# find no chip, and a notebook's or script's first lines were libtpu's errors.
from jaxrl import backends as _backends

_backends.cpu_only_without_accelerators()

from jaxrl.config import base_config, load_config, model_config  # noqa: E402
from jaxrl.errors import ConfigError
from jaxrl.models import PRESETS, ModelConfig, Transformer, apply, get_preset, token_logprobs
from jaxrl.parallel import init_params, make_mesh, param_table

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "ModelConfig", "PRESETS", "Transformer", "apply", "base_config",
    "get_preset", "init_params", "load_config", "make_mesh", "model_config", "param_table",
    "token_logprobs",
]
