"""What GRPO watches between steps: the KL coefficient (fixed or adaptive) and the alarms
(KL drift, reward hacking). Host state, checkpointed with the prompts' position."""

from __future__ import annotations

import collections

import numpy as np

from jaxrl.objectives import losses


class KLCoefficient:
  """beta, the KL penalty's weight: fixed (algo.beta), or moved after every step toward
  algo.kl_target by the adaptive controller (losses.adaptive_kl_beta). Host state, checkpointed
  with the prompts' position, so a resumed run continues from the beta it had reached."""

  def __init__(self, value: float):
    self.value = float(value)

  def get_state(self) -> dict:
    return {"value": self.value}

  def set_state(self, state: dict) -> None:
    self.value = float(state["value"])

  def after_step(self, a, *, kl: float, n_steps: int) -> None:
    """The controller's move after a step whose updates measured mean KL `kl` over `n_steps`
    samples; with algo.kl_target = 0, beta stays algo.beta."""
    if a.kl_target > 0:
      self.value = losses.adaptive_kl_beta(self.value, kl=kl, target=a.kl_target,
                                           horizon=a.kl_horizon, n_steps=n_steps)


# ----------------------------------------------------------------------------- alarms


class Alarms:
  """KL past a threshold, and reward rising while held-out accuracy falls (reward hacking).

  The reward-hacking alarm reads the held-out eval's eval/accuracy (on_eval): the run's
  evaluator (jaxrl.evals) on data.eval_file or the task's test split, scored by the eval's
  checker. `watching` says which, once the trainer has armed it; None means no held-out eval
  runs, so the alarm cannot fire (the trainer says so when it starts, and summary.json
  records it)."""

  def __init__(self, *, kl_threshold: float, window: int, out, min_drop: float = 0.03,
               reward_key: str = "reward/mean"):
    self.kl_threshold, self.window, self.out = kl_threshold, window, out
    # The proxy being optimised: reward/mean, or the raw reward-model score (reward/rm_mean),
    # which a running normalisation would otherwise hide.
    self.reward_key = reward_key
    # Held-out accuracy on a few hundred prompts moves by a point or two between evals by chance;
    # only a larger fall while the reward rises counts as hacking.
    self.min_drop = min_drop
    self.rewards: collections.deque = collections.deque(maxlen=window)
    self.evals: list[tuple[int, float, float]] = []  # (step, mean reward since last, accuracy)
    self.raised = {"kl": 0, "reward_hacking": 0}
    self.kl_max: float | None = None  # over every step of the run, logged or not
    self.watching: str | None = None  # the held-out metric on_eval is given, once armed
    self.said_flat = False  # the note that a step's groups all had equal rewards, said once

  def get_state(self) -> dict:
    """What a resumed run needs to raise the same alarms and report the same kl/max."""
    return {"rewards": list(self.rewards), "evals": [list(e) for e in self.evals],
            "raised": dict(self.raised), "kl_max": self.kl_max}

  def set_state(self, state: dict) -> None:
    self.rewards = collections.deque(state["rewards"], maxlen=self.window)
    self.evals = [tuple(e) for e in state["evals"]]
    self.raised = {**self.raised, **state["raised"]}
    self.kl_max = state["kl_max"]

  def on_step(self, step: int, metrics: dict) -> dict:
    self.rewards.append(metrics[self.reward_key])
    if "kl" in metrics:
      kl = float(metrics["kl"])
      self.kl_max = kl if self.kl_max is None else max(self.kl_max, kl)
    if self.evals and self.evals[-1][1] is None:
      # The baseline eval came before any step; step 1's rollouts come from that same starting
      # policy, so its reward is the baseline's.
      self.evals[-1] = (self.evals[-1][0], metrics[self.reward_key], self.evals[-1][2])
    if metrics.get("frac_zero_std_groups") == 1.0 and not self.said_flat:
      self.said_flat = True  # a pulse from an untrained policy: every reward 0
      self.out(f"note step {step}: every group's rewards were equal ({self.reward_key} "
               f"{metrics[self.reward_key]:.3f}), so every advantage is 0 and the step learned "
               "nothing: a pulse from an untrained policy checks the plumbing only; to learn, "
               "start from a policy that earns some rewards (init.checkpoint=an SFT run)")
    if metrics.get("kl", 0.0) > self.kl_threshold:
      self.raised["kl"] += 1
      self.out(f"ALARM step {step}: kl={metrics['kl']:.4f} > {self.kl_threshold} (the policy is "
               "drifting from the reference: raise algo.beta or lower optim.lr)")
      return {"alarm/kl": 1.0}
    return {"alarm/kl": 0.0}

  def on_eval(self, step: int, accuracy: float) -> dict:
    # Before any step (the baseline eval) the reward is not known yet: the next on_step fills
    # it in (never 0.0, which a negative reward-model score would "rise" from by construction).
    reward = float(np.mean(self.rewards)) if self.rewards else None
    self.evals.append((step, reward, accuracy))
    # Compare with the latest eval at least `window` steps back (the first one until then), not
    # just the previous one: evals every 10 steps of a slow slide (0.766 -> 0.762 -> 0.742 ->
    # 0.723 -> 0.699 against a biased reward model) never fell 0.03 between neighbours.
    earlier = [e for e in self.evals[:-1] if e[0] <= step - self.window] or self.evals[:1]
    if len(self.evals) >= 2 and earlier[-1][1] is not None:
      (_, r0, a0), (_, r1, a1) = earlier[-1], self.evals[-1]
      if r1 > r0 and a1 < a0 - self.min_drop:
        self.raised["reward_hacking"] += 1
        self.out(f"ALARM step {step}: reward rose {r0:.3f} -> {r1:.3f} while held-out accuracy "
                 f"fell {a0:.3f} -> {a1:.3f} (reward hacking?)")
        return {"alarm/reward_hacking": 1.0}
    return {"alarm/reward_hacking": 0.0}

