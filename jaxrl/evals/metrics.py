"""Held-out metrics over scored completions: pure functions of counts, scores and answers.

    pass_at_k(n=8, c=3, k=4)                       # one prompt: 8 samples, 3 correct
    mean_at_k(scores_pn, k=4), maj_at_k(answers_pn, scores_pn, k=4), accuracy(scores_p)

A sample is correct when its score is a full mark (>= 1: a verifier's 1.0; see `correct`).

- pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code", eq. 1): the chance that at least one of k samples drawn without replacement
  from the n generated is correct, 1 - C(n-c, k) / C(n, k). The binomials overflow floats for
  n in the hundreds, so it is computed as their paper's numpy snippet does, as the product
  1 - prod_{i=n-c+1}^{n} (1 - k / i).
- mean@k is the mean score of each prompt's first k samples (k = n: every sample), then over
  prompts.
- maj@k is the score of the majority answer among each prompt's first k samples (self-
  consistency, Wang et al. 2022): answers are the checker's extracted answers; an empty answer
  does not vote; a tie goes to the answer that appeared first, so the vote is deterministic. A
  prompt whose k answers are all empty scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def correct(scores) -> np.ndarray:
  """Whether each score is a full mark (>= 1): what pass@k counts as a correct sample."""
  return np.asarray(scores, np.float64) >= 1.0


def pass_at_k(*, n: int, c: int, k: int) -> float:
  """The unbiased pass@k of one prompt with c correct samples out of n (Chen et al. 2021)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:  # every draw of k holds a correct sample
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(*, correct_pn, k: int) -> float:
  """pass@k averaged over prompts, from a [P, n] boolean array of correct samples."""
  correct_pn = np.asarray(correct_pn, bool)
  n = correct_pn.shape[1]
  return float(np.mean([pass_at_k(n=n, c=int(c), k=k) for c in correct_pn.sum(1)]))


def mean_at_k(*, scores_pn, k: int) -> float:
  """The mean score of each prompt's first k samples, averaged over prompts ([P, n] scores)."""
  scores_pn = np.asarray(scores_pn, np.float64)
  if not 1 <= k <= scores_pn.shape[1]:
    raise ValueError(f"mean_at_k needs 1 <= k <= n={scores_pn.shape[1]}, got k={k}")
  return float(scores_pn[:, :k].mean())


def majority(answers: Sequence[str]) -> int | None:
  """The index of the first sample giving the most common non-empty answer (ties: the answer
  that appeared first), or None when every answer is empty."""
  counts: dict[str, int] = {}
  first: dict[str, int] = {}
  for i, a in enumerate(answers):
    if a:
      counts[a] = counts.get(a, 0) + 1
      first.setdefault(a, i)
  if not counts:
    return None
  best = max(counts.values())
  return min(first[a] for a, c in counts.items() if c == best)


def maj_at_k(*, answers_pn: Sequence[Sequence[str]], scores_pn, k: int) -> float:
  """The score of each prompt's majority answer among its first k samples (the score of the
  first sample that gave it), averaged over prompts."""
  scores_pn = np.asarray(scores_pn, np.float64)
  if not 1 <= k <= scores_pn.shape[1]:
    raise ValueError(f"maj_at_k needs 1 <= k <= n={scores_pn.shape[1]}, got k={k}")
  out = []
  for answers, scores in zip(answers_pn, scores_pn):
    i = majority(list(answers)[:k])
    out.append(0.0 if i is None else float(scores[i]))
  return float(np.mean(out))


def accuracy(scores) -> float:
  """The mean score (of greedy completions: with a 0/1 checker, the fraction right)."""
  return float(np.mean(np.asarray(scores, np.float64)))


def sampled_metrics(*, scores_pn, answers_pn, ks: Sequence[int], prefix: str = "eval/"
                    ) -> dict[str, float]:
  """pass@k, mean@k and maj@k for each k of `ks`, under `prefix` (eval/pass@4, ...)."""
  scores_pn = np.asarray(scores_pn, np.float64)
  ok_pn = correct(scores_pn)
  out = {}
  for k in ks:
    out[f"{prefix}pass@{k}"] = mean_pass_at_k(correct_pn=ok_pn, k=k)
    out[f"{prefix}mean@{k}"] = mean_at_k(scores_pn=scores_pn, k=k)
    out[f"{prefix}maj@{k}"] = maj_at_k(answers_pn=answers_pn, scores_pn=scores_pn, k=k)
  return out
