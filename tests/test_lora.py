"""LoRA (model.lora; jaxrl.models.lora): the adapters in the model, the tree helpers, and
every trainer taking them with the base frozen."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from conftest import assert_model_flops_per_token
from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.models import Transformer, abstract_model, apply, apply_logprobs, get_preset
from jaxrl.models import lora
from jaxrl.models.config import LORA_WEIGHTS, lora_fields
from jaxrl.algorithms.grpo.update import batch_logprobs

ALL = LORA_WEIGHTS


def _lora_cfg(preset="tiny-qwen3", rank=4, alpha=8.0, targets=ALL, **kw):
  return get_preset(preset).replace(lora_rank=rank, lora_alpha=alpha, lora_targets=targets,
                                    **kw)


def _split(cfg, seed=3):
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(seed))))
  return graphdef, nnx.to_pure_dict(state)


def _tokens(cfg, B=3, T=12):
  return jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)


def _randomise_b(params, seed=7, scale=0.05):
  """The params with every lora_b drawn at random (at init they are zeros, which would hide
  any mistake in the adapter's term)."""
  keys = iter(jax.random.split(jax.random.key(seed), 64))

  def walk(node, inside):
    return {k: walk(v, inside or str(k).endswith("_lora")) if isinstance(v, dict) else
            (scale * jax.random.normal(next(keys), v.shape, v.dtype)
             if inside and k == "lora_b" else v) for k, v in node.items()}
  return walk(params, False)


# ----------------------------------------------------------------------------- config


def test_lora_section_to_model_config():
  c = config_lib.base_config()
  assert config_lib.model_config(c).lora_rank == 0  # off by default
  assert config_lib.model_config(c).lora_targets == ()
  c.model.lora.rank = 8
  cfg = config_lib.model_config(c)
  assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) == (8, 16.0, ("q", "k", "v", "o"))
  c.model.lora.targets = "all-linear"
  assert config_lib.model_config(c).lora_targets == ALL
  c.model.lora.targets = "v, q ,down"  # a comma list, kept in the model's order
  assert config_lib.model_config(c).lora_targets == ("q", "v", "down")
  assert lora_fields({"rank": "4", "alpha": 32})["lora_alpha"] == 32.0  # sweep text, an int


@pytest.mark.parametrize("section,words", [
    ({"rank": 4, "targets": "mlp"}, "model.lora.targets names 'mlp'"),
    ({"rank": -1}, "model.lora.rank must be 0"),
    ({"rank": 4, "dropout": 1.0}, "model.lora.dropout must be in [0, 1)"),
    ({"rank": 4, "alpha": 0.0}, "model.lora.alpha must be positive"),
    ({"rank": 2.5}, "model.lora.rank=2.5 has the wrong type"),
    ({"rank": 4, "scale": 2.0}, "model.lora.scale is not a LoRA key"),
])
def test_bad_lora_section_is_one_sentence(section, words):
  c = config_lib.base_config()
  c.model.lora = ml_collections.ConfigDict(section)
  with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(")
                     .replace(")", r"\)")):
    config_lib.model_config(c)


def test_lora_param_count_and_paths():
  cfg = _lora_cfg()
  _, shapes, axes = abstract_model(cfg)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  assert n == cfg.num_params  # the count from the shapes alone includes the adapters
  _, adapters = lora.split_lora(shapes)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters)) == cfg.num_lora_params
  attn, mlp = shapes["layers"][1]["attn"], shapes["layers"][1]["mlp"]
  d, n_h, k_h, h, f, r = 128, 4, 2, 32, 384, 4
  assert attn["q_lora"]["lora_a"].shape == (d, r) and attn["q_lora"]["lora_b"].shape == (r, n_h * h)
  assert attn["k_lora"]["lora_b"].shape == (r, k_h * h)
  assert attn["o_lora"]["lora_a"].shape == (n_h * h, r)
  assert mlp["down_lora"]["lora_a"].shape == (f, r) and mlp["down_lora"]["lora_b"].shape == (r, d)
  # Logical axes of the weight they adapt, so the layouts shard them alike.
  assert axes["layers"][0]["attn"]["q_lora"]["lora_b"] == (None, "heads")
  assert axes["layers"][0]["mlp"]["down_lora"]["lora_a"] == ("mlp", None)
  assert lora.is_lora_path(("layers", 0, "attn", "q_lora", "lora_a"))
  assert lora.is_lora_path("layers/0/attn/q_lora/lora_a")
  assert not lora.is_lora_path(("layers", 0, "attn", "q"))


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen2", "tiny-llama3"])
def test_adapters_at_init_leave_logits_bitwise_equal(preset):
  """B = 0 at init: the adapted model's logits are the base model's, bit for bit, and the
  base weights are the ones a plain model of the same seed gets."""
  cfg0 = get_preset(preset)
  cfg = _lora_cfg(preset)
  g0, p0 = _split(cfg0)
  g, p = _split(cfg)
  base, adapters = lora.split_lora(p)
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(p0), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  bs = [x for path, x in jax.tree_util.tree_flatten_with_path(adapters)[0]
        if path[-1].key == "lora_b"]
  assert len(bs) == cfg.num_layers * len(ALL) and not any(np.any(np.asarray(b)) for b in bs)
  toks = _tokens(cfg)
  np.testing.assert_array_equal(np.asarray(apply(g, p, toks)[0]),
                                np.asarray(apply(g0, p0, toks)[0]))


def test_merge_lora_is_base_plus_scaled_ba():
  cfg = _lora_cfg(alpha=12.0)
  g, p = _split(cfg)
  p = _randomise_b(p)
  merged = lora.merge_lora(cfg, p)
  layer, merged_layer = p["layers"][1], merged["layers"][1]
  scale = 12.0 / 4
  for mod, name in (("attn", "q"), ("attn", "k"), ("attn", "o"), ("mlp", "down")):
    w, ad = layer[mod][name], layer[mod][f"{name}_lora"]
    want = np.asarray(w) + scale * (np.asarray(ad["lora_a"]) @ np.asarray(ad["lora_b"])).reshape(
        w.shape)
    np.testing.assert_allclose(np.asarray(merged_layer[mod][name]), want, rtol=1e-6, atol=1e-7)
    assert merged_layer[mod][name].dtype == w.dtype
  assert not lora.has_lora(merged)
  # Untouched weights are the params' own arrays.
  assert merged["embed"] is p["embed"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_model_logits_equal_adapted(dtype):
  cfg = _lora_cfg(param_dtype=dtype)
  g, p = _split(cfg)
  p = _randomise_b(p)
  toks = _tokens(cfg)
  adapted = np.asarray(apply(g, p, toks)[0])
  base_cfg = lora.base_config(cfg)
  gm, _ = _split(base_cfg)
  merged = lora.merge_lora(cfg, p)
  assert merged["layers"][0]["attn"]["q"].dtype == jnp.dtype(dtype)
  got = np.asarray(apply(gm, merged, toks)[0])
  if dtype == "float32":
    np.testing.assert_allclose(got, adapted, atol=2e-5, rtol=1e-5)
  # The adapters really change the function (so the equality above says something).
  plain = np.asarray(apply(gm, lora.split_lora(p)[0], toks)[0])
  assert np.abs(plain - adapted).max() > 100 * np.abs(got - adapted).max() or dtype != "float32"
  if dtype == "bfloat16":  # rounding of bf16 weights: merged and adapted agree to it
    assert np.abs(got - adapted).max() < 0.1 * np.abs(plain - adapted).max()


def test_adapters_off_is_the_base():
  cfg = _lora_cfg()
  g, p = _split(cfg)
  p = _randomise_b(p)
  off = lora.adapters_off(p)
  # The same base arrays (no copy), new zero adapters (never the policy's own, which a train
  # step donates).
  assert off["layers"][0]["attn"]["q"] is p["layers"][0]["attn"]["q"]
  for name in ("lora_a", "lora_b"):
    x = off["layers"][0]["attn"]["q_lora"][name]
    assert x is not p["layers"][0]["attn"]["q_lora"][name] and not np.any(np.asarray(x))
  toks = _tokens(cfg)
  gb, _ = _split(lora.base_config(cfg))
  np.testing.assert_array_equal(np.asarray(apply(g, off, toks)[0]),
                                np.asarray(apply(gb, lora.split_lora(p)[0], toks)[0]))


def test_decode_with_adapters_equals_full_forward():
  """The sampler's paths (prefill, then one-token decode steps over several slots, which fuse
  q/k/v and gate/up) add the adapters' terms as the full forward does."""
  from jaxrl.models import init_cache
  cfg = _lora_cfg()
  g, p = _split(cfg)
  p = _randomise_b(p)
  B, T = 3, 8
  toks = _tokens(cfg, B, T)
  full = np.asarray(apply(g, p, toks)[0])
  cache = init_cache(cfg, B, T)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  _, cache = apply(g, p, toks[:, :5], pos[:, :5], cache=cache)
  for t in range(5, T):
    logits, cache = apply(g, p, toks[:, t:t + 1], pos[:, t:t + 1], cache=cache)
    np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], atol=1e-4, rtol=1e-4)


def _rows(cfg, B=4, T=10):
  toks = _tokens(cfg, B, T)
  return {"inputs": toks, "targets": jnp.roll(toks, -1, 1),
          "positions": jnp.broadcast_to(jnp.arange(T), (B, T))}


def _adapter_grads(cfg, p, batch):
  g, _ = _split(cfg)
  w = jax.random.normal(jax.random.key(5), batch["targets"].shape)
  base, adapters = lora.split_lora(p)

  def loss(ad):
    logp, ent = batch_logprobs(g, lora.combine(base, ad), batch, 0.9)
    return jnp.sum(w * logp) + 0.1 * jnp.sum(w * ent)
  return jax.jit(jax.value_and_grad(loss))(adapters)


def _close(a, b, tol=1e-5):
  (va, ga), (vb, gb) = a, b
  np.testing.assert_allclose(float(va), float(vb), rtol=1e-6)
  scale = max(float(np.abs(np.asarray(y)).max()) for y in jax.tree.leaves(gb))
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol * scale)


@pytest.mark.parametrize("remat", ["full", "dots_with_no_batch_dims_saveable"])
def test_remat_with_adapters_gives_the_same_gradients(remat):
  cfg = _lora_cfg()
  _, p = _split(cfg)
  p = _randomise_b(p)
  batch = _rows(cfg)
  want = _adapter_grads(cfg, p, batch)
  assert max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(want[1])) > 0
  _close(_adapter_grads(cfg.replace(remat=remat), p, batch), want)


def test_chunked_logprobs_with_adapters():
  """Above chunk_min_vocab the LM head runs in chunks: the adapters' gradients are those of
  the unchunked head (tiny vocabulary forced over the threshold, 10 positions in chunks of 4)."""
  cfg = _lora_cfg(vocab_size=700)
  _, p = _split(cfg)
  p = _randomise_b(p)
  batch = _rows(cfg)
  chunked = cfg.replace(chunk_min_vocab=700, logits_chunk=4)
  assert chunked.chunked_logits and not cfg.chunked_logits
  _close(_adapter_grads(chunked, p, batch), _adapter_grads(cfg, p, batch))


def test_dropout_drops_only_with_a_key():
  """model.lora.dropout acts in a train step's forward (a dropout key given) and never at eval
  (no key): the log-probs with no key are the plain ones, with a key they differ, and the same
  key gives the same values (a resumed step replays)."""
  cfg = _lora_cfg(lora_dropout=0.5)
  g, p = _split(cfg)
  p = _randomise_b(p, scale=0.5)
  b = _rows(cfg)
  g_off, _ = _split(cfg.replace(lora_dropout=0.0))
  plain = apply_logprobs(g_off, p, b["inputs"], b["targets"], b["positions"])[0]
  no_key = apply_logprobs(g, p, b["inputs"], b["targets"], b["positions"])[0]
  np.testing.assert_array_equal(np.asarray(no_key), np.asarray(plain))
  k = jax.random.key(11)
  one = apply_logprobs(g, p, b["inputs"], b["targets"], b["positions"], dropout_key=k)[0]
  two = apply_logprobs(g, p, b["inputs"], b["targets"], b["positions"], dropout_key=k)[0]
  np.testing.assert_array_equal(np.asarray(one), np.asarray(two))
  assert float(jnp.abs(one - plain).max()) > 1e-3


# ----------------------------------------------------------------------------- trainers


def _cli(command, config, workdir, overrides):
  from jaxrl import cli
  cli.main([command, "--config", config, "--workdir", str(workdir),
            *[f"--config.{k}={v}" for k, v in overrides.items()]])


def _state(workdir, config_file, overrides, *, model=None):
  """(fresh init state, the run's latest checkpointed state) of a run of config_file with
  overrides (its ModelConfig's LoRA included)."""
  from jaxrl.parallel import mesh_from_config
  from jaxrl.train import Checkpointer, init_train_state, make_optimizer
  from jaxrl.train.checkpoint import abstract_state
  config = config_lib.load_config(config_file, [f"{k}={v}" for k, v in overrides.items()])
  cfg = config_lib.model_config(config)
  mesh = mesh_from_config(config.mesh)
  tx, _ = make_optimizer(config.optim, config.train.steps)
  _, fresh, shardings = init_train_state(cfg, mesh, tx, seed=config.seed, model=model)
  ckpt = Checkpointer(str(workdir / "checkpoints"))
  state, _ = ckpt.restore(abstract_state(jax.eval_shape(lambda: fresh), shardings))
  ckpt.close()
  return jax.device_get(fresh), jax.device_get(state)


def _assert_only_adapters_moved(before, after, *, also=()):
  """The frozen base is bitwise the starting one; every adapter's lora_b (and each sub-tree
  named in `also`) moved."""
  base0, ad0 = lora.split_lora(before)
  base1, ad1 = lora.split_lora(after)
  extra = {k: base1.pop(k) for k in also}
  for k in also:
    base0.pop(k)
  for x, y in zip(jax.tree.leaves(base0), jax.tree.leaves(base1), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  moved = [float(np.abs(np.asarray(y) - np.asarray(x)).max()) for (p, x), y in zip(
      jax.tree_util.tree_flatten_with_path(ad0)[0], jax.tree.leaves(ad1)) if p[-1].key == "lora_b"]
  assert moved and min(moved) > 0
  for k in also:
    assert float(np.abs(np.asarray(extra[k]) - np.asarray(before[k])).max()) > 0


def _opt_paths(state):
  return {tuple(str(getattr(k, "key", k)) for k in p)
          for p, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]}


SFT = "configs/sft_tiny.py:runlocal"
SFT_LORA = {"model.lora.rank": 4, "model.lora.targets": "all-linear", "model.lora.alpha": 8.0,
            "model.lora.dropout": 0.1, "optim.lr": 1e-2, "train.steps": 8,
            "train.save_every": 2, "train.log_every": 1, "eval.every": 8}


@pytest.mark.slow
def test_lora_sft_trains_only_adapters_and_resumes_exactly(repo_root, tmp_path, devices,
                                                           monkeypatch):
  """A LoRA SFT run: the base stays bitwise as it started, the optimizer state holds the
  adapters' moments only; a run stopped by SIGTERM mid-run and resumed ends bitwise equal
  to an uninterrupted one (dropout's key included: fold_in(key, step))."""
  import os
  import signal

  from jaxrl.train import read_metrics
  import jaxrl.algorithms.sft as sft
  monkeypatch.chdir(repo_root)
  full, cut = tmp_path / "full", tmp_path / "cut"
  _cli("sft", SFT, full, SFT_LORA)
  fresh, a = _state(full, SFT, SFT_LORA)
  assert a.train_only == () and int(a.step) == 8
  _assert_only_adapters_moved(fresh.params, a.params)
  # Adam's moments (and nothing else param-shaped) only for the adapters.
  n_adapters, n_all = lora.count(a.params)
  n_opt = sum(int(np.size(x)) for x in jax.tree.leaves(a.opt_state))
  assert 2 * n_adapters <= n_opt < 2 * n_adapters + 16 and n_adapters < n_all // 10

  real = sft.sft_batches

  def stopping(*args, **kw):  # SIGTERM to this process while the 6th batch is read
    it = real(*args, **kw)

    class Stop:
      n = 0

      def __iter__(self):
        return self

      def __next__(self):
        Stop.n += 1
        if Stop.n == 4:
          os.kill(os.getpid(), signal.SIGTERM)
        return next(it)

      def get_state(self):
        return it.get_state()

      def set_state(self, s):
        it.set_state(s)
    return Stop()
  monkeypatch.setattr(sft, "sft_batches", stopping)
  _cli("sft", SFT, cut, SFT_LORA)
  monkeypatch.setattr(sft, "sft_batches", real)
  import json
  stopped = json.load(open(cut / "summary.json"))
  assert stopped["status"] == "interrupted" and 2 <= stopped["step"] < 8
  _cli("sft", SFT, cut, SFT_LORA)
  _, b = _state(cut, SFT, SFT_LORA)
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params,
                                                                             b.opt_state))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  la = [m["loss"] for m in read_metrics(str(full)) if "loss" in m]
  lb = [m["loss"] for m in read_metrics(str(cut)) if "loss" in m]
  assert la == lb and la[-1] < la[0]
  # The logged model FLOPs: a forward and a backward that takes no weight gradients of the
  # frozen base, two forwards' worth (three without LoRA).
  config = config_lib.load_config(SFT, [f"{k}={v}" for k, v in SFT_LORA.items()])
  for m in read_metrics(str(full))[1:]:
    assert_model_flops_per_token(m, config_lib.model_config(config), config.data.seq_len, 2)


@pytest.mark.slow
def test_lora_reward_model_trains_adapters_and_head(repo_root, tmp_path, devices, monkeypatch):
  import functools

  from jaxrl.models import RewardModel
  monkeypatch.chdir(repo_root)
  over = {"model.lora.rank": 4, "train.steps": 4, "train.save_every": 4, "eval.every": 4,
          "optim.lr": 1e-2, "optim.warmup_steps": 1}
  _cli("rm", "configs/rm_tiny.py:runlocal", tmp_path, over)
  fresh, state = _state(tmp_path, "configs/rm_tiny.py:runlocal", over,
                        model=functools.partial(RewardModel, logprob_feature=False))
  assert state.train_only == ("head",)
  _assert_only_adapters_moved(fresh.params, state.params, also=("head",))
  # Adam's moments: the adapters' and the head's, none of the backbone's base.
  backbone = [p for p in _opt_paths(state) if "backbone" in p]
  assert backbone and all(lora.is_lora_path(p) for p in backbone)
  assert any("head" in p for p in _opt_paths(state))


def test_dropout_is_refused_where_no_key_reaches_the_model(repo_root, tmp_path, monkeypatch):
  monkeypatch.chdir(repo_root)
  for command, config in (("rm", "configs/rm_tiny.py:runlocal"),
                          ("grpo", "configs/grpo_tiny.py:runlocal")):
    with pytest.raises(ConfigError, match=r"model.lora.dropout=0.1 is not supported by .*set "
                       r"model.lora.dropout=0\."):
      config_ = config_lib.load_config(config, ["model.lora.rank=4", "model.lora.dropout=0.1"])
      if command == "rm":
        from jaxrl.algorithms import rm
        rm.run(config_, str(tmp_path / command), out=lambda *_: None)
      else:
        from jaxrl.algorithms.grpo import trainer
        trainer._check(config_)


@pytest.mark.slow
def test_lora_dpo_live_reference_is_the_base(repo_root, tmp_path, devices, monkeypatch):
  """DPO with LoRA and a live reference: the reference is the base with adapters off, which
  shares the policy's frozen base (the step never donates it, or this run would fail reading
  a deleted array); only the adapters move."""
  monkeypatch.chdir(repo_root)
  over = {"model.lora.rank": 4, "model.lora.dropout": 0.1, "ref.mode": "live",
          "train.steps": 2, "train.save_every": 2, "eval.every": 0, "optim.lr": 1e-2}
  _cli("dpo", "configs/dpo_tiny.py:runlocal", tmp_path, over)
  fresh, state = _state(tmp_path, "configs/dpo_tiny.py:runlocal", over)
  _assert_only_adapters_moved(fresh.params, state.params)


@pytest.mark.slow
def test_lora_grpo_from_a_lora_sft_run(repo_root, tmp_path, devices, monkeypatch):
  """GRPO with LoRA from a LoRA SFT run: the SFT adapters are merged into the base, the
  reference is that base with adapters off (the same arrays, not a copy), two GRPO steps
  leave the base as it was, and resumed for a third the reference shares the restored base."""
  from jaxrl.train.run import Run
  monkeypatch.chdir(repo_root)
  sft_dir = tmp_path / "sft"
  sft_over = {**SFT_LORA, "train.steps": 2, "train.save_every": 2, "eval.every": 0}
  _cli("sft", SFT, sft_dir, sft_over)
  sft_cfg = config_lib.model_config(config_lib.load_config(
      SFT, [f"{k}={v}" for k, v in sft_over.items()]))
  _, sft_state = _state(sft_dir, SFT, sft_over)
  want_base = lora.merge_lora(sft_cfg, sft_state.params)

  # What the GRPO loop starts from: its state and its step's parts (the reference).
  real_train, seen = Run.train, []

  def train(self, state, step_fn, *a, **kw):
    ref = step_fn.args[0].learner.reference
    seen.append({"start": self.start, "params": jax.device_get(state.params),
                 "shared": ref["layers"][1]["mlp"]["down"] is state.params["layers"][1][
                     "mlp"]["down"],
                 "ref_adapters": jax.device_get(lora.split_lora(ref)[1])})
    return real_train(self, state, step_fn, *a, **kw)
  monkeypatch.setattr(Run, "train", train)

  grpo, run_dir = "configs/grpo_tiny.py:runlocal", tmp_path / "grpo"
  over = {"model.lora.rank": 8, "model.lora.alpha": 16.0, "init.checkpoint": str(sft_dir),
          "optim.lr": 1e-2, "eval.every": 0}
  _cli("grpo", grpo, run_dir, over)
  first = seen[0]
  assert first["start"] == 0 and first["shared"]
  assert not any(np.any(x) for x in jax.tree.leaves(first["ref_adapters"]))
  base, adapters = lora.split_lora(first["params"])
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(want_base), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
  assert adapters["layers"][0]["attn"]["q_lora"]["lora_a"].shape == (128, 8)

  _cli("grpo", grpo, run_dir, {**over, "train.steps": 3})  # resumes at step 2
  second = seen[1]
  assert second["start"] == 2 and second["shared"]
  # The base is as it started (whether the adapters moved depends on the rewards of two
  # steps of a barely trained policy; the learning test below is the one that trains them).
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(lora.split_lora(second["params"])[0]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- memory plan


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_lora_plan_is_within_15_percent_of_xla_on_cpu(repo_root, devices, name):
  """The tiny LoRA programs (rank 8 on every linear weight), planned and compiled on 8 CPU
  devices: the run's peak and the train step's within 15% of XLA's memory_analysis()
  (measured: SFT -2.4%, RM +3.8%, DPO -4.6%, GRPO -1.4% for the run's peak), and the LoRA
  train step holds the base once, with gradients and Adam moments for the adapters alone."""
  from jaxrl.parallel import compile as aot
  from jaxrl.parallel.plan import abstract_bytes, estimate
  from jaxrl.algorithms import grpo
  from jaxrl.algorithms import sft
  module = {"sft": sft, "grpo": grpo}[name]
  over = ["model.lora.rank=8", "model.lora.targets=all-linear"]
  config = config_lib.load_config(f"{repo_root}/configs/{name}_tiny.py", over, module.CHOICES)
  _, programs = module.programs(config)
  estimates = [estimate(p) for p in programs]
  compiled = [aot.compile_program(p) for p in programs]
  plan, xla = aot.run_peaks(programs, estimates, compiled)
  assert abs(plan - xla) / xla < 0.15, (plan, xla)
  assert abs(estimates[0].program_peak - compiled[0].bytes) / compiled[0].bytes < 0.15
  trained_state, frozen, _ = programs[0].args
  adapters = abstract_bytes(trained_state.params)
  assert not lora.split_lora(frozen)[1] and lora.split_lora(trained_state.params)[0] == {}
  assert abstract_bytes(trained_state.opt_state) < 2 * adapters + 64  # Adam's two moments
  if name == "sft":  # XLA's own count: the LoRA step's temporaries are below the full one's
    _, full = module.programs(config_lib.load_config(f"{repo_root}/configs/{name}_tiny.py", [],
                                                     module.CHOICES))
    assert compiled[0].temp < aot.compile_program(full[0]).temp
  else:  # the reference's own bytes: its zero adapters, the base is shared
    ref = programs[0].resident["reference params"]
    assert ref == abstract_bytes(lora.split_lora(trained_state.params)[1])


def test_lora_roles_count_the_base_once(devices):
  """The roles table (jaxrl plan): gradients, moments and the reference's own params are the
  adapters' bytes; the actor's params are base + adapters."""
  from jaxrl.parallel.plan import Workload, memory_plan
  from jaxrl.parallel.sync import make_placement
  cfg = _lora_cfg("tiny", rank=8)
  placement = make_placement(ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1)))
  roles = memory_plan(cfg, placement, workload=Workload(reference=True)).learner
  plain = memory_plan(lora.base_config(cfg), placement, workload=Workload(reference=True)).learner
  from jaxrl.parallel.plan import tree_bytes_per_device
  _, shapes, axes = abstract_model(cfg)
  adapters = tree_bytes_per_device(lora.split_lora(shapes)[1], lora.split_lora(axes)[1],
                                   placement.learner)
  assert roles["actor gradients"] == roles["reference params"] == adapters
  assert adapters < plain["actor gradients"] // 2  # (lora_b is replicated over fsdp)
  assert roles["actor optimizer state"] == 2 * roles["actor gradients"]
  assert roles["actor params"] - plain["actor params"] == roles["actor gradients"]


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("spec,lr_full", [("qwen3.py:8b,grpo,v5e", None),
                                          ("llama3.py:3.1-8b,sft,v5p", None)])
def test_ready_made_lora_variants(repo_root, spec, lr_full):
  full = config_lib.load_config(f"{repo_root}/configs/{spec}")
  c = config_lib.load_config(f"{repo_root}/configs/{spec},lora")
  cfg = config_lib.model_config(c)
  assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) == (16, 32.0, ALL)
  assert cfg.param_dtype == "bfloat16" and cfg.dtype == "bfloat16"  # the frozen base in bf16
  assert c.optim.lr == pytest.approx(10 * full.optim.lr)
  assert cfg.num_lora_params < 0.01 * cfg.num_params


def test_lora_starts_from_a_hf_checkpoint(repo_root, devices):
  """configs/qwen3.py:fixture,lora's starting state: the Hugging Face checkpoint fills the base
  (bitwise as read without LoRA), the adapters keep their init (B = 0), and the optimizer
  state covers the adapters alone."""
  from jaxrl.io.hf import load_hf
  from jaxrl.parallel import mesh_from_config
  from jaxrl.train import init_train_state, make_optimizer
  from jaxrl.train.state import start_from_hf
  config = config_lib.load_config(f"{repo_root}/configs/qwen3.py:fixture,lora")
  cfg = config_lib.model_config(config)
  assert cfg.lora_rank == 16 and cfg.param_dtype == "float32"  # the fixture keeps float32
  mesh = mesh_from_config(config.mesh)
  tx, _ = make_optimizer(config.optim, config.train.steps)
  _, state, _ = init_train_state(cfg, mesh, tx, seed=config.seed)
  state = start_from_hf(config, state, mesh)
  _, _, hf = load_hf(config.model.hf_path, mesh)  # the checkpoint as a plain model reads it
  base, adapters = lora.split_lora(jax.device_get(state.params))
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(jax.device_get(hf)), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  bs = [x for p, x in jax.tree_util.tree_flatten_with_path(adapters)[0] if p[-1].key == "lora_b"]
  assert bs and not any(np.any(np.asarray(b)) for b in bs)
  assert adapters["layers"][0]["mlp"]["down_lora"]["lora_a"].shape == (cfg.mlp_dim, 16)
  assert all(lora.is_lora_path(p) for p in _opt_paths(state) if "layers" in p)


# ----------------------------------------------------------------------------- learning


@pytest.mark.slow
def test_lora_grpo_raises_heldout_accuracy_above_sft(tmp_path, sft_slip, bars):
  """GRPO with LoRA (rank 8, alpha 16, every linear weight: 38,912 trained parameters, 7.8%
  of the model's 498,304) from the demo's SFT policy, 40 steps at lr 1.5e-4 with the task's
  verifier, one CPU device as a user's run: held-out greedy accuracy rises clearly above the
  SFT starting point with KL below the alarm (0.1) and the base untouched.

  Measured (2026-12-03, the 2-core AMD EPYC, from the sft_slip then trained in the suite; the
  held-out prompts follow the seed): seed 0 0.586 -> 0.758 (+0.172, KL max 0.066), seed 1 0.606 ->
  0.773 (+0.168, 0.022), seed 2 0.641 -> 0.719 (+0.078, 0.022); 45-75 s each. At lr 2.5e-4 and 5e-4
  the gain was larger (+0.20, +0.21 at seed 0) but KL reached 0.106 and 0.116 and raised the alarm.

  Over the 12 cells of tools/learning_sweep.py (docs/design.md, Testing; 2026-12-07), from the
  committed sft_slip, the four ISA x dot-kernel cells of each seed gave the same figures to the last
  digit (GRPO from one checkpoint is bit-identical under both dot kernels and both ISA levels on
  this AMD EPYC, as jaxrl/backends/cpu/dots.py found), so the spread is the three seeds': gain
  +0.055 to +0.125, KL max 0.017-0.055. Bars: +0.03 (the sweep before, sft_slip retrained per cell,
  went down to +0.051) and KL 0.1, the alarm's.

  cells (ISA dots seed: held-out gain; KL max):
  AVX2 eigen 0: +0.105, +0.055
  AVX2 ynnpack 0: +0.105, +0.055
  AVX eigen 0: +0.105, +0.055
  AVX ynnpack 0: +0.105, +0.055
  AVX2 eigen 1: +0.125, +0.022
  AVX2 ynnpack 1: +0.125, +0.022
  AVX eigen 1: +0.125, +0.022
  AVX ynnpack 1: +0.125, +0.022
  AVX2 eigen 2: +0.055, +0.017
  AVX2 ynnpack 2: +0.055, +0.017
  AVX eigen 2: +0.055, +0.017
  AVX ynnpack 2: +0.055, +0.017
  AVX-512 cells (an Intel Xeon with AMX, 2 cores, 2026-12-07; --isa native):
  AVX-512 eigen 0: +0.105, +0.055
  AVX-512 ynnpack 0: +0.105, +0.055
  AVX-512 eigen 1: +0.125, +0.022
  AVX-512 ynnpack 1: +0.125, +0.022
  AVX-512 eigen 2: +0.055, +0.017
  AVX-512 ynnpack 2: +0.055, +0.017"""
  import json
  from conftest import LEARN_SEED, jaxrl_cli
  workdir = tmp_path / "grpo_lora"
  over = {"model.lora.rank": 8, "model.lora.alpha": 16.0, "model.lora.targets": "all-linear",
          "optim.lr": 1.5e-4, "train.steps": 40, "train.log_every": 10,
          "train.save_every": 40, "eval.every": 40, "init.checkpoint": sft_slip,
          "seed": LEARN_SEED}
  jaxrl_cli(["grpo", "--config", "configs/grpo_tiny.py", "--workdir", str(workdir),
             *[f"--config.{k}={v}" for k, v in over.items()]], devices=1)
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  start = next(r["eval/accuracy"] for r in rows if r["step"] == 0)
  summary = json.load(open(workdir / "summary.json"))
  end = summary["eval"]["eval/accuracy"]
  assert summary["step"] == 40
  bars.above("held-out gain", end - start, 0.03)
  bars.below("KL max", summary["kl/max"], 0.1)
  bars.check()
  assert summary["alarms"]["kl"] == 0
  cfg = config_lib.model_config(config_lib.load_config(
      "configs/grpo_tiny.py", [f"{k}={v}" for k, v in over.items() if k != "init.checkpoint"]))
  assert cfg.num_lora_params <= 0.1 * (cfg.num_params - cfg.num_lora_params)


def test_sample_and_eval_read_a_lora_run_without_naming_its_adapters(repo_root, tmp_path,
                                                                     devices, monkeypatch,
                                                                     capsys):
  """`jaxrl sample` / `eval --checkpoint RUN` of a LoRA run take the run's model.lora from its
  config.json (as PEFT reads adapter_config.json): the completions equal those of a config
  that names the same adapters by hand, and a config with other adapters still gets
  check_structure's one sentence."""
  import json
  import os

  from jaxrl import cli
  monkeypatch.chdir(repo_root)
  run = tmp_path / "run"
  _cli("sft", SFT, run, {**SFT_LORA, "train.steps": 2, "train.save_every": 2,
                         "eval.every": 0})
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "12+34="}\n{"prompt": "7+8="}\n')
  sample = ["sample", "--config", "configs/sample_tiny.py", "--prompts", str(prompts),
            "--checkpoint", str(run), "--config.sampling.mode=greedy", "--n", "1",
            "--config.sampling.max_new_tokens=4"]
  capsys.readouterr()
  cli.main(sample + ["--workdir", str(tmp_path / "adopted")])
  assert "trained LoRA adapters (rank 4): using its model.lora" in capsys.readouterr().out
  named = [f"--config.model.lora.{k.split('.')[-1]}={v}" for k, v in SFT_LORA.items()
           if k.startswith("model.lora.")]
  cli.main(sample + named + ["--workdir", str(tmp_path / "named")])
  read = lambda d: [json.loads(x)["completion_ids"] for x in open(tmp_path / d /
                                                                  "completions.jsonl")]
  assert read("adopted") == read("named") and len(read("adopted")) == 2
  with pytest.raises(SystemExit) as e:
    cli.main(sample + ["--config.model.lora.rank=2", "--workdir", str(tmp_path / "other")])
  assert e.value.code == 2 and "--checkpoint" in capsys.readouterr().err
  data = tmp_path / "test.jsonl"
  data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
  cli.main(["eval", "--config", SFT, "--checkpoint", str(run), "--data", str(data),
            "--workdir", str(tmp_path / "eval"), "--config.eval.reward=exact_match"])
  assert "using its model.lora" in capsys.readouterr().out
  assert os.path.isfile(tmp_path / "eval" / "eval.json")
