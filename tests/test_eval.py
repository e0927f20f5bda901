"""Held-out evaluation (jaxrl.evals): the metrics against their closed forms, the evaluator
beside the greedy exact match it extends, `jaxrl eval` on a run dir, and GRPO's held-out eval
on a user's own files (no built-in task) with the reward-hacking alarm armed."""

import json
import math
import os
from fractions import Fraction

import numpy as np
import pytest

from conftest import ROOT

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl.data import write_jsonl
from jaxrl.errors import ConfigError
from jaxrl.evals import metrics
from jaxrl.evals.evaluator import Evaluator, checker_for, reward_checker, task_checker
from jaxrl.rewards import get_reward
from jaxrl.algorithms import grpo
from jaxrl.tasks import get_task
from jaxrl.train.rundir import read_metrics

KS = (1, 2, 4)


# ----------------------------------------------------------------------------- the metrics


def _closed_form(n, c, k):
  """1 - C(n-c, k) / C(n, k), exactly (math.comb is 0 when n - c < k)."""
  return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_pass_at_k_equals_the_closed_form():
  for n in range(1, 13):
    for c in range(n + 1):
      for k in range(1, n + 1):
        assert metrics.pass_at_k(n=n, c=c, k=k) == pytest.approx(_closed_form(n, c, k),
                                                                 abs=1e-12), (n, c, k)
  # The edges, by name: nothing right; everything right; k = n; fewer wrong samples than k.
  assert metrics.pass_at_k(n=8, c=0, k=4) == 0.0
  assert metrics.pass_at_k(n=8, c=8, k=1) == 1.0
  assert metrics.pass_at_k(n=8, c=1, k=8) == 1.0 and metrics.pass_at_k(n=8, c=0, k=8) == 0.0
  assert metrics.pass_at_k(n=8, c=6, k=3) == 1.0  # 2 wrong < 3 drawn
  assert metrics.pass_at_k(n=5, c=2, k=1) == pytest.approx(0.4)  # pass@1 is c / n
  # Where the binomials overflow a float (C(1000, 500) ~ 1e299), the product stays exact.
  assert metrics.pass_at_k(n=1000, c=3, k=500) == pytest.approx(_closed_form(1000, 3, 500),
                                                                rel=1e-12)
  with pytest.raises(ValueError):
    metrics.pass_at_k(n=4, c=1, k=5)


def test_maj_and_mean_at_k_on_crafted_votes():
  answers = [["4", "5", "4", "5"],   # 2-2 after 4: the tie goes to "4", seen first
             ["7", "8", "8", "9"],   # "8" wins
             ["", "", "3", ""],      # empty answers do not vote: "3"
             ["", "", "", ""],       # no answer at all: 0
             ["1", "2", "3", "2"]]   # k=1: "1"; k=3: a three-way tie, "1"; k=4: "2"
  scores = np.array([[1, 0, 1, 0], [0, 1, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0], [0, 1, 0, 1]],
                    float)
  assert metrics.majority(answers[0]) == 0 and metrics.majority(answers[1]) == 1
  assert metrics.majority(answers[2]) == 2 and metrics.majority(answers[3]) is None
  assert metrics.majority(["b", "a", "a", "b"]) == 0  # a tie goes to the first answer
  assert metrics.maj_at_k(answers_pn=answers, scores_pn=scores, k=4) == pytest.approx(
      (1 + 1 + 1 + 0 + 1) / 5)
  assert metrics.maj_at_k(answers_pn=answers, scores_pn=scores, k=1) == pytest.approx(1 / 5)
  assert metrics.maj_at_k(answers_pn=answers, scores_pn=scores, k=3) == pytest.approx(
      (1 + 1 + 1 + 0 + 0) / 5)
  assert metrics.mean_at_k(scores_pn=scores, k=1) == pytest.approx(1 / 5)
  assert metrics.mean_at_k(scores_pn=scores, k=4) == pytest.approx(scores.mean())
  out = metrics.sampled_metrics(scores_pn=scores, answers_pn=answers, ks=(1, 4))
  assert sorted(out) == ["eval/maj@1", "eval/maj@4", "eval/mean@1", "eval/mean@4",
                         "eval/pass@1", "eval/pass@4"]
  # pass@4 with n = 4: a prompt passes when any sample is right (4 of the 5 here).
  assert out["eval/pass@4"] == pytest.approx(4 / 5)
  assert out["eval/pass@1"] == pytest.approx(scores.mean())  # pass@1 is c / n, averaged
  # A partial score is not a pass: pass@k counts full marks only.
  assert metrics.correct([0.5, 1.0, 0.99, 2.0]).tolist() == [False, True, False, True]


def test_math_and_gsm8k_checkers_vote_on_values():
  """maj@k's answers under the math verifiers: gsm8k's final number as a value (so "1,000" and
  "1000." vote together), math's last \\boxed{}; the scores are the verifiers' own."""
  gsm = reward_checker("gsm8k")
  comps = ["so 10 * 100 = 1000\n#### 1,000", "the answer is \\boxed{1000}", "it is 999",
           "1000.", "no idea"]
  assert [gsm.extract(c) for c in comps] == ["1000", "1000", "999", "1000", ""]
  records = [{"prompt": "q", "answer": "10 * 100 = 1000\n#### 1000"}] * len(comps)
  scores, errors = gsm.score(comps, records, [5] * len(comps))
  assert scores.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0] and errors == 0
  answers = [gsm.extract(c) for c in comps]
  assert metrics.maj_at_k(answers_pn=[answers], scores_pn=[scores], k=5) == 1.0
  assert metrics.maj_at_k(answers_pn=[answers[2:]], scores_pn=[scores[2:]], k=2) == 0.0
  m = reward_checker("math")
  assert m.extract("we get $\\boxed{ \\frac{1}{2} }$") == "\\frac{1}{2}"
  assert m.extract("x = 3/4") == "3/4" and m.extract("nothing") == ""
  assert reward_checker("exact_match").extract("work...\nAnswer: 12.") == "12"


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("override, match", [
    (["eval.n=2", "eval.k=(1, 4)"], r"eval.k=\(1, 4\) needs at least 4 samples per prompt but "
                                    r"eval.n=2: set --config.eval.n=4 or more"),
    (["eval.k=(0,)", "eval.n=4"], r"eval.k=\(0,\) must be a tuple of integers >= 1"),
    (["eval.n=-1"], r"eval.n=-1 must be at least 0"),
    (["eval.temperature=0"], r"eval.temperature=0.0 must be positive"),
    (["eval.max_new_tokens=-3"], r"eval.max_new_tokens=-3 must be at least 0"),
    (["eval.spot_check=-1"], r"eval.spot_check=-1 must be at least 0"),
])
def test_bad_eval_config_values_are_one_sentence(repo_root, override, match):
  spec = os.path.join(repo_root, "configs/grpo_tiny.py")
  with pytest.raises(ConfigError, match=match) as e:
    config_lib.load_config(spec, override, grpo.CHOICES)
  assert "\n" not in str(e.value) and str(e.value).endswith(".")


def test_the_checker_is_named_or_found(repo_root):
  spec = os.path.join(repo_root, "configs/grpo_tiny.py")
  c = config_lib.load_config(spec, ["eval.reward=exat_match"])
  with pytest.raises(ConfigError, match="eval.reward='exat_match' is not valid. Did you mean "
                                        "'exact_match'?"):
    checker_for(c, None)
  c = config_lib.load_config(spec, ["eval.reward=task", "data.task="])
  with pytest.raises(ConfigError, match="eval.reward='task' but data.task is empty"):
    checker_for(c, None)
  task = get_task("addition")
  c = config_lib.load_config(spec)
  assert checker_for(c, task).name == "task:addition"  # the built-in demo's checker, as before
  c = config_lib.load_config(spec, ["data.task=", "rewards=exact_match:1.0,format:0.1"])
  assert checker_for(c, None).name == "exact_match"  # the first reward: the verifier
  c = config_lib.load_config(spec, ["data.task=", "rewards=none"])
  assert checker_for(c, None) is None  # a reward model alone: GRPO says the alarm is off


def test_jaxrl_eval_reads_any_trainers_config(repo_root):
  """An SFT config's eval section has no n or k; `jaxrl eval` adds the evaluator's keys before
  the overrides, so they can be set, and still checks them."""
  from jaxrl.evals import command
  spec = os.path.join(repo_root, "configs/sft_tiny.py")
  config = command.load(spec, ["eval.n=4", "eval.k=(1, 4)", "eval.reward=exact_match"])
  s = command.settings(config)
  assert (s["n"], s["k"], s["reward"], s["max_new_tokens"]) == (4, (1, 4), "exact_match", 6)
  assert command.settings(command.load(os.path.join(repo_root, "configs/grpo_tiny.py")))[
      "max_new_tokens"] == 8  # GRPO's 0: rollout.max_new_tokens
  with pytest.raises(ConfigError, match=r"eval.k=\(8,\) needs at least 8 samples per prompt "
                                        r"but eval.n=0"):
    command.load(spec, ["eval.k=(8,)"])


def test_jaxrl_eval_refuses_random_weights_in_one_line(repo_root, tmp_path, capsys):
  data = tmp_path / "test.jsonl"
  write_jsonl(str(data), [{"prompt": "1+1=", "answer": "2"}])
  with pytest.raises(SystemExit) as e:
    cli.main(["eval", "--config", os.path.join(repo_root, "configs/grpo_tiny.py"), "--data",
              str(data), "--workdir", str(tmp_path / "out")])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "it would score randomly initialised weights" in err
  assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the evaluator


def test_greedy_accuracy_is_the_exact_match_every_trainer_ran(devices):
  """The evaluator's greedy half is ExactMatch's decoder and a task's check, so a built-in task's
  eval/accuracy (the demo's number) is what it was: the same completions, the same score."""
  from jaxrl.models import get_preset
  from jaxrl.parallel import init_params, make_mesh
  from jaxrl.data import ByteTokenizer
  from jaxrl.train.evaluation import ExactMatch
  cfg = get_preset("tiny")
  mesh = make_mesh(fsdp=8)
  graphdef, params = init_params(cfg, mesh, "learner", seed=3)
  task, tok = get_task("addition"), ByteTokenizer()
  records = task.records("test", 24, 1)
  # A checker that some random completions pass: a lower-case letter anywhere (a real reward).
  fmt = reward_checker("format", {"pattern": "[a-z]"})
  old = ExactMatch(graphdef, cfg, mesh, tok, records, lambda c, a: float(
      get_reward("format")([c], batch={}, pattern="[a-z]")[0]), batch=16, max_new=8)
  new = Evaluator(graphdef, cfg, mesh, tok, records, fmt, batch=16, max_new=8)
  m_old, m_new = old(params), new(params)
  assert [c["completion"] for c in new.completions] == old.completions(params)
  assert m_new == {**m_old, "eval/reward_errors": 0.0} and 0 < m_new["eval/accuracy"] < 1, m_new
  # The task's own checker scores those completions as ExactMatch's check did (the demo's).
  comps = old.completions(params)
  scores, errors = task_checker(task).score(comps, records, [0] * len(comps))
  assert errors is None and scores.tolist() == [task.check(c, r["answer"])
                                                for c, r in zip(comps, records)]


# ----------------------------------------------------------------------------- GRPO and jaxrl eval


@pytest.fixture(scope="module")
def user_data_run(tmp_path_factory):
  """GRPO as the README's own-data recipe runs it (data.task= with a train and an eval JSONL,
  rewards=exact_match), two steps from a random init, with eval.n=4 and k = 1, 2, 4."""
  root = tmp_path_factory.mktemp("user_data")
  task = get_task("addition")
  train, test = root / "train.jsonl", root / "test.jsonl"
  write_jsonl(str(train), task.records("train", 64, 0))
  write_jsonl(str(test), task.records("test", 8, 1))
  overrides = ["data.task=", f"data.train_file={train}", f"data.eval_file={test}",
               "rewards=exact_match", "eval.n=4", f"eval.k={KS}", "eval.spot_check=3"]
  config = config_lib.load_config(os.path.join(ROOT, "configs/grpo_tiny.py:runlocal"),
                                  overrides, grpo.CHOICES)
  said = []
  summary = grpo.run(config, str(root / "run"), out=said.append)
  return {"root": root, "workdir": str(root / "run"), "test": str(test), "said": said,
          "summary": summary, "overrides": overrides}


def test_grpo_on_user_data_logs_heldout_eval_and_arms_the_alarm(user_data_run):
  r = user_data_run
  assert r["summary"]["status"] == "completed"
  assert r["summary"]["reward_hacking_alarm"].startswith("eval/accuracy (exact_match on 8 "
                                                         "prompts of ")
  assert any("reward-hacking alarm armed" in s for s in r["said"])
  evals = [row for row in read_metrics(r["workdir"]) if "eval/accuracy" in row]
  assert [row["step"] for row in evals] == [0, 2]  # the baseline, then every eval.every
  for row in evals:
    for k in KS:
      for name in ("pass", "mean", "maj"):
        assert 0.0 <= row[f"eval/{name}@{k}"] <= 1.0
    assert row["eval/pass@1"] <= row["eval/pass@2"] <= row["eval/pass@4"]
    assert "alarm/reward_hacking" in row  # the alarm ran on this eval
  # A few completions per eval for a person to read, scored by the run's checker.
  for step in (0, 2):
    rows = [json.loads(line) for line in open(os.path.join(r["workdir"], "samples",
                                                           f"step_{step}.jsonl"))]
    assert {row["prompt_index"] for row in rows} == {0, 1, 2}
    assert len(rows) == 3 * (1 + 4) and all(row["step"] == step for row in rows)
    for row in rows:
      assert row["score"] == get_reward("exact_match")([row["completion"]],
                                                       batch={"answer": [row["answer"]]})[0]


def test_the_reward_hacking_alarm_fires_on_user_data(user_data_run, repo_root, tmp_path):
  """The alarm reads the user-data evaluator's eval/accuracy: after a crafted history (held-out
  0.9 at step 0, the proxy reward rising over the window), a real eval of the untrained policy
  (accuracy 0 on this data) raises it. Before this evaluator it never ran without data.task."""
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  overrides = [o for o in user_data_run["overrides"] if not o.startswith(("eval.n", "eval.k"))]
  config = config_lib.load_config(spec, overrides + ["alarm.window=2"], grpo.CHOICES)
  said = []
  p, state = grpo.setup(config, str(tmp_path / "run"), out=said.append)
  try:
    assert p.evaluator is not None and p.alarms.watching.startswith("eval/accuracy")
    p.alarms.on_eval(0, 0.9)
    for s, reward in enumerate((0.1, 0.2, 0.5, 0.8), start=1):
      p.alarms.on_step(s, {"reward/mean": reward, "kl": 0.0})
    m = grpo.evaluate(p, state.params, 4)
  finally:
    p.close()
  assert m["eval/accuracy"] < 0.5 and m["alarm/reward_hacking"] == 1.0, m
  assert any("reward hacking" in s for s in said)


def test_jaxrl_eval_writes_metrics_and_scored_completions(user_data_run, repo_root, tmp_path):
  """`jaxrl eval` on the run dir: eval.json and completions.jsonl, the scores those of the
  checker, the metrics those of the scores, and the greedy completions the run's own."""
  r = user_data_run
  out = tmp_path / "eval"
  # The format reward passes some of a barely trained model's samples, so pass@k has something
  # to count; the run's own checker (exact_match) is compared on the greedy accuracy below.
  from jaxrl.evals import command
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  config = config_lib.load_config(spec, r["overrides"] + ["eval.reward=format"])
  config.reward_kwargs = {"format": {"pattern": "[a-z]"}}
  command.run(config, checkpoint=r["workdir"], data=r["test"], workdir=str(out),
              out=lambda *a: None)
  result = json.load(open(out / "eval.json"))
  assert (out / "eval.json").read_text().endswith("}\n")  # `cat` leaves the prompt on its line
  rows = [json.loads(line) for line in open(out / "completions.jsonl")]
  assert result["step"] == 2 and result["checker"] == "format" and result["prompts"] == 8
  assert len(rows) == 8 * (1 + 4)
  fmt = get_reward("format")
  for row in rows:
    assert row["score"] == fmt([row["completion"]], batch={}, pattern="[a-z]")[0]
  greedy = [row for row in rows if row["mode"] == "greedy"]
  sampled = np.array([[row["score"] for row in rows if row["mode"] == "sample"
                       and row["prompt_index"] == i] for i in range(8)])
  m = result["metrics"]
  assert m["eval/accuracy"] == pytest.approx(np.mean([row["score"] for row in greedy]))
  for k in KS:
    assert m[f"eval/pass@{k}"] == pytest.approx(np.mean(
        [metrics.pass_at_k(n=4, c=int(c), k=k) for c in sampled.sum(1)]))
    assert m[f"eval/mean@{k}"] == pytest.approx(sampled[:, :k].mean())
  assert 0 < m["eval/pass@4"] < 1 or 0 < m["eval/pass@1"] < 1, m  # something was counted
  assert m["eval/pass@1"] <= m["eval/pass@4"]
  # The greedy completions are those the run's own last eval wrote (the same params, restored
  # from the checkpoint, through the same decoder).
  spot = [json.loads(line) for line in open(os.path.join(r["workdir"], "samples",
                                                         "step_2.jsonl"))]
  assert [row["completion"] for row in spot if row["mode"] == "greedy"] == [
      row["completion"] for row in greedy[:3]]


def test_grpo_without_heldout_data_says_the_alarm_is_off(repo_root, tmp_path):
  """No data.task and no data.eval_file: nothing to evaluate, and the run says so instead of
  leaving the reward-hacking alarm silently off."""
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  write_jsonl(str(tmp_path / "train.jsonl"), get_task("addition").records("train", 16, 0))
  overrides = ["data.task=", f"data.train_file={tmp_path / 'train.jsonl'}", "rewards=exact_match"]
  said = []
  p, _ = grpo.setup(config_lib.load_config(spec, overrides, grpo.CHOICES),
                    str(tmp_path / "run"), out=said.append)
  p.close()
  assert p.evaluator is None and p.alarms.watching is None
  assert ("held-out eval off: no held-out prompts (set data.eval_file to a JSONL of {prompt, "
          "answer}); the reward-hacking alarm is off") in said
