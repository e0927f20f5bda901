"""Reward models inside RL: frozen `jaxrl rm` runs on the learner mesh, scoring completions.

    rms = RewardModels.load(["runs/rm_a", "runs/rm_b"], mesh, tokenizer)
    scores_mn = rms.score(tokens_nt, positions_nt, last_n, logp_mask_nt)  # [M RMs, N rows]
    combined_n = ensemble(scores_mn, mode="min")

Each reward model is restored straight into the learner layout (each device reads its own
shards) and never updated. All of them score a batch in one jitted forward. A learned reward is
a proxy: combining several (the pessimistic `min`, or `mean_minus_std`, Coste et al. 2024,
"Reward Model Ensembles Help Mitigate Overoptimization") and keeping the KL anchor and held-out
verifiable accuracy in view is how jaxrl guards against gaming it.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import config as config_lib
from jaxrl.data.hf_tokenizer import tokenizer_for
from jaxrl.errors import ConfigError, check_choice
from jaxrl.io.params import restore_params
from jaxrl.models import RewardModel, abstract_model, reward_apply
from jaxrl.parallel import shard_activations, tree_shardings

ENSEMBLES = ("mean", "min", "mean_minus_std")


def reward_model_section() -> ml_collections.ConfigDict:
  """The RL trainers' `reward_model` section; empty `checkpoints` means no reward model."""
  return ml_collections.ConfigDict(dict(
      checkpoints="",    # comma-separated `jaxrl rm` run dirs; each scores every completion
      ensemble="mean",   # combines the RMs' scores: mean | min | mean_minus_std
      k=1.0,             # mean_minus_std: mean - k * std over the RMs
      normalize=False,   # z-score each RM's scores by its running mean and std (over all
                         # steps so far) before the ensemble combines them
      weight=1.0,        # reward = verifiable rewards (`rewards`) + weight * RM score
  ))


def checkpoint_list(section) -> list[str]:
  return [p.strip() for p in str(section.get("checkpoints") or "").split(",") if p.strip()]


def ensemble(scores_mn, *, mode: str = "mean", k: float = 1.0):
  """One score per completion [N] from M reward models' scores [M, N]. mean_minus_std uses
  the population std over the M models (0 for one model)."""
  check_choice("reward_model.ensemble", mode, ENSEMBLES)
  s = jnp.asarray(scores_mn, jnp.float32)
  if mode == "mean":
    return s.mean(0)
  if mode == "min":
    return s.min(0)
  return s.mean(0) - k * s.std(0)


class RunningNorm:
  """Per-model mean and std of every score seen so far (Chan et al.'s parallel update, in
  float64), so an RM's scale never depends on one batch. normalize(x [M, N]) updates with x,
  then z-scores each model's row by its own statistics.

  Normalising each model before the ensemble puts RMs of different scales on one footing
  (otherwise `min` is decided by whichever RM has the widest range). Under GRPO's per-group
  std normalisation an affine change of the only reward does not change the advantages; it
  matters when RM scores are mixed with verifiable rewards, for ensembles, and for estimators
  that do not divide by the group std (dr_grpo, rloo)."""

  def __init__(self, models: int = 1, eps: float = 1e-6):
    self.count, self.eps = 0, eps
    self.mean, self.m2 = np.zeros(models), np.zeros(models)

  def update(self, x_mn) -> None:
    x = np.asarray(x_mn, np.float64).reshape(len(self.mean), -1)
    n = x.shape[1]
    if not n:
      return
    mean = x.mean(1)
    m2 = ((x - mean[:, None]) ** 2).sum(1)
    total = self.count + n
    delta = mean - self.mean
    self.mean = self.mean + delta * n / total
    self.m2 = self.m2 + m2 + delta ** 2 * self.count * n / total
    self.count = total

  @property
  def std(self) -> np.ndarray:
    return np.sqrt(self.m2 / self.count) if self.count else np.ones_like(self.mean)

  def normalize(self, x_mn) -> np.ndarray:
    self.update(x_mn)
    x = np.asarray(x_mn, np.float64).reshape(len(self.mean), -1)
    return ((x - self.mean[:, None]) / (self.std[:, None] + self.eps)).astype(np.float32)

  def get_state(self) -> dict:
    return {"count": self.count, "mean": self.mean.tolist(), "m2": self.m2.tolist()}

  def set_state(self, state: dict) -> None:
    self.count = int(state["count"])
    self.mean, self.m2 = np.asarray(state["mean"], np.float64), np.asarray(state["m2"],
                                                                           np.float64)


# ----------------------------------------------------------------------------- loading


def read_run_config(path: str, key: str = "reward_model.checkpoints") -> ml_collections.ConfigDict:
  """The resolved config of a `jaxrl rm` run dir; a ConfigError when `path` is not one."""
  from jaxrl.train.rundir import read_config
  d = read_config(path)
  if d is None:
    raise ConfigError(f"{key} names {path!r}, which holds no config.json: give the --workdir "
                      "of a finished `jaxrl rm` run.")
  if "center_coef" not in d.get("loss", {}):
    raise ConfigError(f"{key} names {path!r}, which is not a reward-model run (its config has "
                      "no loss.center_coef): train one with `jaxrl rm`.")
  return ml_collections.ConfigDict(d)


def plan_roles(config) -> list[tuple[str, object, bool]]:
  """(label, ModelConfig, logprob_feature) of each reward model a config names, for the memory
  plan. An RM run not trained yet is planned with the policy's shapes, and its label says so."""
  section = config.get("reward_model")
  roles = []
  for i, path in enumerate(checkpoint_list(section) if section is not None else []):
    if os.path.isfile(os.path.join(path, "config.json")):
      rc = read_run_config(path)
      roles.append((f"reward model {i} ({os.path.basename(os.path.normpath(path))})",
                    config_lib.model_config(rc),
                    bool((rc.get("head") or {}).get("logprob_feature", False))))
    else:
      roles.append((f"reward model {i} (not trained yet: policy shapes)",
                    config_lib.model_config(config), False))
  return roles


class RewardModels:
  """M frozen reward models on one mesh; score() runs all of them in one jitted forward."""

  def __init__(self, graphdefs, params, paths, mesh):
    self.graphdefs, self.params, self.paths = list(graphdefs), list(params), list(paths)
    replicated = NamedSharding(mesh, P())

    def score_all(params_m, tokens_nt, positions_nt, last_n, logp_mask_nt):
      return jnp.stack([reward_apply(g, p, tokens_nt, positions_nt, last_n,
                                     logp_mask_bt=logp_mask_nt)
                        for g, p in zip(self.graphdefs, params_m)])

    self._score = jax.jit(shard_activations(score_all, mesh), out_shardings=replicated)

  @classmethod
  def load(cls, paths, mesh, tokenizer, *, layout: str = "learner") -> "RewardModels":
    """Restores each RM run's latest params into `layout` on `mesh`. Every RM must read the
    policy's tokens: a different tokenizer is a ConfigError, not a silent misreading."""
    graphdefs, params = [], []
    for path in paths:
      rc = read_run_config(path)
      tok = tokenizer_for(rc)
      same = (type(tok) is type(tokenizer) and tok.vocab_size == tokenizer.vocab_size and
              (tok.bos_id, tok.eos_id, tok.pad_id) == (tokenizer.bos_id, tokenizer.eos_id,
                                                       tokenizer.pad_id))
      if not same:
        raise ConfigError(f"reward model {path!r} reads a different tokenizer "
                          f"({type(tok).__name__}, {tok.vocab_size} ids) than the policy "
                          f"({type(tokenizer).__name__}, {tokenizer.vocab_size} ids): train "
                          "it from the policy's model.")
      cfg = config_lib.model_config(rc)
      head = rc.get("head") or {}
      graphdef, shapes, axes = abstract_model(cfg, functools.partial(
          RewardModel, logprob_feature=bool(head.get("logprob_feature", False))))
      shd = tree_shardings(shapes, axes, mesh, layout)
      abstract = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                              shapes, shd)
      graphdefs.append(graphdef)
      params.append(restore_params(path, abstract, key="reward_model.checkpoints"))
    return cls(graphdefs, params, paths, mesh)

  def score(self, tokens_nt, positions_nt, last_n, logp_mask_nt) -> np.ndarray:
    """Scores [M, N] (float32, on the host) of N rows, each read at its `last_n` token;
    logp_mask_nt marks the positions whose next token is a response token."""
    return np.asarray(self._score(self.params, tokens_nt, positions_nt, last_n, logp_mask_nt))


def completion_inputs(rollout, *, length: int, pad_id: int, eos_id: int):
  """(tokens [N, length], positions [N, length], last [N], logp_mask [N, length]) for scoring a
  rollout: each row is prompt + completion, read at the last response token; logp_mask is 1
  where the next token is a response token (as a pair batch's loss_mask). A final eos is not
  read, as in training, where a pair's rows end with eos as the last *target*, never an
  input."""
  N = rollout.completion_ids.shape[0]
  tokens = np.full((N, length), pad_id, np.int32)
  last = np.zeros((N,), np.int32)
  for s in range(N):
    p, c = int(rollout.prompt_lengths[s]), int(rollout.lengths[s])
    comp = rollout.completion_ids[s, :c]
    if c and int(comp[-1]) == eos_id:
      comp = comp[:-1]
    n = min(p + len(comp), length)
    tokens[s, :p] = rollout.prompt_ids[s, :p]
    tokens[s, p:n] = comp[:n - p]
    last[s] = n - 1
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (N, length)).copy()
  starts = np.asarray(rollout.prompt_lengths, np.int32)[:, None] - 1
  logp_mask = (np.arange(length)[None, :] >= starts).astype(np.float32)
  return tokens, positions, last, logp_mask
