"""The sampler on 2 (fsdp) x 4 (tensor) fake CPU devices: exactness against a full forward without
cache, logprobs, keys, continuous vs static batching, stopping, weight swaps, per-slot keys and
the streaming driver."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.errors import ConfigError
from jaxrl.models import apply, get_preset, token_logprobs
from jaxrl.parallel import init_params, make_mesh
from jaxrl.sampler import Engine, SamplingParams, generate, sample_logits
from jaxrl.sampler.rollout import generate_stream

# Mixed lengths on purpose: they land in two prefill buckets (16 and 32).
PROMPTS = [[1, 40, 41, 42], [1, 50], [1] + list(range(60, 78)), [1, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def model(devices):
  mesh = make_mesh(1, 2, 4)
  cfg = get_preset("tiny-qwen2")
  graphdef, params = init_params(cfg, mesh, "sampler", seed=0)
  # At init the tied embedding (std 0.02) makes logits nearly flat, so greedy ties would be a
  # matter of float rounding. Scaling the embedding spreads the logits (std ~1) and keeps the
  # argmax well separated, so token-for-token comparisons are meaningful.
  params = dict(params, embed=params["embed"] * 5.0)
  return mesh, cfg, graphdef, params


# graphdef is static (hashable), so every test shares one compile per input shape.
_FORWARD = jax.jit(lambda g, p, t: apply(g, p, t)[0], static_argnums=0)


def _full_logits(graphdef, params, rollout):
  """Logits of one no-cache forward over each prompt + completion, per sample [L, V]."""
  padded = np.zeros((len(rollout.lengths), 64), np.int32)  # one shape for every test
  for s in range(len(rollout.lengths)):
    lp, lc = rollout.prompt_lengths[s], rollout.lengths[s]
    padded[s, :lp + lc] = np.concatenate([rollout.prompt_ids[s, :lp],
                                          rollout.completion_ids[s, :lc]])
  logits = np.asarray(_FORWARD(graphdef, params, jnp.asarray(padded)))
  return [logits[s, lp - 1:lp - 1 + lc]
          for s, (lp, lc) in enumerate(zip(rollout.prompt_lengths, rollout.lengths))]


def test_greedy_equals_argmax_of_full_forward(model):
  mesh, cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(greedy=True, max_new_tokens=20,
                                                               eos_id=None))
  r = generate(engine, params, PROMPTS, n=1, slots=2, steps_per_call=4)
  assert list(r.lengths) == [20] * 4
  gaps = []
  for s, logits in enumerate(_full_logits(graphdef, params, r)):
    # Causal, so argmax at every position of one forward over the greedy sequence is exactly
    # step-by-step greedy decoding without a cache.
    np.testing.assert_array_equal(r.completion_ids[s], logits.argmax(-1), err_msg=f"sample {s}")
    top2 = np.sort(logits, -1)[:, -2:]
    gaps.append(top2[:, 1] - top2[:, 0])
  assert np.min(np.concatenate(gaps)) > 1e-4  # no near-ties: the comparison above is decisive


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward_before_truncation(model, temperature):
  mesh, cfg, graphdef, params = model
  sp = SamplingParams(temperature=temperature, top_k=40, top_p=0.9, max_new_tokens=12)
  engine = Engine(graphdef, cfg, mesh, sampling=sp)
  r = generate(engine, params, PROMPTS, n=2, slots=4, seed=3)
  for s, logits in enumerate(_full_logits(graphdef, params, r)):
    lc = r.lengths[s]
    ref, _ = token_logprobs(jnp.asarray(logits)[None], jnp.asarray(r.completion_ids[s, :lc])[None],
                            temperature=temperature)
    np.testing.assert_allclose(r.logprobs[s, :lc], np.asarray(ref)[0], atol=2e-5, rtol=1e-5)
    assert np.all(r.logprobs[s, lc:] == 0) and np.all(r.completion_mask[s, lc:] == 0)
  # top_k=40 and top_p=0.9 did truncate, yet the logprobs above are the untruncated ones
  # (renormalised over the kept set they would be larger and the comparison would fail).
  assert r.stats["tokens_generated"] == int(r.lengths.sum())


def test_group_samples_differ_and_seeds_reproduce(model):
  mesh, cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=8, eos_id=None))
  a = generate(engine, params, PROMPTS[:2], n=4, slots=4, seed=11)
  for i in range(2):
    group = [tuple(a.completion_ids[i * 4 + g]) for g in range(4)]
    assert len(set(group)) == 4, f"prompt {i}: the group's samples are not all different"
  b = generate(engine, params, PROMPTS[:2], n=4, slots=4, seed=11)
  np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  c = generate(engine, params, PROMPTS[:2], n=4, slots=4, seed=12)
  assert (a.completion_ids != c.completion_ids).any(axis=1).all()  # every sample changes
  # Group insert prefills each prompt once; prefilling per sample draws the very same samples.
  d = generate(engine, params, PROMPTS[:2], n=4, slots=4, seed=11, share_prefix=False)
  np.testing.assert_array_equal(a.completion_ids, d.completion_ids)
  assert a.stats["prefill_prompts"] == 2 and d.stats["prefill_prompts"] == 8


def test_continuous_batching_equals_static_batching(model):
  mesh, cfg, graphdef, params = model
  prompts = PROMPTS + [[1, 90, 91], [1, 33, 34, 35, 36], [1, 120], [1, 5, 5, 5, 5, 5, 5, 5, 5]]
  # Many stop ids (every 7th) give the samples mixed lengths, so slots free up at different
  # times; the sampled case also shows the draws do not depend on slot or step.
  stops = tuple(range(0, 512, 7))
  for sp in (SamplingParams(greedy=True, max_new_tokens=24, stop_ids=stops),
             SamplingParams(max_new_tokens=24, stop_ids=stops)):
    engine = Engine(graphdef, cfg, mesh, sampling=sp)
    cont = generate(engine, params, prompts, n=1, slots=2, steps_per_call=4, seed=5)
    static = generate(engine, params, prompts, n=1, slots=8, continuous=False, seed=5)
    assert len(set(cont.lengths.tolist())) > 2, "lengths are not mixed; the test shows nothing"
    assert cont.stats["prefill_calls"] > 2  # slots were refilled while others still decoded
    for field in ("completion_ids", "completion_mask", "lengths"):
      np.testing.assert_array_equal(getattr(cont, field), getattr(static, field), err_msg=field)
    np.testing.assert_allclose(cont.logprobs, static.logprobs, atol=2e-5)
    assert cont.finish_reasons == static.finish_reasons


def test_stop_tokens_and_max_new_tokens(model):
  mesh, cfg, graphdef, params = model
  stops = tuple(range(200, 260))
  sp = SamplingParams(max_new_tokens=10, eos_id=2, stop_ids=stops)
  r = generate(Engine(graphdef, cfg, mesh, sampling=sp), params, PROMPTS, n=4, slots=8, seed=1)
  stop_set = set(stops) | {2}
  assert "stop" in r.finish_reasons and "length" in r.finish_reasons
  for s, reason in enumerate(r.finish_reasons):
    c = r.completion_ids[s, :r.lengths[s]].tolist()
    assert 1 <= len(c) <= 10
    assert not stop_set & set(c[:-1]), f"sample {s} ran past a stop token"
    if reason == "stop":
      assert c[-1] in stop_set
    else:
      assert len(c) == 10 and c[-1] not in stop_set
  # max_new_tokens=1: every sample ends with the token drawn from the prefill.
  one = generate(Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=1)), params,
                 PROMPTS, n=2, slots=2)
  assert list(one.lengths) == [1] * 8 and one.stats["decode_steps"] == 0


def test_weight_swap_changes_outputs_without_recompiling(model):
  mesh, cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(greedy=True, max_new_tokens=8,
                                                               eos_id=None))
  a = generate(engine, params, PROMPTS, n=1, slots=4)
  traces = dict(engine.traces)
  # two length buckets: prefill and insert trace once per prefix shape; the decode state's
  # init compiles once per (slots, max_len), not once per rollout
  assert traces == {"prefill": 2, "insert": 2, "generate": 1, "init": 1}
  _, other = init_params(cfg, mesh, "sampler", seed=1)
  b = generate(engine, other, PROMPTS, n=1, slots=4)
  assert dict(engine.traces) == traces, "swapping params recompiled a phase"
  assert (a.completion_ids != b.completion_ids).any()
  c = generate(engine, params, PROMPTS, n=1, slots=4)  # and back: the same outputs again
  np.testing.assert_array_equal(a.completion_ids, c.completion_ids)
  assert dict(engine.traces) == traces


def test_engine_contract_single_steps_equal_the_scan(model):
  mesh, cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=16, eos_id=None))
  key = jax.random.key(0)
  tokens = np.zeros((2, 16), np.int32)
  tokens[0, :4], tokens[1, :2] = PROMPTS[0], PROMPTS[1]
  prefix = engine.prefill(params, tokens, [4, 2], key)

  def run(single):
    state = engine.init_decode_state(4, 32)
    state, first = engine.insert(prefix, state, 3, row=1)
    # Same row and sample as prefill's own draw: the same first token.
    assert int(first["tokens"][0]) == int(prefix["tokens"][1])
    state, _ = engine.insert_group(prefix, state, [0, 1, 2], row=0, samples=[5, 6, 7])
    if single:
      steps = []
      for _ in range(5):
        state, out = engine.generate(params, state, key)
        steps.append(out["tokens"])
      return np.stack(steps)
    state, out = engine.generate_steps(params, state, key, steps=5)
    return np.asarray(out["tokens"])

  np.testing.assert_array_equal(run(True), run(False))


@pytest.mark.parametrize("paged", [False, True])
def test_per_slot_keys_equal_one_key_and_two_seeds_share_a_call(model, paged):
  """Engine.generate with key=None draws each slot's tokens from the key its prefix was made
  with: with one key everywhere, the tokens of a call given that key; with two prefixes of two
  keys in one state, each slot's tokens are those of its prefix's key alone."""
  mesh, cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=16, eos_id=None))
  tokens = np.zeros((2, 16), np.int32)
  tokens[0, :4], tokens[1, :2] = PROMPTS[0], PROMPTS[1]
  key_a, key_b = jax.random.key(3), jax.random.key(4)
  prefix_a = engine.prefill(params, tokens, [4, 2], key_a)
  prefix_b = engine.prefill(params, tokens, [4, 2], key_b)

  def run(prefixes, key):
    if paged:
      state = engine.init_paged_state(4, 32, pages=16, page_size=4)
    else:
      state = engine.init_decode_state(4, 32)
    for slots, prefix in zip(([0, 1], [2, 3]), prefixes):
      state, _ = engine.insert_group(prefix, state, slots, row=0, samples=[0, 1])
    state, out = engine.generate_steps(params, state, key, steps=6)
    return np.asarray(out["tokens"])

  one_key = run([prefix_a, prefix_a], key_a)
  np.testing.assert_array_equal(run([prefix_a, prefix_a], None), one_key)
  mixed = run([prefix_a, prefix_b], None)
  np.testing.assert_array_equal(mixed[:, :2], one_key[:, :2])
  np.testing.assert_array_equal(mixed[:, 2:], run([prefix_b, prefix_b], key_b)[:, 2:])
  assert (mixed[:, 2:] != one_key[:, 2:]).any(), "the two keys drew the same tokens"


@pytest.mark.parametrize("cache", ["dense", "paged", "paged-tight", "paged-tight-reserve"])
def test_streaming_units_equal_each_unit_sampled_alone(model, cache):
  """generate_stream admits a unit's groups into slots as they free up, beside the previous
  unit's long completions; each unit is generate()'s dense rollout for its seed, token for
  token. Paged: one pool for every unit (enough for every slot; or 16 pages of 4 positions: 8
  slots at their longest need 8 x 14: optimistic admission preempts, reserve admits fewer).
  Dense: the window is narrowed when the longest live sequence leaves (Engine.narrow), and the
  tokens stay generate()'s."""
  mesh, cfg, graphdef, params = model
  kv = {"dense": {}, "paged": dict(kv_cache="paged", page_size=4),
        "paged-tight": dict(kv_cache="paged", page_size=4, kv_pages=16),
        "paged-tight-reserve": dict(kv_cache="paged", page_size=4, kv_pages=16,
                                    kv_admission="reserve")}[cache]
  # Mixed lengths (2 to the 24-token cap), so slots free up at different times.
  stops = tuple(range(0, 512, 17))
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=24,
                                                                stop_ids=stops))
  units = [(PROMPTS[:2], 11), (PROMPTS[2:], 12), ([[1, 90, 91], [1, 33, 34]], 13)]
  opened = []

  def next_unit(wait):
    if len(opened) == len(units):
      return None
    opened.append(wait)
    prompts, seed = units[len(opened) - 1]
    return len(opened) - 1, prompts, seed

  out = list(generate_stream(engine, next_unit, weights=lambda: (7, params), n=3, slots=8,
                             steps_per_call=4, max_prompt_len=32, **kv))
  assert [tag for tag, _ in out] == [0, 1, 2]
  assert opened[1:] == [False, False], "a unit waited for the slots to empty: no streaming"
  stats = [r.stats for _, r in out]
  assert {st["kv_cache"] for st in stats} == {kv.get("kv_cache", "dense")}
  if cache == "dense":  # a long completion left while shorter ones went on: the window narrowed
    assert engine.traces["narrow"] > 0, "the window was never narrowed"
  if cache == "paged-tight":
    assert sum(st["kv_preemptions"] for st in stats) > 0, "the pool never ran short"
    assert max(st["kv_pages_peak"] for st in stats) <= 16
  if cache == "paged-tight-reserve":
    assert sum(st["kv_preemptions"] for st in stats) == 0
    assert max(st["live_peak"] for st in stats) < 8, "reserve admitted every slot"
  for (tag, got), (prompts, seed) in zip(out, units):
    alone = generate(engine, params, prompts, n=3, slots=8, steps_per_call=4, seed=seed,
                     max_prompt_len=32)
    for field in ("completion_ids", "completion_mask", "lengths", "prompt_ids"):
      np.testing.assert_array_equal(getattr(got, field), getattr(alone, field), err_msg=field)
    np.testing.assert_allclose(got.logprobs, alone.logprobs, atol=2e-5)
    assert got.finish_reasons == alone.finish_reasons
    assert set(got.versions[got.completion_mask > 0].tolist()) == {7}
  lengths = np.concatenate([r.lengths for _, r in out])
  assert len(set(lengths.tolist())) > 2, "lengths are not mixed; the test shows nothing"


def test_sampling_truncations():
  logits = jnp.asarray([[0.0, 3.0, 2.9, -1.0, 1.0]] * 64)
  keys = jax.random.split(jax.random.key(0), 64)
  for sp in (SamplingParams(top_k=1), SamplingParams(top_p=0.01), SamplingParams(min_p=0.99)):
    tok, _ = sample_logits(logits, keys, sp)
    assert set(np.asarray(tok).tolist()) == {1}, sp
  tok, logp = sample_logits(logits, keys, SamplingParams(top_k=2, temperature=0.5))
  assert set(np.asarray(tok).tolist()) == {1, 2}  # both survivors drawn, nothing else
  ref = jax.nn.log_softmax(logits[0] / 0.5)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(ref)[np.asarray(tok)], rtol=1e-6)
  with pytest.raises(ConfigError, match=r"sampling.top_p=1.5 is not valid"):
    SamplingParams(top_p=1.5)


def test_draws_follow_the_distribution_and_never_pick_masked_tokens():
  """The inverse-CDF draw: empirical frequencies match softmax within 5 standard errors, and
  zero-probability tokens (top-k masked, or -inf, in blocks of their own and between live ones)
  are never drawn. V = 512 spans 16 blocks of 32."""
  n, V = 40_000, 512
  logits = np.full((V,), -np.inf, np.float32)
  live = {3: 0.0, 4: 1.0, 40: 2.0, 41: -1.0, 300: 0.5, 511: 1.5}  # blocks 0, 1, 9, 15
  for t, v in live.items():
    logits[t] = v
  logits_nv = jnp.broadcast_to(jnp.asarray(logits), (n, V))
  keys = jax.random.split(jax.random.key(1), n)
  tok, logp = jax.jit(lambda k, x: sample_logits(x, k, SamplingParams()))(keys, logits_nv)
  tok = np.asarray(tok)
  assert set(tok.tolist()) == set(live)  # every live token drawn, nothing else
  want = np.asarray(jax.nn.softmax(jnp.asarray(logits)))
  freq = np.bincount(tok, minlength=V) / n
  stderr = np.sqrt(want * (1 - want) / n)
  assert np.all(np.abs(freq - want) <= 5 * stderr + 1e-12), (freq[list(live)], want[list(live)])
  np.testing.assert_allclose(np.asarray(logp), np.log(want[tok]), rtol=1e-5)
  # top-k masking: only the two best (blocks 1 and 15) survive
  tok2, _ = sample_logits(logits_nv[:4000], keys[:4000], SamplingParams(top_k=2))
  assert set(np.asarray(tok2).tolist()) == {40, 511}


def test_the_tpu_form_of_the_draw_picks_the_same_tokens():
  """sample_logits with mxu=True (the TPU decode step's draw: block sums as a product, the
  log-probs' max taken from their log-sum-exp) against the default: the same tokens and
  bit-equal log-probs over 4,096 rows at two temperatures, with -inf entries (never drawn)."""
  n, V = 4096, 1024
  logits = 3 * jax.random.normal(jax.random.key(2), (n, V), jnp.float32)
  logits = logits.at[:, 64:96].set(-jnp.inf).at[::3, 5].set(-jnp.inf)
  keys = jax.random.split(jax.random.key(3), n)
  for temperature in (0.7, 1.5):
    sp = SamplingParams(temperature=temperature)
    draw = jax.jit(lambda k, x, mxu: sample_logits(x, k, sp, mxu=mxu), static_argnums=2)
    tok, logp = draw(keys, logits, False)
    tok_mxu, logp_mxu = draw(keys, logits, True)
    np.testing.assert_array_equal(np.asarray(tok_mxu), np.asarray(tok))
    np.testing.assert_array_equal(np.asarray(logp_mxu), np.asarray(logp))
    tok = np.asarray(tok)
    assert not ((tok >= 64) & (tok < 96)).any() and not (tok[::3] == 5).any()
    assert len(set(tok.tolist())) > 500  # the draws spread over the vocabulary


def test_sample_command_writes_and_prints_completions(tmp_path, capsys, repo_root, devices):
  import json
  import os

  from jaxrl import cli
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "12+34="}\n\n{"prompt": "reverse abc:", "answer": "cba"}\n')
  cli.main(["sample", "--config", os.path.join(repo_root, "configs/sample_tiny.py"),
            "--prompts", str(prompts), "--n", "3", "--workdir", str(tmp_path / "run"),
            "--config.sampling.max_new_tokens=6", "--config.sampling.slots=8"])
  out = capsys.readouterr().out
  rows = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
  assert len(rows) == 6 and [r["prompt_index"] for r in rows] == [0, 0, 0, 1, 1, 1]
  for r in rows:
    n_tok = len(r["completion_ids"])
    assert 1 <= n_tok <= 6 and (n_tok == 6 or r["finish_reason"] == "eos")
    assert r["prompt_ids"][0] == 1 and r["prompt_text"] == r["prompt"]  # bos + bytes
    assert len(r["logprobs"]) == len(r["completion_ids"]) and all(lp <= 0 for lp in r["logprobs"])
    assert f"{r['prompt']!r} -> {r['completion']!r}" in out
  assert "6 completions (2 prompts x 3)" in out
  summary = json.load(open(tmp_path / "run" / "summary.json"))
  assert summary["sampler/tokens_generated"] == sum(len(r["completion_ids"]) for r in rows)
  # The run dir records the backend as every command's does (jaxrl.train.rundir).
  config = json.load(open(tmp_path / "run" / "config.json"))
  assert config["sampling"]["slots"] == 8 and config["backend"] == summary["backend"]


@pytest.mark.parametrize("content, args, pattern", [
    ('{"prompt": "a"}\n{"prompt": 3}\n', [], r"prompts.jsonl line 2: field 'prompt' is a int, "
     r"not a string"),
    ('{"prompt": "a"}\nnot json\n', [], r"prompts.jsonl line 2: the row is not valid JSON"),
    ('\n', [], r"prompts.jsonl is empty"),
    ('{"prompt": "a"}\n', ["--checkpoint", "no/such/run"], r"--checkpoint='no/such/run' does "
     r"not exist"),
    ('{"prompt": "a"}\n', ["--config.sampling.top_p=0"], r"sampling.top_p=0.0 is not valid"),
    ('{"prompt": "a"}\n', ["--config.sampling.mode=beam"], r"sampling.mode='beam' is not valid"),
])
def test_sample_command_bad_input_is_one_sentence(tmp_path, capsys, repo_root, content, args,
                                                  pattern):
  import os
  import re

  from jaxrl import cli
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(content)
  with pytest.raises(SystemExit) as e:
    cli.main(["sample", "--config", os.path.join(repo_root, "configs/sample_tiny.py"),
              "--prompts", str(prompts), "--workdir", str(tmp_path / "run"), *args])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert re.search(pattern, err), err


def test_single_slot_decode_compiles_for_matrix_vector_products(model):
  """On CPU a shard holding one slot decodes under EIGEN_DOTS (no YNNPACK fusions, which
  are slower for matrix-vector products); its tokens equal the default compile's, and its
  logprobs agree to fp32 rounding (the kernels differ, so the sums round differently)."""
  _, cfg, graphdef, _ = model
  mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
  _, params = init_params(cfg, mesh, "sampler", seed=0)
  params = dict(params, embed=params["embed"] * 5.0)
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=12, eos_id=None))
  key = jax.random.key(3)
  prefix = engine.prefill(params, np.asarray([PROMPTS[0] + [0] * 12]), [4], key)

  def run(steps_fn):
    state, _ = engine.insert(prefix, engine.init_decode_state(1, 32), 0)
    assert engine._decode(state) is engine._steps_gemv
    _, out = steps_fn(params, state, key, steps=10)
    return np.asarray(out["tokens"]), np.asarray(out["logprobs"])

  gemv_tokens, gemv_logp = run(engine._steps_gemv)
  tokens, logp = run(engine._steps)
  assert engine._steps_gemv is not engine._steps
  np.testing.assert_array_equal(gemv_tokens, tokens)
  np.testing.assert_allclose(gemv_logp, logp, atol=1e-5)
  state = engine.init_decode_state(4, 32)
  assert engine._decode(state) is engine._steps  # several slots per shard: the default compile


def test_data_parallel_decoding_needs_no_communication(model, devices):
  """Slots sharded over the data axis decode independently: the compiled decode scan holds no
  collective. (The cache write as c.at[arange(B), :, pos].set(...) compiled to two all-gathers
  per write; on a multi-host mesh each is a round trip between hosts.)"""
  _, cfg, graphdef, _ = model
  mesh = make_mesh(8, 1, 1)
  _, params = init_params(cfg, mesh, "sampler", seed=0)
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=12, eos_id=None))
  state = engine.init_decode_state(16, 32)
  hlo = engine._steps.lower(params, state, jax.random.key(0), steps=4).compile().as_text()
  assert "dot(" in hlo  # the real decode program
  for op in ("all-gather(", "all-reduce(", "all-to-all(", "collective-permute(",
             "reduce-scatter("):
    assert op not in hlo, op


def test_cache_window_grows_and_a_slot_at_its_end_waits(model):
  """A cache window narrower than the sequence: a slot whose next write would pass its end
  stalls (its outputs are invalid and its state waits) and resumes after Engine.grow, with the
  same tokens as a full-width cache. Inserting a prefix wider than the window is an error."""
  mesh, cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(greedy=True, max_new_tokens=40,
                                                               eos_id=None))
  key = jax.random.key(1)
  tokens = np.zeros((2, 16), np.int32)
  tokens[0, :4], tokens[1, :2] = PROMPTS[0], PROMPTS[1]
  prefix = engine.prefill(params, tokens, [4, 2], key)

  def run(length):
    state = engine.init_decode_state(2, 48, length=length)
    state, _ = engine.insert_many(prefix, state, rows=[0, 1], slots=[0, 1], samples=[0, 1])
    state, a = engine.generate_steps(params, state, key, steps=20)
    state = engine.grow(state, 48)
    state, b = engine.generate_steps(params, state, key, steps=20)
    return [(np.asarray(o["tokens"]), np.asarray(o["logprobs"]), np.asarray(o["valid"]))
            for o in (a, b)]

  full, narrow = run(48), run(16)
  # Window 16: slot 0's first token sits at position 4, so it writes 4..15 (12 steps) and waits;
  # slot 1's sits at 2 (14 steps). With the full window both run all 20 steps.
  assert narrow[0][2].sum(0).tolist() == [12, 14]
  assert full[0][2].sum(0).tolist() == [20, 20]
  for slot, n in ((0, 12 + 20), (1, 14 + 20)):
    def tokens_of(run):
      return np.concatenate([t[v[:, slot], slot] for t, _, v in run]), \
             np.concatenate([lp[v[:, slot], slot] for _, lp, v in run])
    (nt, nlp), (ft, flp) = tokens_of(narrow), tokens_of(full)
    assert len(nt) == n and len(ft) == 20 + 19  # max_new_tokens is 40, the first from prefill
    np.testing.assert_array_equal(nt, ft[:n], err_msg=f"slot {slot}")
    np.testing.assert_allclose(nlp, flp[:n], atol=1e-5)
  with pytest.raises(ValueError, match="grow the state first"):
    engine.insert(engine.prefill(params, np.zeros((1, 32), np.int32), [20], key),
                  engine.init_decode_state(2, 48, length=16), 0)


def test_grow_cache_off_allocates_the_whole_cache_once(model):
  """generate(grow_cache=False) decodes in one full-width window (one decode compile), with the
  same greedy tokens as the growing window."""
  mesh, cfg, graphdef, params = model
  sp = SamplingParams(greedy=True, max_new_tokens=40, eos_id=None)
  grown, whole = Engine(graphdef, cfg, mesh, sampling=sp), Engine(graphdef, cfg, mesh, sampling=sp)
  a = generate(grown, params, PROMPTS[:2], n=1, slots=2, steps_per_call=8)
  b = generate(whole, params, PROMPTS[:2], n=1, slots=2, steps_per_call=8, grow_cache=False)
  np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
  assert whole.traces["generate"] == 1 and "grow" not in whole.traces
  assert grown.traces["generate"] > 1 and grown.traces["grow"] >= 1
