"""The evaluator: held-out records scored by a checker, greedily and from n samples.

    checker = checker_for(config, task)                # eval.reward, a task's check, or a reward
    ev = Evaluator(graphdef, cfg, mesh, tokenizer, records, checker, batch=128, max_new=8,
                   n=8, ks=(1, 4), temperature=1.0, sampler_mesh=mesh, to_sampler=fn)
    metrics = ev(params)       # eval/accuracy, eval/pass@k, eval/mean@k, eval/maj@k
    ev.completions             # every completion of that call, with its answer and score

Greedy accuracy runs the jitted greedy decoder on the learner's params in the learner layout
(jaxrl.train.evaluation.GreedyDecoder: the decoder every trainer's held-out eval has used, so
a built-in task's eval/accuracy is what it was). The n samples per prompt come from the sampler
engine (jaxrl.sampler) at eval.temperature, on the params `to_sampler` puts into the sampler
layout. The sampling seed is the same at every eval, so a pass@k curve over a run compares the
policies on the same random draws rather than adding the draws' noise. The metrics themselves
are pure functions (jaxrl.evals.metrics).

A checker is any registered reward (jaxrl.rewards) or a built-in task's `check`. A completion is
correct for pass@k when it scores a full mark (>= 1). A reward checker's failed checks (a math
verifier that raised or timed out scores 0) are counted in eval/reward_errors. maj@k votes over
the checker's extracted answers: a task's `extract_answer`; a reward function's own `extract`
attribute when it has one; for the math rewards the last \\boxed{} (whitespace dropped), else
the last number; for the gsm8k rewards the final number's value ("#### N", else \\boxed{},
else the last number; "1,000" and "1000" vote together); else jaxrl.rewards.extract_answer (the
text after "####" or "answer:", else the first line). Voting compares extracted text, so two
LaTeX spellings of one value (\\frac12, \\frac{1}{2}) vote apart.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.data.hf_tokenizer import eos_ids
from jaxrl.errors import ConfigError, check_choice
from jaxrl.evals import metrics as metrics_lib
from jaxrl.parallel.sync import release
from jaxrl.rewards import mathcheck
from jaxrl.rewards import REWARDS, RewardSpec, extract_answer, get_reward, score
from jaxrl.sampler import Engine, SamplingParams, bucket, generate
from jaxrl.train.evaluation import GreedyDecoder, encode_prompt


# ----------------------------------------------------------------------------- checkers


@dataclasses.dataclass(frozen=True)
class Checker:
  """Scores completions of held-out records. `score(completions, records, lengths)` gives one
  float per completion (records[i] is completion i's record, lengths[i] its token count) and
  how many of them are a failed check's 0, or None for a checker that cannot fail (a task's);
  `extract(completion)` the answer it gives, for maj@k's vote."""
  name: str
  score: Callable[[list[str], list[dict], list[int]], tuple[np.ndarray, int | None]]
  extract: Callable[[str], str]


def _final_number(text: str) -> str:
  """A GSM8K answer's value as text: the number after the last "####", else in the last
  \\boxed{}, else the last number; "" when there is none."""
  text = text.replace("\u2212", "-")
  for part in ((text.rsplit("####", 1)[1] if "####" in text else None),
               mathcheck.last_boxed(text)):
    value = mathcheck.parse_number(part) if part else None
    if value is not None:
      return str(value)
  found = mathcheck.numbers(text)
  value = mathcheck.parse_number(found[-1]) if found else None
  return "" if value is None else str(value)


def _math_answer(text: str) -> str:
  """A math answer as text: the last \\boxed{}'s content without whitespace, else the last
  number's value; "" when there is neither."""
  boxed = mathcheck.last_boxed(text)
  if boxed is not None and boxed.strip():
    return "".join(boxed.split())
  found = mathcheck.numbers(text)
  value = mathcheck.parse_number(found[-1]) if found else None
  return "" if value is None else str(value)


def extractor(name: str, fn) -> Callable[[str], str]:
  """The answer extraction maj@k votes with under reward `name` (see the module docstring)."""
  own = getattr(fn, "extract", None)
  if own is not None:
    return own
  if name.startswith("gsm8k"):
    return _final_number
  if name.startswith("math"):
    return _math_answer
  return extract_answer


def task_checker(task) -> Checker:
  """A built-in task's 0/1 `check(completion, answer)`."""
  from jaxrl.tasks import extract_answer as task_extract

  def check(completions, records, lengths):
    del lengths
    return np.array([task.check(c, r["answer"]) for c, r in zip(completions, records)],
                    np.float64), None

  return Checker(f"task:{task.name}", check, task_extract)


def reward_checker(name: str, kwargs: dict | None = None) -> Checker:
  """The registered reward `name` (with `kwargs`) as a checker; a reward function that raises
  or returns a bad value is named, as in training (jaxrl.rewards.score)."""
  fn = get_reward(name)
  spec = RewardSpec(name, 1.0, dict(kwargs or {}))

  def check(completions, records, lengths):
    keys = dict.fromkeys(k for r in records for k in r)
    fields = {k: [r.get(k) for r in records] for k in keys}
    fields["completion_length"] = [int(n) for n in lengths]
    values, stats = score([spec], list(completions), fields)
    return values.astype(np.float64), int(stats["reward/errors"])

  return Checker(name, check, extractor(name, fn))


def checker_for(config, task) -> Checker | None:
  """The checker a config's eval names: eval.reward ("task" or a registered reward), else
  data.task's checker, else the first reward of `rewards` (GRPO's: the verifier it trains on);
  None when there is none of these (a reward model alone)."""
  name = config.eval.get("reward", "") or ""
  kwargs = dict(config.get("reward_kwargs") or {})
  if name:
    check_choice("eval.reward", name, ["task", *sorted(REWARDS)])
    if name == "task":
      if task is None:
        raise ConfigError("eval.reward='task' but data.task is empty: name a reward (e.g. "
                          "--config.eval.reward=exact_match) or set data.task.")
      return task_checker(task)
    return reward_checker(name, kwargs.get(name))
  if task is not None:
    return task_checker(task)
  first = next(iter(filter(None, (p.strip().partition(":")[0] for p in
                                  str(config.get("rewards") or "").split(",")))), "")
  if first in ("", "none", "task"):
    return None
  return reward_checker(first, kwargs.get(first))


# ----------------------------------------------------------------------------- evaluator


class Evaluator:
  """Greedy accuracy and, with n > 0, pass@k / mean@k / maj@k (k in `ks`) from n samples per
  prompt at `temperature`, of fixed held-out `records` under `checker`.

  Greedy runs on the params as given (the learner layout on `mesh`); sampling runs the engine
  on `sampler_mesh` (default `mesh`) on `to_sampler(params)` (default: the params as given),
  `slots` decode slots at a time (default `batch`; steps_per_call and grow_cache as the
  rollouts'), as the model `sampler_model` (graphdef, cfg) when that differs (a scanned
  learner's sampler runs the layers unrolled)."""

  def __init__(self, graphdef, cfg, mesh, tokenizer, records: Sequence[dict], checker: Checker,
               *, batch: int, max_new: int, n: int = 0, ks: Sequence[int] = (),
               temperature: float = 1.0, seed: int = 0, sampler_mesh=None,
               to_sampler: Callable | None = None, slots: int | None = None,
               steps_per_call: int = 8, grow_cache: bool = True, prefix: str = "eval/",
               data_cfg=None, sampler_model: tuple | None = None):
    self.records, self.checker, self.tokenizer = _held_out(records), checker, tokenizer
    self.n, self.ks = int(n), tuple(int(k) for k in ks)
    bad = [k for k in self.ks if not 1 <= k <= max(self.n, 0)]
    if bad:
      raise ConfigError(f"eval.k={tuple(self.ks)} needs eval.n >= {max(self.ks)} samples per "
                        f"prompt (eval.n={self.n}): raise --config.eval.n or drop k={bad[0]}.")
    self.seed, self.prefix = int(seed), prefix
    # the one encoding (data_cfg: the config's data section, for chat templates)
    self.ids = [encode_prompt(tokenizer, r, data_cfg) for r in self.records]
    self.greedy = GreedyDecoder(graphdef, cfg, mesh, tokenizer, self.ids, batch=batch,
                                max_new=max_new)
    self.engine = None
    if self.n > 0:
      sampler_mesh = mesh if sampler_mesh is None else sampler_mesh
      self.slots = _slots(sampler_mesh, min(slots or batch, len(self.records) * self.n))
      self.steps_per_call, self.grow_cache = steps_per_call, grow_cache
      self.engine = _engine(*(sampler_model or (graphdef, cfg)), sampler_mesh, tokenizer,
                            max_new, temperature=float(temperature))
    # A copy made for sampling is freed once sampled from (GRPO's learner and sampler share
    # devices); params used as given are the caller's.
    self.to_sampler, self.own_copy = to_sampler or (lambda params: params), to_sampler is not None
    self.completions: list[dict] = []  # the last call's, every completion with its score
    self.errors: int | None = None     # the last call's failed checks; None: cannot fail
    self.timing: dict[str, float] = {}  # the last call's seconds, greedy and sampled

  def _rows(self, texts, lengths, recs) -> tuple[np.ndarray, list[str]]:
    scores, errors = self.checker.score(texts, recs, lengths)
    if errors is not None:
      self.errors = (self.errors or 0) + errors
    return np.asarray(scores, np.float64), [self.checker.extract(t) for t in texts]

  def __call__(self, params) -> dict[str, float]:
    t0 = time.perf_counter()
    self.errors = None
    toks = self.greedy.token_ids(params)
    texts = [self.tokenizer.decode(t) for t in toks]
    scores, answers = self._rows(texts, [len(t) for t in toks], self.records)
    out = {f"{self.prefix}accuracy": metrics_lib.accuracy(scores)}
    comps = [dict(prompt_index=i, mode="greedy", prompt=r.get("prompt"), answer=r.get("answer"),
                  completion=t, extracted=a, score=float(s), tokens=len(tk))
             for i, (r, t, a, s, tk) in enumerate(zip(self.records, texts, answers, scores, toks))]
    self.timing = {"greedy_s": time.perf_counter() - t0}
    if self.engine is not None:
      t1 = time.perf_counter()
      params_s = self.to_sampler(params)
      rollout = generate(self.engine, params_s, self.ids, n=self.n, seed=self.seed,
                         slots=self.slots, steps_per_call=self.steps_per_call,
                         grow_cache=self.grow_cache, max_prompt_len=bucket(max(map(len, self.ids))),
                         pad_id=self.tokenizer.pad_id)
      if self.own_copy:
        release(params_s)
      lengths = [int(x) for x in rollout.lengths]
      texts = [self.tokenizer.decode(row[:m]) for row, m in zip(rollout.completion_ids, lengths)]
      recs = [self.records[int(i)] for i in rollout.prompt_index]
      s_scores, s_answers = self._rows(texts, lengths, recs)
      P = len(self.records)
      out.update(metrics_lib.sampled_metrics(
          scores_pn=s_scores.reshape(P, self.n),
          answers_pn=[s_answers[i * self.n:(i + 1) * self.n] for i in range(P)],
          ks=self.ks, prefix=self.prefix))
      comps += [dict(prompt_index=int(p), mode="sample", sample=j % self.n,
                     prompt=recs[j].get("prompt"), answer=recs[j].get("answer"), completion=t,
                     extracted=a, score=float(s), tokens=m,
                     finish_reason=rollout.finish_reasons[j])
                for j, (p, t, a, s, m) in enumerate(zip(rollout.prompt_index, texts, s_answers,
                                                        s_scores, lengths))]
      self.timing["sample_s"] = time.perf_counter() - t1
    self.completions = comps
    if self.errors is not None:  # completions whose check failed (scored 0), greedy and sampled
      out[f"{self.prefix}reward_errors"] = float(self.errors)
    return out

  def samples(self, prompts: int) -> list[dict]:
    """The last call's completions of its first `prompts` prompts (greedy, then sampled)."""
    return [c for c in self.completions if c["prompt_index"] < prompts]


class EnvEvaluator:
  """The held-out eval of a multi-turn run: each held-out record's conversation with the
  run's environment, decoded greedily by the same driver GRPO's rollouts use
  (jaxrl.envs.rollout.continued: up to max_turns model turns, KV continued between turns,
  `budget` tokens after the prompt), one conversation per record.

  eval/accuracy is the share of conversations whose summed environment reward is a full mark
  (>= 1: for the calculator, the right final answer), as a checker's full mark counts for
  pass@k; eval/reward is their mean reward, and eval/tool_calls/mean, eval/turns/mean and
  eval/bad_tool_calls are the conversations' tool calls and model turns per conversation and
  malformed calls in all, named as the rollouts' env/ metrics. Greedy only (eval.n is refused
  for now). It runs on the sampler layout: `to_sampler(params)` is freed once decoded."""

  def __init__(self, graphdef, cfg, sampler_mesh, tokenizer, records: Sequence[dict], *, env,
               renderer, max_new: int, max_turns: int, budget: int, prompt_len: int,
               slots: int, steps_per_call: int = 8, grow_cache: bool = True,
               to_sampler: Callable | None = None, prefix: str = "eval/"):
    self.records, self.tokenizer, self.prefix = _held_out(records), tokenizer, prefix
    self.env, self.renderer = env, renderer
    self.max_turns, self.budget, self.prompt_len = int(max_turns), int(budget), int(prompt_len)
    self.slots = _slots(sampler_mesh, min(slots, len(self.records)))
    self.steps_per_call, self.grow_cache = steps_per_call, grow_cache
    self.engine = _engine(graphdef, cfg, sampler_mesh, tokenizer, max_new, greedy=True)
    self.to_sampler, self.own_copy = to_sampler or (lambda params: params), to_sampler is not None
    self.completions: list[dict] = []
    self.timing: dict[str, float] = {}

  def __call__(self, params) -> dict[str, float]:
    from jaxrl.envs.rollout import continued
    t0 = time.perf_counter()
    params_s = self.to_sampler(params)
    ro, rewards, _ = continued(
        self.engine, params_s, self.records, env=self.env, renderer=self.renderer, n=1, seed=0,
        max_turns=self.max_turns, budget=self.budget, slots=self.slots,
        steps_per_call=self.steps_per_call, grow_cache=self.grow_cache,
        max_prompt_len=self.prompt_len, pad_id=self.tokenizer.pad_id, decode=self.tokenizer.decode)
    if self.own_copy:
      release(params_s)
    st, correct = ro.stats, rewards >= 1.0
    self.completions = [
        dict(prompt_index=i, mode="greedy", prompt=r.get("prompt"), answer=r.get("answer"),
             conversation=self.tokenizer.decode(ro.completion_ids[i, :int(ro.lengths[i])],
                                                skip_special=False),
             score=float(rewards[i]), finish_reason=ro.finish_reasons[i])
        for i, r in enumerate(self.records)]
    self.timing = {"greedy_s": time.perf_counter() - t0}
    p = self.prefix
    return {f"{p}accuracy": float(correct.mean()), f"{p}reward": float(rewards.mean()),
            f"{p}tool_calls/mean": st["env_tool_calls"], f"{p}turns/mean": st["env_turns"],
            f"{p}bad_tool_calls": st["env_bad_tool_calls"]}

  def samples(self, prompts: int) -> list[dict]:
    """The last call's conversations of its first `prompts` prompts."""
    return [c for c in self.completions if c["prompt_index"] < prompts]


def _held_out(records: Sequence[dict]) -> list[dict]:
  """The held-out records as a list; an empty set is one sentence."""
  records = list(records)
  if not records:
    raise ConfigError("the held-out set is empty: give a data file with at least one "
                      "{\"prompt\", \"answer\"} line.")
  return records


def _engine(graphdef, cfg, sampler_mesh, tokenizer, max_new: int, **sampling) -> Engine:
  """The eval's engine: `max_new` tokens per turn, stopping at the tokenizer's end ids."""
  return Engine(graphdef, cfg, sampler_mesh, sampling=SamplingParams(
      max_new_tokens=int(max_new), eos_id=tokenizer.eos_id, stop_ids=eos_ids(tokenizer)[1:],
      **sampling))


def _slots(sampler_mesh, want: int) -> int:
  """`want` decode slots rounded up to a multiple of the sampler's replicas (data x fsdp), over
  which the slots are split."""
  replicas = sampler_mesh.shape["data"] * sampler_mesh.shape["fsdp"]
  return -(-want // replicas) * replicas
