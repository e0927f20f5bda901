"""The optimizer from a config's `optim` section: AdamW, warmup then cosine or constant, clipping.

    optim.lr, optim.warmup_steps, optim.schedule ("cosine" | "constant"), optim.min_lr_ratio,
    optim.b1, optim.b2, optim.eps, optim.weight_decay, optim.clip_norm (0 = off)

Gradient accumulation is not an optax wrapper here: the train step scans over micro-batches and
makes one update, so `step` counts optimizer updates and the schedule needs no rescaling.
"""

from __future__ import annotations

import jax
import optax

from jaxrl.errors import ConfigError, check_choice

OPTIMIZERS = ("adamw",)
SCHEDULES = ("cosine", "constant")


def check_section(config) -> None:
  """The optim section's ranges, at config load: a positive lr, whole non-negative warmup and
  at least one micro-batch per update; clip_norm and weight_decay 0 turn them off."""
  from jaxrl import config as config_lib
  config_lib.check_positive(config, "optim.lr", example="1e-3")
  config_lib.check_at_least(config, 0, "optim.warmup_steps", "optim.clip_norm",
                            "optim.weight_decay", "optim.min_lr_ratio")
  config_lib.check_at_least(config, 1, "optim.accum_steps")


# The optim section's keys with fixed choices, and its ranges: each trainer's CHOICES includes
# these.
CHOICES = {"optim.name": OPTIMIZERS, "optim.schedule": SCHEDULES, "optim": check_section}


def lr_schedule(section, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `lr`, then cosine down to lr * min_lr_ratio, or flat."""
  lr, warmup = float(section.lr), int(section.warmup_steps)
  if lr <= 0:
    raise ConfigError(f"optim.lr={lr} must be positive: set e.g. --config.optim.lr=1e-3.")
  if warmup < 0:
    raise ConfigError(f"optim.warmup_steps={warmup} is negative: use 0 or more.")
  if section.schedule == "constant":
    after = optax.constant_schedule(lr)
  else:
    after = optax.cosine_decay_schedule(lr, max(1, total_steps - warmup),
                                        alpha=float(section.min_lr_ratio))
  if warmup == 0:
    return after
  # Start at lr/warmup, not 0, so the first update is not wasted.
  return optax.join_schedules([optax.linear_schedule(lr / warmup, lr, warmup), after], [warmup])


def decay_mask(params):
  """True where weight decay applies: matrices, not norm scales or biases (of any rank, since
  the attention biases here are [heads, head_dim])."""
  def decays(path, _):
    name = str(getattr(path[-1], "key", path[-1]))
    return not (name == "scale" or name.endswith("bias"))
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(section, total_steps: int) -> tuple[optax.GradientTransformation,
                                                       optax.Schedule]:
  """(optimizer, schedule). The schedule is returned so the step can log `lr`."""
  check_choice("optim.name", section.name, OPTIMIZERS)
  check_choice("optim.schedule", section.schedule, SCHEDULES)
  schedule = lr_schedule(section, total_steps)
  adamw = optax.adamw(schedule, b1=section.b1, b2=section.b2, eps=section.eps,
                      weight_decay=section.weight_decay, mask=decay_mask)
  if section.clip_norm and section.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(section.clip_norm), adamw), schedule
  return adamw, schedule


def optim_section(**overrides):
  """Defaults every trainer's config starts from (an ml_collections ConfigDict)."""
  import ml_collections
  c = ml_collections.ConfigDict(dict(
      name="adamw", lr=1e-3, warmup_steps=100, schedule="cosine", min_lr_ratio=0.1,
      b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01, clip_norm=1.0, accum_steps=1))
  c.update(overrides)
  return c
