"""Reward models: the Bradley-Terry loss and centering (golden values), the scalar head on the
last real token, sharded init from an SFT checkpoint, and the trainer's pulse run."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import LEARN_SEED, assert_model_flops_per_token, jaxrl_cli
from jaxrl import config as config_lib
from jaxrl.models import RewardModel, abstract_model, get_preset, last_index, reward_apply
from jaxrl.parallel import make_mesh
from jaxrl.algorithms import rm
from jaxrl.train.optim import make_optimizer, optim_section
from jaxrl.train.state import init_train_state


# ----------------------------------------------------------------------------- golden values


def test_bradley_terry_of_equal_scores_is_ln2():
  s = jnp.array([-3.0, 0.0, 0.5, 7.0])
  loss = rm.bradley_terry_loss(chosen_b=s, rejected_b=s)
  np.testing.assert_allclose(loss, [math.log(2)] * 4, rtol=1e-6)


def test_bradley_terry_hand_values():
  # -log sigmoid(d): d = 1 -> log(1 + e^-1); d = -2 -> log(1 + e^2).
  loss = rm.bradley_terry_loss(chosen_b=jnp.array([1.0, 0.0]), rejected_b=jnp.array([0.0, 2.0]))
  np.testing.assert_allclose(loss, [math.log1p(math.exp(-1)), math.log1p(math.exp(2))],
                             rtol=1e-6)


def test_margin_shifts_the_difference():
  c, r = jnp.array([1.0, 2.5, -1.0]), jnp.array([0.0, 0.5, -1.0])
  with_margin = rm.bradley_terry_loss(chosen_b=c, rejected_b=r, margin=1.0)
  np.testing.assert_allclose(with_margin, rm.bradley_terry_loss(chosen_b=c - 1.0, rejected_b=r),
                             rtol=1e-6)
  assert float(with_margin[0]) == pytest.approx(math.log(2))  # a gap equal to the margin
  # A margin asks for more: every pair's loss rises.
  assert np.all(np.asarray(with_margin) > np.asarray(rm.bradley_terry_loss(chosen_b=c,
                                                                           rejected_b=r)))


def test_center_penalty_is_zero_for_centred_scores():
  c = jnp.array([0.3, -2.0, 5.0])
  np.testing.assert_array_equal(rm.center_penalty(chosen_b=c, rejected_b=-c), 0.0)
  np.testing.assert_allclose(rm.center_penalty(chosen_b=jnp.array([1.0, 2.0]),
                                               rejected_b=jnp.array([1.0, -1.0])), [4.0, 1.0])


def test_pair_stats():
  s = np.array([[2.0, 1.0], [0.0, 1.0], [3.0, -1.0], [1.0, 1.0]])
  st = rm.pair_stats(s)
  assert st["eval/accuracy"] == 0.5  # a tie is not a win
  assert st["eval/reward_chosen"] == pytest.approx(1.5)
  assert st["eval/reward_rejected"] == pytest.approx(0.5)
  assert st["eval/margin"] == pytest.approx(1.0)
  assert st["eval/margin_std"] == pytest.approx(np.std([1.0, -1.0, 4.0, 0.0]))


# ----------------------------------------------------------------------------- the model


def test_last_index():
  mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
  assert last_index(mask).tolist() == [2, 4, 0]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_reward_model_params_and_head(preset, devices):
  cfg = get_preset(preset)
  graphdef, shapes, axes = abstract_model(cfg, RewardModel)
  assert set(shapes) == {"backbone", "head"}
  assert axes["head"] == ("embed",) and shapes["head"].shape == (cfg.embed_dim,)
  assert "lm_head" not in shapes["backbone"]  # untied (qwen3) LM head is dropped: never read
  _, policy_shapes, _ = abstract_model(cfg)
  assert set(policy_shapes) - set(shapes["backbone"]) <= {"lm_head"}


def test_reward_reads_the_last_real_token(devices):
  cfg = get_preset("tiny")
  mesh = make_mesh()
  tx, _ = make_optimizer(optim_section(lr=1e-3), 10)
  graphdef, state, shd = init_train_state(cfg, mesh, tx, seed=0, model=RewardModel)
  # Born sharded in the learner layout: the head's embed axis over data x fsdp.
  assert state.params["head"].sharding.spec == shd.params["head"].spec
  assert len(state.params["head"].sharding.device_set) == 8
  head = np.asarray(state.params["head"])
  assert 0.005 < head.std() < 0.05  # small-initialised
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 200, size=(8, 10)).astype(np.int32)
  pos = np.broadcast_to(np.arange(10, dtype=np.int32), (8, 10))
  score = jax.jit(lambda p, t, last: reward_apply(graphdef, p, t, pos, last))
  last = np.full((8,), 5, np.int32)
  base = np.asarray(score(state.params, tokens, last))
  assert base.shape == (8,) and np.all(np.isfinite(base))
  after = tokens.copy()
  after[:, 6:] = 0  # tokens past the last real one change nothing (causal)
  np.testing.assert_allclose(score(state.params, after, last), base, rtol=1e-5, atol=1e-6)
  changed = tokens.copy()
  changed[:, 5] = (changed[:, 5] + 1) % 200 + 3  # the last real token changes the score
  assert not np.allclose(score(state.params, changed, last), base)
  # Hand-check the head: the score is head . final hidden state at `last`.
  from flax import nnx
  model = nnx.merge(graphdef, jax.device_get(state.params))
  h, _ = model.backbone.hidden(jnp.asarray(tokens), jnp.asarray(pos))
  np.testing.assert_allclose(np.asarray(h[:, 5] @ head), base, rtol=1e-4, atol=1e-5)


def test_pair_scores_keep_pairs_together(devices):
  cfg = get_preset("tiny")
  mesh = make_mesh()
  tx, _ = make_optimizer(optim_section(lr=1e-3), 10)
  graphdef, state, _ = init_train_state(cfg, mesh, tx, seed=1, model=RewardModel)
  rng = np.random.default_rng(1)
  B, S = 4, 8
  inputs = rng.integers(3, 200, size=(B, 2, S)).astype(np.int32)
  seg = np.ones((B, 2, S), np.int32)
  seg[:, 1, 6:] = 0  # rejected rows are shorter
  inputs[seg == 0] = 0
  pos = np.broadcast_to(np.arange(S, dtype=np.int32), (B, 2, S)).copy()
  batch = {"inputs": inputs, "positions": pos, "segment_ids": seg,
           "loss_mask": seg.astype(np.float32)}
  s = np.asarray(rm.pair_scores(graphdef, state.params, batch))
  one = lambda t, last: np.asarray(reward_apply(graphdef, state.params, t, pos[:, 0],
                                                np.full((B,), last, np.int32)))
  np.testing.assert_allclose(s[:, 0], one(inputs[:, 0], S - 1), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(s[:, 1], one(inputs[:, 1], 5), rtol=1e-4, atol=1e-5)


def test_logprob_feature_adds_the_response_mean_logprob(devices):
  """head.logprob_feature: score = head . h_last + w * mean log pi(response tokens), the mean
  over the positions logp_mask marks, up to the last read token; w starts at 1."""
  import functools
  from jaxrl.models import apply, token_logprobs
  cfg = get_preset("tiny")
  mesh = make_mesh()
  tx, _ = make_optimizer(optim_section(lr=1e-3), 10)
  model = functools.partial(RewardModel, logprob_feature=True)
  graphdef, state, _ = init_train_state(cfg, mesh, tx, seed=1, model=model)
  assert float(state.params["logprob_weight"]) == 1.0
  plain_gd, _, _ = init_train_state(cfg, mesh, tx, seed=1, model=RewardModel)
  rng = np.random.default_rng(3)
  B, S = 4, 8
  tokens = rng.integers(3, 200, size=(B, S)).astype(np.int32)
  pos = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy()
  last = np.array([7, 5, 6, 4], np.int32)
  mask = np.zeros((B, S), np.float32)
  mask[:, 2:] = 1  # the response starts at token 3: position 2 predicts it
  got = np.asarray(reward_apply(graphdef, state.params, tokens, pos, last, logp_mask_bt=mask))
  plain_params = {k: v for k, v in state.params.items() if k != "logprob_weight"}
  head = np.asarray(reward_apply(plain_gd, plain_params, tokens, pos, last))
  backbone_gd, _, _ = abstract_model(cfg)  # the Transformer alone
  logits, _ = apply(backbone_gd, state.params["backbone"], tokens, pos)
  logp = np.asarray(token_logprobs(logits, np.roll(tokens, -1, axis=1))[0])
  want = [head[b] + logp[b, 2:last[b]].mean() for b in range(B)]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the trainer


def test_rm_pulse_run_logs_fingerprint_and_resumes(repo_root, tmp_path, devices):
  spec = os.path.join(repo_root, "configs/rm_tiny.py:runlocal")
  workdir = str(tmp_path / "rm")
  lines = []
  summary = rm.run(config_lib.load_config(spec), workdir, out=lines.append)
  assert summary["status"] == "completed" and summary["step"] == 10
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert rows[0]["step"] == 0
  for name in ("eval/accuracy", "eval/reward_chosen", "eval/reward_chosen_std",
               "eval/reward_rejected", "eval/reward_rejected_std", "eval/margin",
               "eval/margin_std", "eval/loss"):
    assert name in rows[0] and name in rows[-1], name
  # An untrained head scores near zero: the held-out loss starts near ln 2.
  assert rows[0]["eval/loss"] == pytest.approx(math.log(2), abs=0.05)
  for name in ("loss", "loss/bt", "accuracy", "reward_chosen", "reward_rejected", "margin",
               "grad_norm", "lr"):
    assert name in rows[-1], name
  config = config_lib.load_config(spec)
  for r in rows[1:]:  # the backbone's forward and backward; no LM head without the feature
    assert_model_flops_per_token(r, config_lib.model_config(config), config.data.seq_len, 3,
                                 lm_head=False)
  # The data's fingerprint and cleaning report, beside the config and in the summary.
  data = json.load(open(os.path.join(workdir, "data.json")))
  saved = json.load(open(os.path.join(workdir, "summary.json")))
  from jaxrl.data import prefs
  records = prefs.task_prefs("addition", "train", 256, 0)
  kept, report = prefs.clean_prefs(records, eval_prompts=[
      r["prompt"] for r in prefs.task_prefs("addition", "test", 32, 1)])
  assert data["train"]["fingerprint"] == prefs.fingerprint(kept) == \
      saved["data"]["train"]["fingerprint"]
  assert data["train"]["report"] == report and report["duplicates_exact"] > 0
  assert any("duplicates" in s and "kept" in s for s in lines)
  # Re-running with more steps resumes at step 10.
  lines = []
  summary = rm.run(config_lib.load_config(spec, ["train.steps=12"]), workdir, out=lines.append)
  assert summary["step"] == 12 and any("resuming" in s for s in lines)


def test_rm_starts_from_an_sft_checkpoint(repo_root, tmp_path, devices):
  from jaxrl.algorithms import sft
  sft_dir = str(tmp_path / "sft")
  sft.run(config_lib.load_config(os.path.join(repo_root, "configs/sft_tiny.py:runlocal"),
                                 ["train.steps=2", "eval.every=0"]), sft_dir,
          out=lambda *a: None)
  config = config_lib.load_config(os.path.join(repo_root, "configs/rm_tiny.py:runlocal"),
                                  [f"init.checkpoint={sft_dir}"])
  mesh = make_mesh()
  tx, _ = make_optimizer(config.optim, 10)
  _, state, _ = rm.init_reward_state(config, mesh, tx)
  from jaxrl.io.params import restore_params
  policy = restore_params(sft_dir, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state.params["backbone"]))
  for a, b in zip(jax.tree.leaves(state.params["backbone"]), jax.tree.leaves(policy)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == b.sharding
  from jaxrl.errors import ConfigError
  bad = config_lib.load_config(os.path.join(repo_root, "configs/rm_tiny.py:runlocal"),
                               [f"init.checkpoint={tmp_path / 'nope'}"])
  with pytest.raises(ConfigError, match="init.checkpoint=.*does not exist"):
    rm.init_reward_state(bad, mesh, tx)


@pytest.mark.parametrize("override, pattern", [
    ("data.bias=shorter", r"data.bias='shorter' is not valid"),
    ("data.bias_rate=1.5", r"data.bias_rate=1.5 is not a fraction"),
    ("data.task=", r"data.task and data.train_file are both empty"),
    ("data.batch_size=12", r"data.batch_size=12 is not divisible by the 8 batch shards"),
])
def test_bad_rm_config_is_one_sentence(repo_root, tmp_path, override, pattern, devices):
  from jaxrl.errors import ConfigError
  with pytest.raises(ConfigError, match=pattern):
    rm.run(config_lib.load_config(os.path.join(repo_root, "configs/rm_tiny.py:runlocal"),
                                  [override]), str(tmp_path / "rm"), out=lambda *a: None)


def test_rm_reads_a_pairs_file_cleans_it_and_names_a_bad_row(repo_root, tmp_path, devices):
  from jaxrl.errors import ConfigError
  rows = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
          for a in range(10) for b in range(10)]
  respaced = {**rows[7], "chosen": " " + rows[7]["chosen"].upper() + " "}
  train = tmp_path / "pairs.jsonl"
  train.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:5] + [respaced]))
  held_out = tmp_path / "test.jsonl"
  held_out.write_text("".join(json.dumps(r) + "\n" for r in rows if r["prompt"].endswith("+9=")))
  spec = os.path.join(repo_root, "configs/rm_tiny.py:runlocal")
  workdir = tmp_path / "rm"
  summary = rm.run(config_lib.load_config(spec, [
      "data.task=", f"data.train_file={train}", f"data.eval_file={held_out}",
      "train.steps=2", "eval.every=2"]), str(workdir), out=lambda *a: None)
  assert summary["data"]["train"]["report"] == {
      "read": 106, "duplicates_exact": 5, "duplicates_normalized": 1, "ties": 0,
      "contaminated": 10, "kept": 90}
  assert summary["data"]["eval"]["pairs"] == 10 and "eval/accuracy" in summary["eval"]
  # Held out == train: every pair is contaminated, and the run says so instead of training.
  with pytest.raises(ConfigError, match=r"no training pairs are left after cleaning"):
    rm.run(config_lib.load_config(spec, ["data.task=", f"data.train_file={held_out}",
                                         f"data.eval_file={held_out}"]),
           str(tmp_path / "rm2"), out=lambda *a: None)
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt": "1+1=", "chosen": 2}) + "\n")
  with pytest.raises(ConfigError, match=r"bad.jsonl.*line 2"):
    rm.run(config_lib.load_config(spec, ["data.task=", f"data.train_file={bad}"]),
           str(tmp_path / "rm3"), out=lambda *a: None)


def test_plan_has_a_row_per_reward_model(repo_root, tmp_path, capsys, devices):
  from jaxrl import cli
  from jaxrl.models import get_preset
  from jaxrl.parallel.plan import memory_plan
  from jaxrl.parallel.sync import make_placement
  # A trained RM run's config.json is all the plan reads: here a tiny-qwen3 reward model.
  rm_dir = tmp_path / "rm_a"
  rm_dir.mkdir()
  rc = config_lib.load_config(os.path.join(repo_root, "configs/rm_tiny.py"),
                              ["model.preset=tiny-qwen3"])
  (rm_dir / "config.json").write_text(json.dumps(rc.to_dict()))
  cli.main(["plan", "--config", os.path.join(repo_root, "configs/grpo_tiny.py"),
            f"--config.reward_model.checkpoints={rm_dir},{tmp_path / 'rm_b'}"])
  out = capsys.readouterr().out
  assert "reward model 0 (rm_a) params" in out
  assert "reward model 1 (not trained yet: policy shapes) params" in out
  # Bytes: a reward model is its decoder without the LM head, plus a [D] head.
  config = config_lib.load_config(os.path.join(repo_root, "configs/grpo_tiny.py"))
  placement = make_placement(config.mesh, config.placement)
  tiny, qwen3 = get_preset("tiny"), get_preset("tiny-qwen3")
  plan = memory_plan(tiny, placement, reward_models=[("a", qwen3), ("b", tiny)])
  base = memory_plan(qwen3, placement).learner["actor params"]
  lm_head = qwen3.embed_dim * qwen3.vocab_size * 4 // 8  # untied: [D, V] over 8 devices
  head = qwen3.embed_dim * 4 // 8
  assert plan.learner["a params"] == base - lm_head + head
  assert plan.learner["b params"] == plan.learner["actor params"] + head  # tied: no LM head
  # With the response log-prob feature the LM head stays (plus one scalar weight, replicated).
  lp = memory_plan(tiny, placement, reward_models=[("c", qwen3, True)])
  assert lp.learner["c params"] == base + head + 4
  with_rms = memory_plan(tiny, placement, reward_models=[("a", qwen3)])
  assert with_rms.learner_peak == memory_plan(tiny, placement).learner_peak + (
      base - lm_head + head)


# ----------------------------------------------------------------------------- RMs in GRPO


def test_ensembles():
  from jaxrl.rewards.model import ensemble
  s = np.array([[1.0, 0.0, 2.0], [3.0, 0.0, -2.0]])  # 2 RMs x 3 completions
  np.testing.assert_allclose(ensemble(s, mode="mean"), [2.0, 0.0, 0.0])
  np.testing.assert_allclose(ensemble(s, mode="min"), [1.0, 0.0, -2.0])
  np.testing.assert_allclose(ensemble(s, mode="mean_minus_std", k=0.5), [1.5, 0.0, -1.0])
  np.testing.assert_allclose(ensemble(s[:1], mode="mean_minus_std", k=3.0), s[0])  # one RM
  from jaxrl.errors import ConfigError
  with pytest.raises(ConfigError, match="reward_model.ensemble='max' is not valid"):
    ensemble(s, mode="max")


def test_running_norm_matches_all_scores_seen():
  from jaxrl.rewards.model import RunningNorm
  rng = np.random.default_rng(0)
  # Two RMs of different scales, normalised each by its own running statistics.
  parts = [np.stack([rng.normal(3.0, 2.0, size=n), rng.normal(-50, 10, size=n)])
           for n in (5, 64, 1, 17)]
  norm = RunningNorm(2)
  for p in parts[:-1]:
    norm.update(p)
  restored = RunningNorm(2)
  restored.set_state(json.loads(json.dumps(norm.get_state())))  # survives the checkpoint
  z = restored.normalize(parts[-1])
  seen = np.concatenate(parts, axis=1)
  np.testing.assert_allclose(restored.mean, seen.mean(1))
  np.testing.assert_allclose(restored.std, seen.std(1))
  np.testing.assert_allclose(z, (parts[-1] - seen.mean(1, keepdims=True)) /
                             seen.std(1, keepdims=True), rtol=1e-5)


def test_completion_inputs_read_the_last_response_token():
  from jaxrl.rewards.model import completion_inputs
  from jaxrl.sampler import Rollout
  # Row 0 stopped at eos (2): the eos is not read. Row 1 ran out of tokens: all of it is.
  ro = Rollout(prompt_ids=np.array([[1, 10, 11], [1, 12, 0]]), prompt_lengths=np.array([3, 2]),
               completion_ids=np.array([[20, 2, 0], [21, 22, 23]]),
               completion_mask=np.array([[1, 1, 0], [1, 1, 1]]), logprobs=np.zeros((2, 3)),
               lengths=np.array([2, 3]), finish_reasons=["stop", "length"],
               prompt_index=np.arange(2), stats={})
  tokens, positions, last, logp_mask = completion_inputs(ro, length=7, pad_id=0, eos_id=2)
  assert tokens.tolist() == [[1, 10, 11, 20, 0, 0, 0], [1, 12, 21, 22, 23, 0, 0]]
  assert last.tolist() == [3, 4] and positions[1].tolist() == list(range(7))
  # 1 where the next token is a response token (the model stops at the last read token)
  assert logp_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]]


def test_grpo_pulse_with_reward_models(repo_root, tmp_path, devices):
  from jaxrl.algorithms import grpo
  from jaxrl.train.rundir import read_metrics
  rm_dir = str(tmp_path / "rm")
  rm.run(config_lib.load_config(os.path.join(repo_root, "configs/rm_tiny.py:runlocal"),
                                ["train.steps=2", "eval.every=0"]), rm_dir, out=lambda *a: None)
  spec = os.path.join(repo_root, "configs/grpo_tiny.py:runlocal")
  # Two RMs (the same run twice), min-ensembled, normalised, mixed at weight 2 with a task
  # reward of weight 0 (logged as accuracy, adds nothing).
  workdir = str(tmp_path / "grpo")
  summary = grpo.run(config_lib.load_config(spec, [
      f"reward_model.checkpoints={rm_dir},{rm_dir}", "reward_model.ensemble=min",
      "reward_model.normalize=True", "reward_model.weight=2.0", "rewards=task:0"]), workdir,
      out=lambda *a: None)
  assert summary["status"] == "completed"
  rows = [r for r in read_metrics(workdir) if "reward/rm_mean" in r]
  assert len(rows) == 2
  for r in rows:
    assert r["reward/rm_0"] == pytest.approx(r["reward/rm_1"])  # the same RM twice
    assert r["reward/rm_mean"] == pytest.approx(r["reward/rm_0"], rel=1e-5)  # min of equals
    assert 0.0 <= r["accuracy"] <= 1.0 and r["timing_s/reward_model"] > 0
    assert r["timing_s/score"] >= r["timing_s/reward_model"]
  # Step 1 normalises by its own batch: the mixed reward is 2 x a z-score, mean 0, std 2
  # (the min of two equal z-scores is that z-score).
  assert rows[0]["reward/mean"] == pytest.approx(0.0, abs=1e-4)
  assert rows[0]["reward/std"] == pytest.approx(2.0, rel=1e-3)
  # The normaliser's running state is checkpointed with the prompt stream.
  data = json.load(open(os.path.join(workdir, "checkpoints", "2", "data",
                                     "process_0-of-1.json")))
  assert data["rm_norm"]["count"] == 2 * 16
  # With async generation the next step's rollout is scored in the background while this step
  # is checkpointed; the checkpoint still holds only the steps it covers.
  workdir = str(tmp_path / "grpo_async")
  grpo.run(config_lib.load_config(spec, [
      f"reward_model.checkpoints={rm_dir}", "reward_model.normalize=True", "rewards=task:0",
      "placement.mode=disaggregated", "rollout.async_generation=True", "train.save_every=1"]),
      workdir,
      out=lambda *a: None)
  for step in (1, 2):
    data = json.load(open(os.path.join(workdir, "checkpoints", str(step), "data",
                                       "process_0-of-1.json")))
    assert data["rm_norm"]["count"] == step * 16, step
  # Unnormalised and RM-only: the reward is weight x the raw score.
  workdir = str(tmp_path / "grpo2")
  grpo.run(config_lib.load_config(spec, [f"reward_model.checkpoints={rm_dir}", "rewards=none",
                                         "reward_model.weight=0.5"]), workdir,
           out=lambda *a: None)
  for r in [r for r in read_metrics(workdir) if "reward/rm_mean" in r]:
    assert r["reward/mean"] == pytest.approx(0.5 * r["reward/rm_mean"], rel=1e-4, abs=1e-6)
    assert 0.0 <= r["accuracy"] <= 1.0  # the task's checker still measures train accuracy


@pytest.mark.parametrize("override, pattern", [
    ("rewards=none", r"rewards='none' and reward_model.checkpoints is empty"),
    ("reward_model.checkpoints=/nonexistent/rm", r"holds no config.json"),
    ("reward_model.ensemble=max", r"reward_model.ensemble='max' is not valid"),
])
def test_bad_reward_model_config_is_one_sentence(repo_root, tmp_path, override, pattern,
                                                 devices):
  from jaxrl.errors import ConfigError
  from jaxrl.algorithms import grpo
  with pytest.raises(ConfigError, match=pattern):
    grpo.run(config_lib.load_config(os.path.join(repo_root, "configs/grpo_tiny.py:runlocal"),
                                    [override]), str(tmp_path / "g"), out=lambda *a: None)


def test_an_sft_run_is_not_a_reward_model(repo_root, tmp_path, devices):
  from jaxrl.errors import ConfigError
  from jaxrl.rewards.model import RewardModels
  d = tmp_path / "sft"
  d.mkdir()
  c = config_lib.load_config(os.path.join(repo_root, "configs/sft_tiny.py"))
  (d / "config.json").write_text(json.dumps(c.to_dict()))
  with pytest.raises(ConfigError, match="is not a reward-model run"):
    RewardModels.load([str(d)], make_mesh(), None)


def test_alarm_watches_the_raw_reward_model_score():
  from jaxrl.algorithms import grpo
  said = []
  alarms = grpo.Alarms(kl_threshold=0.1, window=3, out=said.append,
                       reward_key="reward/rm_mean")
  # The baseline eval comes before any reward; step 1 samples the same starting policy, so its
  # reward becomes the baseline's (here -5.0, not a made-up 0.0).
  assert alarms.on_eval(0, 0.5)["alarm/reward_hacking"] == 0.0
  for step, rm_score in ((1, -5.0), (2, -4.5), (3, -4.0)):
    alarms.on_step(step, {"reward/mean": 0.0, "reward/rm_mean": rm_score, "kl": 0.0})
  assert alarms.evals[0] == (0, -5.0, 0.5)
  assert alarms.on_eval(3, 0.40)["alarm/reward_hacking"] == 1.0  # -5.0 -> -4.5, 0.5 -> 0.4
  # The normalised reward stays flat (mean 0) while the raw RM score climbs: the alarm reads
  # the raw score, so it still sees the proxy rising while held-out accuracy falls.
  for step, rm_score in ((4, -3.0), (5, -2.0), (6, -1.0)):
    alarms.on_step(step, {"reward/mean": 0.0, "reward/rm_mean": rm_score, "kl": 0.0})
  assert alarms.on_eval(6, 0.30)["alarm/reward_hacking"] == 1.0
  assert any("-4.500 -> -2.000" in s and "0.400 -> 0.300" in s for s in said)
  # A negative proxy that does not rise never alarms, however accuracy moves.
  quiet = grpo.Alarms(kl_threshold=0.1, window=3, out=said.append, reward_key="reward/rm_mean")
  quiet.on_eval(0, 0.5)
  for step in (1, 2, 3):
    quiet.on_step(step, {"reward/rm_mean": -5.0 - step, "kl": 0.0})
  assert quiet.on_eval(3, 0.1)["alarm/reward_hacking"] == 0.0


# ----------------------------------------------------------------------------- learning (slow)


@pytest.mark.slow
def test_reward_models_learn_their_labellers(reward_models, bars):
  """From the SFT policy: the honest RM ranks the correct sum above a near miss on held-out
  pairs well above chance; the biased RM learns its labeller's taste at once. Over RM seeds
  0-4 from the fixture's sft_addition policy (lr 1e-3, SFT seed 0), as the fixture trains them
  (`jaxrl rm`, 1 device, AMD EPYC; docs/guides/recipes.md): the honest RM after 600 steps,
  median 0.881 (0.852-0.900) on 512 pairs, up from 0.51-0.53 at step 0 by +0.33 to +0.38, margin
  4.2-4.6 (2026-12-03, Eigen learner dots, sft_addition at 0.895); after 1600 steps, from the
  0.852 sft_addition of YNNPACK dots the same day, 0.812 (0.750-0.834), +0.27 to +0.37, margin
  5.4-6.7, near its plateau by step 400-600, hence 600. Bars 0.70 and a gain of 0.20. (From
  the older lr-3e-3 SFT policy it reached only 0.62: a 2-layer model must redo the sum at the
  last token to tell 46 from 47, and that policy's features did it worse.)
  The biased RM after 100 steps: 1.0 in 5 of 5 seeds; bar 0.95.

  Over the 12 cells of tools/learning_sweep.py (docs/design.md, Testing; 2026-12-07), from the
  committed sft_addition (0.895; the 2026-12-06 sweep retrained it per cell, and its seed-1 draw
  left the honest RM at 0.674-0.732): honest RM 0.844-0.902, gain +0.338 to +0.383, margin
  4.13-4.60; biased RM 1.0 in 12 of 12. Bars (raised from 0.62, 0.10, 0 for the steadier warm
  start): 0.75, a gain of 0.25, margin 2.0, 0.95.

  cells (ISA dots seed: honest RM accuracy; honest RM gain; honest RM margin; biased RM
      accuracy):
  AVX2 eigen 0: +0.900, +0.381, +4.601, +1.000
  AVX2 ynnpack 0: +0.896, +0.377, +4.594, +1.000
  AVX eigen 0: +0.902, +0.383, +4.577, +1.000
  AVX ynnpack 0: +0.902, +0.383, +4.571, +1.000
  AVX2 eigen 1: +0.857, +0.352, +4.151, +1.000
  AVX2 ynnpack 1: +0.857, +0.352, +4.153, +1.000
  AVX eigen 1: +0.844, +0.338, +4.132, +1.000
  AVX ynnpack 1: +0.856, +0.350, +4.151, +1.000
  AVX2 eigen 2: +0.889, +0.355, +4.400, +1.000
  AVX2 ynnpack 2: +0.883, +0.350, +4.402, +1.000
  AVX eigen 2: +0.887, +0.353, +4.411, +1.000
  AVX ynnpack 2: +0.889, +0.355, +4.416, +1.000
  AVX-512 cells (an Intel Xeon with AMX, 2 cores, 2026-12-07; --isa native):
  AVX-512 eigen 0: +0.902, +0.383, +4.657, +1.000
  AVX-512 ynnpack 0: +0.896, +0.377, +4.583, +1.000
  AVX-512 eigen 1: +0.856, +0.350, +4.137, +1.000
  AVX-512 ynnpack 1: +0.859, +0.353, +4.147, +1.000
  AVX-512 eigen 2: +0.893, +0.359, +4.405, +1.000
  AVX-512 ynnpack 2: +0.889, +0.355, +4.425, +1.000"""
  from jaxrl.train.rundir import read_metrics
  honest = json.load(open(os.path.join(reward_models["honest"], "summary.json")))
  start = read_metrics(reward_models["honest"])[0]["eval/accuracy"]
  assert honest["status"] == "completed"
  assert honest["data"]["train"]["fingerprint"].startswith("sha256:")
  biased = json.load(open(os.path.join(reward_models["biased"], "summary.json")))
  bars.above("honest RM accuracy", honest["eval"]["eval/accuracy"], 0.75)
  bars.above("honest RM gain", honest["eval"]["eval/accuracy"] - start, 0.25)
  bars.above("honest RM margin", honest["eval"]["eval/margin"], 2.0)
  bars.above("biased RM accuracy", biased["eval"]["eval/accuracy"], 0.95)
  bars.check()


@pytest.mark.slow
def test_grpo_against_a_biased_reward_model_fires_the_alarm(reward_models, sft_addition,
                                                             tmp_path, bars):
  """Reward hacking, end to end: `jaxrl grpo` from the SFT policy with the biased RM as the
  only reward (the task's checker at weight 0 still logs accuracy). The proxy rises, held-out
  verifiable accuracy falls, and the reward-hacking alarm fires, is printed, is logged in
  metrics.jsonl and is counted in summary.json. Every step is logged: one step's proxy is the
  mean over 16 prompts x 8 samples and moves by ~0.25 from step to step, so the rise is read
  from the first and last 10 steps.

  The policy is pushed hard (lr 2e-4, 4x grpo_tiny's 5e-5, as notebooks/reward_hacking.ipynb
  does), so the outcome does not hang on float rounding. At grpo_tiny's lr the slide was too
  slow to hold: over GRPO seeds 0-4 held-out fell by 0.004-0.070 in 40 steps with YNNPACK
  dots and 0.051-0.191 with Eigen dots, and the proxy fell in 4 of those 10 runs (lr-3e-3
  fixtures). At 2e-4 from the lr-1e-3 fixtures (sft_addition 0.852, biased RM 1.0; one device,
  AMD EPYC, YNNPACK dots, 2026-12-03; docs/guides/recipes.md), over GRPO seeds 0-4 held-out
  fell from 0.82-0.88 to 0.000 by step 40 (most of it by step 10), the proxy's last-10-step
  mean rose by 9.0-9.2 over its first 10, and the alarm fired in 5 of 5 (at 2-3 evals
  each). From the earlier lr-3e-3 fixtures (2026-12-02) the fall was 0.47-0.73 in 12 of 12
  runs. The test asks a fall of 0.5 (below).

  Over the 12 cells of tools/learning_sweep.py (docs/design.md, Testing; 2026-12-07), from the
  committed sft_addition: held-out fell by 0.867-0.926, the proxy rose by 5.7-8.9, and the
  alarm fired in 12 of 12 (the 2026-12-06 sweep, SFT retrained per cell: 0.613-0.891 and
  6.8-9.3). Bars (were -0.2 and 0): a fall of 0.5, a rise of 3.

  cells (ISA dots seed: held-out accuracy change; proxy rise (last 10 steps over the first 10)):
  AVX2 eigen 0: -0.891, +8.603
  AVX2 ynnpack 0: -0.891, +8.537
  AVX eigen 0: -0.891, +8.313
  AVX ynnpack 0: -0.894, +8.905
  AVX2 eigen 1: -0.922, +6.658
  AVX2 ynnpack 1: -0.926, +5.954
  AVX eigen 1: -0.926, +5.879
  AVX ynnpack 1: -0.926, +5.917
  AVX2 eigen 2: -0.867, +5.995
  AVX2 ynnpack 2: -0.867, +6.321
  AVX eigen 2: -0.867, +5.732
  AVX ynnpack 2: -0.867, +6.395
  AVX-512 cells (an Intel Xeon with AMX, 2 cores, 2026-12-07; --isa native):
  AVX-512 eigen 0: -0.891, +8.528
  AVX-512 ynnpack 0: -0.894, +8.143
  AVX-512 eigen 1: -0.926, +6.539
  AVX-512 ynnpack 1: -0.922, +5.891
  AVX-512 eigen 2: -0.859, +6.609
  AVX-512 ynnpack 2: -0.867, +6.481"""
  from jaxrl.train.rundir import read_metrics
  workdir = str(tmp_path / "grpo")
  said = jaxrl_cli(["grpo", "--config", "configs/grpo_tiny.py", "--workdir", workdir] + [
      f"--config.{o}" for o in (
          f"init.checkpoint={sft_addition}", f"reward_model.checkpoints={reward_models['biased']}",
          "rewards=task:0", "optim.lr=2e-4", "train.steps=40", "train.log_every=1",
          "train.save_every=40", "eval.every=10", f"seed={LEARN_SEED}")]).stdout
  rows = read_metrics(workdir)
  evals = [r for r in rows if "eval/accuracy" in r]
  proxy = [r["reward/rm_mean"] for r in rows if "reward/rm_mean" in r]
  assert len(proxy) == 40
  bars.below("held-out accuracy change", evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"],
             -0.5)
  bars.above("proxy rise (last 10 steps over the first 10)",
             np.mean(proxy[-10:]) - np.mean(proxy[:10]), 3.0)
  bars.check()
  assert any(r.get("alarm/reward_hacking") == 1.0 for r in evals)
  assert json.load(open(os.path.join(workdir, "summary.json")))["alarms"]["reward_hacking"] >= 1
  assert "reward hacking" in said


@pytest.mark.slow
def test_grpo_with_a_well_trained_reward_model_beats_sft(rm_logprob, sft_slip, tmp_path, bars):
  """`jaxrl grpo` with a well-trained reward model as its only reward (the task's checker at
  weight 0 only logs accuracy) raises held-out verifiable accuracy above the SFT policy it starts
  from. "Well-trained": the reward model adds its backbone's response log-prob to the last-token
  head (head.logprob_feature) and reaches >= 0.8 held-out pairwise accuracy. The reward model starts
  from the policy SFT'd on random slips, whose backbone prefers the right answer; the policy is the
  one that learnt the dropped carry (sft_slip). Over GRPO seeds 0-4 from these fixtures (RM 0.945
  from the lr-1e-3 sft_addition; sft_slip 0.586 at seed 0), one device, AMD EPYC, YNNPACK dots,
  2026-12-03 (docs/guides/recipes.md; the held-out prompts follow the seed): the mean of steps 60
  and 80 over step 0, median +0.158 (+0.121 to +0.206), seed 0 0.586 -> 0.742 / 0.773. KL is not
  asserted here: at grpo_tiny's lr 5e-5 with this reward it peaked at 0.112-0.151 and the KL alarm
  fired 1-6 times in every seed (held-out still rose).

  Over the 12 cells of tools/learning_sweep.py (docs/design.md, Testing; 2026-12-07), the RM
  trained per cell from the committed sft_addition, the policy the committed sft_slip: log-prob
  RM accuracy 0.959-0.975 (one figure per seed: the RM's training is bit-identical across the
  cells of a seed), gain +0.111 to +0.141 (with sft_slip retrained per cell: +0.094 to +0.190).
  Bars: 0.9 and +0.04.

  cells (ISA dots seed: log-prob RM accuracy; held-out gain (mean of steps 60, 80)):
  AVX2 eigen 0: +0.959, +0.119
  AVX2 ynnpack 0: +0.959, +0.111
  AVX eigen 0: +0.959, +0.119
  AVX ynnpack 0: +0.959, +0.115
  AVX2 eigen 1: +0.975, +0.139
  AVX2 ynnpack 1: +0.975, +0.139
  AVX eigen 1: +0.975, +0.141
  AVX ynnpack 1: +0.975, +0.137
  AVX2 eigen 2: +0.961, +0.117
  AVX2 ynnpack 2: +0.961, +0.111
  AVX eigen 2: +0.961, +0.113
  AVX ynnpack 2: +0.961, +0.121
  AVX-512 cells (an Intel Xeon with AMX, 2 cores, 2026-12-07; --isa native):
  AVX-512 eigen 0: +0.959, +0.121
  AVX-512 ynnpack 0: +0.959, +0.103
  AVX-512 eigen 1: +0.975, +0.137
  AVX-512 ynnpack 1: +0.975, +0.143
  AVX-512 eigen 2: +0.961, +0.119
  AVX-512 ynnpack 2: +0.961, +0.105"""
  from jaxrl.train.rundir import read_metrics
  rm_eval = json.load(open(os.path.join(rm_logprob, "summary.json")))["eval"]
  bars.above("log-prob RM accuracy", rm_eval["eval/accuracy"], 0.9)
  workdir = str(tmp_path / "grpo")
  jaxrl_cli(["grpo", "--config", "configs/grpo_tiny.py", "--workdir", workdir] + [
      f"--config.{o}" for o in (
          f"init.checkpoint={sft_slip}", f"reward_model.checkpoints={rm_logprob}",
          "rewards=task:0", "train.steps=80", "train.log_every=10", "train.save_every=80",
          "eval.every=20", f"seed={LEARN_SEED}")])
  evals = [r["eval/accuracy"] for r in read_metrics(workdir) if "eval/accuracy" in r]
  print("held-out accuracy every 20 steps:", evals)
  assert len(evals) == 5
  bars.above("held-out gain (mean of steps 60, 80)", np.mean(evals[-2:]) - evals[0], 0.04)
  bars.check()
