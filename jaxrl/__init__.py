"""jaxrl: JAX-native post-training for language models on one device mesh.

The public API is small; everything else is importable from its module. Its names load on
first use (PEP 562), so `import jaxrl`, and the console script before its allocator re-exec
(jaxrl.__main__), do not load jax.
"""

import importlib as _importlib

# First, before jax starts a backend: with neither a TPU nor a GPU here, jax on the CPU alone.
# Otherwise it loads libtpu (the test extra installs it for `jaxrl plan --compile`) only to
# find no chip, and a notebook's or script's first lines were libtpu's errors.
from jaxrl import backends as _backends

_backends.cpu_only_without_accelerators()

__version__ = "0.1.0"

_API = {
    "ConfigError": "jaxrl.errors", "base_config": "jaxrl.config", "load_config": "jaxrl.config",
    "model_config": "jaxrl.config", "PRESETS": "jaxrl.models", "ModelConfig": "jaxrl.models",
    "Transformer": "jaxrl.models", "apply": "jaxrl.models", "get_preset": "jaxrl.models",
    "token_logprobs": "jaxrl.models", "init_params": "jaxrl.parallel",
    "make_mesh": "jaxrl.parallel", "param_table": "jaxrl.parallel",
}
__all__ = sorted(_API)


def __getattr__(name):
  if name in _API:
    return getattr(_importlib.import_module(_API[name]), name)
  raise AttributeError(f"module 'jaxrl' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_API))
