"""Full-size presets: parameter counts from jax.eval_shape against the published figures."""

import jax
import numpy as np
import pytest

from jaxrl.models import PRESETS, abstract_model, get_preset
from jaxrl.errors import ConfigError

# Exact totals are the safetensors parameter counts the model hubs publish for each checkpoint.
EXACT = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
}
# The model cards' rounded figures, in billions: (total, non-embedding, digits after the point).
CARD = {
    "qwen2.5-0.5b": (0.49, 0.36, 2),
    "qwen2.5-1.5b": (1.54, 1.31, 2),
    "qwen2.5-7b": (7.61, 6.53, 2),
    "qwen3-0.6b": (0.6, 0.44, None),
    "qwen3-1.7b": (1.7, 1.4, 1),
    "qwen3-4b": (4.0, 3.6, 1),
    "qwen3-8b": (8.2, 6.95, None),
    "llama-3.2-1b": (1.23, None, 2),
    "llama-3.2-3b": (3.21, None, 2),
    "llama-3.1-8b": (8.03, None, 2),
}


def _eval_shape_count(name):
  _, shapes, _ = abstract_model(get_preset(name))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("name", sorted(CARD))
def test_published_parameter_counts(name):
  cfg = get_preset(name)
  n = _eval_shape_count(name)
  assert n == cfg.num_params  # shape arithmetic and the built model agree
  if name in EXACT:
    assert n == EXACT[name]
  total, non_emb, digits = CARD[name]
  emb = cfg.vocab_size * cfg.embed_dim * (1 if cfg.tie_embeddings else 2)

  def close(value, figure):
    # Cards give "0.6B" or "6.95B"; some round (Qwen3) and some truncate (Llama's 1.2358B is
    # "1.23B", Qwen2.5-7B's 7.6156B is "7.61B"), so either reading of the figure counts.
    places = digits if digits is not None else len(str(figure).split(".")[1])
    scaled = value / 1e9 * 10**places
    return round(figure * 10**places) in (round(scaled), int(scaled))

  assert close(n, total), (name, n)
  if non_emb is not None:
    assert close(n - emb, non_emb), (name, n - emb)


def test_tiny_presets_are_tiny():
  for name, cfg in PRESETS.items():
    if name.startswith("tiny") or name == "small":
      assert cfg.num_params <= 5_000_000, name


def test_unknown_preset_names_the_choices():
  with pytest.raises(ConfigError, match=r"qwen3-9b.*Did you mean 'qwen3-8b'.*Choose one of"):
    get_preset("qwen3-9b")
