"""The paged KV cache (jaxrl/sampler/paged.py) against the dense one: the same samples token
for token on a tiny preset and the HF fixtures, shared prompt pages, freeing, a tight page
budget under either admission (with preemption), and bad settings. Runs on the 8 fake CPU
devices, fsdp 2 x tensor 4 like tests/test_sampler.py."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.errors import ConfigError
from jaxrl.io import hf
from jaxrl.models import get_preset
from jaxrl.parallel import init_params, make_mesh
from jaxrl.sampler import Engine, SamplingParams, generate, metrics, paged

# Mixed lengths in one prefill bucket (one compile): partial last pages (page_size 4), a prompt
# of exactly two pages (8 tokens), and one of three.
PROMPTS = [[1, 40, 41, 42], [1, 50], [1] + list(range(60, 71)), [1, 7, 8, 9, 10, 11, 12, 13]]
# Mixed completion lengths (so slots free at different times), most of them the full 20 tokens,
# so that a pool below every live sample's worst case runs out of pages.
STOPS = tuple(range(3, 512, 23))
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


@pytest.fixture(scope="module")
def mesh(devices):
  return make_mesh(1, 2, 4)


@pytest.fixture(scope="module")
def model(mesh):
  cfg = get_preset("tiny-qwen2")
  graphdef, params = init_params(cfg, mesh, "sampler", seed=0)
  # Spread the logits (see tests/test_sampler.py) so greedy ties are not float rounding.
  return cfg, graphdef, dict(params, embed=params["embed"] * 5.0)


def _same(dense, pg):
  for field in ("completion_ids", "completion_mask", "lengths"):
    np.testing.assert_array_equal(getattr(pg, field), getattr(dense, field), err_msg=field)
  np.testing.assert_allclose(pg.logprobs, dense.logprobs, atol=2e-5)
  assert pg.finish_reasons == dense.finish_reasons


@pytest.fixture(scope="module")
def budget(model, mesh):
  """An engine, and its dense rollout of 3 samples per prompt over 4 slots: the reference the
  paged rollouts under a page budget must equal."""
  cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=20, stop_ids=STOPS))
  dense = generate(engine, params, PROMPTS, n=3, slots=4, steps_per_call=4, seed=5,
                   grow_cache=False)  # one decode compile
  lengths = dense.lengths.tolist()
  assert len(set(lengths)) > 2 and lengths.count(20) > 4, "lengths do not test the budget"
  return engine, dense


def _paged(engine, params, admission):
  # 20 pages of 4 positions: a dense cache at max_len takes 4 x 9, so 4 live samples at their
  # longest need more than the pool holds.
  return generate(engine, params, PROMPTS, n=3, slots=4, steps_per_call=4, seed=5,
                  kv_cache="paged", page_size=4, kv_pages=20, kv_admission=admission)


def test_paged_rollout_equals_dense_token_for_token_within_a_page_budget(model, budget):
  """"reserve" admission: the driver reserves each sample's worst case, so fewer than the 4
  slots are live at once, and no slot waits for a page or is preempted."""
  engine, dense = budget
  pg = _paged(engine, model[2], "reserve")
  _same(dense, pg)
  st = pg.stats
  assert st["kv_cache"] == "paged" and st["kv_pages"] == 20 and st["page_wait_calls"] == 0
  assert 0 < st["kv_pages_peak"] <= 20 and st["kv_preemptions"] == 0
  assert st["live_peak"] < 4 == dense.stats["live_peak"]
  assert dense.stats["kv_positions_peak"] > 0
  m = metrics(pg)
  assert m["sampler/kv_pages"] == 20 and m["sampler/kv_pages_peak"] == st["kv_pages_peak"]
  assert m["sampler/live_peak"] == st["live_peak"] and "sampler/kv_pages" not in metrics(dense)
  assert m["sampler/kv_preemptions"] == 0 and "sampler/kv_preemptions" not in metrics(dense)


def test_optimistic_admission_preempts_and_the_rollout_is_still_the_dense_one(model, budget):
  """"optimistic" admission (the default) on the same pool: every slot is filled on its
  prompt's pages, the live samples outgrow the pool, the newest are preempted (their pages
  freed, their tokens dropped) and generated again from their prompts: the same tokens and
  log-probs as the dense rollout, since a token's key is fold_in(seed, sample, token)."""
  engine, dense = budget
  pg = _paged(engine, model[2], "optimistic")
  _same(dense, pg)
  st = pg.stats
  assert st["kv_admission"] == "optimistic" and st["kv_preemptions"] > 0
  assert st["kv_preempted_tokens"] > 0 and st["page_wait_calls"] == 0
  assert st["live_peak"] == 4 and st["kv_pages_peak"] <= 20
  assert metrics(pg)["sampler/kv_preemptions"] == st["kv_preemptions"]
  # Every preempted sample came back whole: as many tokens as the dense run generated.
  assert st["tokens_generated"] == dense.stats["tokens_generated"]


def test_decoding_without_the_joined_weights_samples_the_same_tokens(model, mesh, budget):
  """The decode step's q, k, v, gate and up as one product per weight (the TPU and GPU
  engines' choice, jaxrl.backends.joins_decode_weights) instead of one against the joined q, k
  and v weights and one against gate and up stacked (the CPU's): the same samples token for
  token, dense and paged, under the same seed."""
  cfg, graphdef, params = model
  engine, dense = budget
  assert engine.join_weights
  three = Engine(graphdef, cfg, mesh, sampling=engine.sampling)
  three.join_weights = False
  _same(dense, generate(three, params, PROMPTS, n=3, slots=4, steps_per_call=4, seed=5,
                        grow_cache=False))
  _same(dense, _paged(three, params, "reserve"))


def test_the_tpu_form_of_the_draw_samples_the_same_tokens(model, mesh, budget):
  """The decode step's draw and rotary half swap in the TPU's form (Engine.mxu,
  jaxrl.backends.decode_on_matrix_unit: block sums and the swap as products, one pass over V
  fewer): the dense rollout's samples token for token, dense and paged, under the same
  seed."""
  cfg, graphdef, params = model
  engine, dense = budget
  assert not engine.mxu  # the CPU's form
  mxu = Engine(graphdef, cfg, mesh, sampling=engine.sampling)
  mxu.mxu = True
  _same(dense, generate(mxu, params, PROMPTS, n=3, slots=4, steps_per_call=4, seed=5,
                        grow_cache=False))
  _same(dense, _paged(mxu, params, "reserve"))


def test_heads_major_projections_sample_the_same_tokens(model, mesh, budget):
  """The sampler's q, k and v weights in the TPU's form (Engine.decode_params with
  Engine.heads_major, jaxrl.backends.heads_major_projections: stored [heads, H, D]), read by
  the TPU's decode step (one product per weight, the draw on the matrix unit) over the paged
  cache and by the CPU's (the joined product) over the dense one: the dense rollout's samples
  token for token."""
  cfg, graphdef, params = model
  engine, dense = budget
  assert not engine.heads_major and engine.decode_params(params) is params  # the CPU's form
  tpu = Engine(graphdef, cfg, mesh, sampling=engine.sampling)
  tpu.heads_major, tpu.join_weights, tpu.mxu = True, False, True
  tpu_params = tpu.decode_params(params)
  attn, before = tpu_params["layers"][1]["attn"], params["layers"][1]["attn"]
  assert attn["q"].shape == (cfg.num_heads, cfg.head_dim, cfg.embed_dim)
  assert attn["k"].shape == attn["v"].shape == (cfg.num_kv_heads, cfg.head_dim, cfg.embed_dim)
  assert attn["o"] is before["o"] and tpu_params["embed"] is params["embed"]
  _same(dense, _paged(tpu, tpu_params, "reserve"))
  _same(dense, generate(engine, tpu_params, PROMPTS, n=3, slots=4, steps_per_call=4, seed=5,
                        grow_cache=False))


def test_bad_paged_settings_are_one_sentence(model, mesh):
  cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=8))
  with pytest.raises(ConfigError, match=r"rollout.kv_cache='ring' is not valid"):
    generate(engine, params, PROMPTS, kv_cache="ring")
  with pytest.raises(ConfigError, match=r"rollout.kv_admission='eager' is not valid"):
    generate(engine, params, PROMPTS, kv_cache="paged", kv_admission="eager")
  # Either admission needs a pool that holds one sample alone: 16 + 8 positions take 6 pages of
  # 4, not 3.
  for admission in ("optimistic", "reserve"):
    with pytest.raises(ConfigError, match=r"rollout.kv_pages=3 cannot hold one sequence"):
      generate(engine, params, PROMPTS, slots=4, kv_cache="paged", page_size=4, kv_pages=3,
               kv_admission=admission)


def test_a_group_shares_its_prompt_pages_and_frees_them_when_done(model, mesh):
  cfg, graphdef, params = model
  sp = SamplingParams(greedy=True, max_new_tokens=6)
  engine = Engine(graphdef, cfg, mesh, sampling=sp)
  state = engine.init_paged_state(4, 32, pages=20, page_size=4)
  tokens = np.zeros((1, 16), np.int32)
  tokens[0, :10] = np.arange(1, 11)  # 10 tokens: 2 full pages and a partial one
  prefix = engine.prefill(params, tokens, np.array([10]), jax.random.key(0))
  state, first = engine.insert_group(prefix, state, [0, 2, 3])
  assert not first["done"].any()
  table = np.asarray(state["pages"])
  refs = np.asarray(state["refs"])
  # The two full pages are the same for the 3 slots and held 3 times (never copied); each slot
  # has its own copy of the partial page; slot 1 holds nothing.
  assert (table[[0, 2, 3], :2] == table[0, :2]).all() and (refs[table[0, :2]] == 3).all()
  own = table[[0, 2, 3], 2]
  assert len(set(own.tolist())) == 3 and (refs[own] == 1).all()
  assert (table[1] == -1).all() and (table[:, 3:] == -1).all()
  assert engine.pages_in_use(state) == 2 + 3
  # The shared pages hold the prompt's keys: page j, offset o is prompt position 4j + o (the
  # pool is [K, N, P, H]).
  keys = np.asarray(state["cache"][0][0])
  prompt_keys = np.asarray(prefix["kv"][0][0])[0]  # [K, T, H]
  np.testing.assert_array_equal(keys[:, table[0, 1]], prompt_keys[:, 4:8])
  np.testing.assert_array_equal(keys[:, own[1], :2], prompt_keys[:, 8:10])
  # Preempting slot 2 frees its own page; the shared ones stay for slots 0 and 3.
  state = engine.evict(state, [2])
  refs = np.asarray(state["refs"])
  assert engine.pages_in_use(state) == 2 + 2 and refs[own[1]] == 0
  assert (refs[table[0, :2]] == 2).all() and (np.asarray(state["pages"])[2] == -1).all()
  assert not np.asarray(state["live"])[2]
  # Decoding past position 11 takes one new page per live slot; 6 tokens finish both, and
  # then every page is free again.
  state, out = engine.generate_steps(params, state, jax.random.key(0), steps=5)
  done = np.asarray(out["done"]).any(0)
  assert done[[0, 3]].all() and not done[2] and not np.asarray(out["valid"])[:, 2].any()
  assert int(np.asarray(out["pages_used"]).max()) == 2 + 2 + 2
  assert engine.pages_in_use(state) == 0 and (np.asarray(state["pages"]) == -1).all()


def test_allocate_hands_out_the_lowest_free_pages_in_request_order():
  refs = jnp.array([1, 0, 2, 0, 0, 1], jnp.int32)
  for method in ("scan", "compare_all"):  # the default, and the decode step's
    page, granted = paged.allocate(refs, jnp.array([True, False, True, True, True]),
                                   method=method)
    # Free pages are 1, 3, 4: requests 0, 2, 3 get them in order, request 4 gets none (N = 6).
    np.testing.assert_array_equal(page, [1, 6, 3, 4, 6])
    np.testing.assert_array_equal(granted, [True, False, True, True, False])
  refs2, table = paged.release(paged.hold(refs, page, 1), jnp.array([[1, 3], [4, -1]]),
                               jnp.array([True, False]))
  np.testing.assert_array_equal(refs2, [1, 0, 2, 0, 1, 1])
  np.testing.assert_array_equal(table, [[-1, -1], [4, -1]])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_paged_equals_dense_on_the_hf_fixtures(devices, family):
  # One device: the sharded paths run in the tiny preset's tests above, and this one compiles
  # in half the time.
  mesh = make_mesh(1, 1, 1, devices=devices[:1])
  cfg, graphdef, params = hf.load_hf(os.path.join(FIXTURES, family), mesh, "sampler")
  # Greedy on qwen3 (the tiny preset's test samples), sampled on the others.
  sampling = SamplingParams(greedy=family == "qwen3", max_new_tokens=12)
  engine = Engine(graphdef, cfg, mesh, sampling=sampling)
  prompts = [[3, 17, 29, 41, 5], [7, 11], [2] + list(range(30, 40))]
  dense = generate(engine, params, prompts, n=2, slots=4, steps_per_call=4, seed=3,
                   grow_cache=False)  # one decode compile
  pg = generate(engine, params, prompts, n=2, slots=4, steps_per_call=4, seed=3,
                kv_cache="paged", page_size=4)
  assert pg.stats["kv_pages"] == 4 * -(-(16 + 12) // 4)  # the default: every slot at max_len
  if family == "qwen3":  # the baselines' settings too: static batching, a prefill per sample
    _same(dense, generate(engine, params, prompts, n=2, slots=4, steps_per_call=4, seed=3,
                          kv_cache="paged", page_size=4, continuous=False, share_prefix=False))
  _same(dense, pg)


def test_a_slot_without_a_free_page_waits_unchanged(model, mesh):
  cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(greedy=True, max_new_tokens=20))
  state = engine.init_paged_state(2, 32, pages=3, page_size=4)
  tokens = np.zeros((1, 16), np.int32)
  tokens[0, :4] = [1, 2, 3, 4]  # one full page, shared by both slots: no partial page
  prefix = engine.prefill(params, tokens, np.array([4]), jax.random.key(0))
  state, _ = engine.insert_group(prefix, state, [0, 1])
  assert engine.pages_in_use(state) == 1
  # Positions 4..7 take the two free pages; position 8 needs a fourth page, so both slots wait.
  state, out = engine.generate_steps(params, state, jax.random.key(0), steps=6)
  valid = np.asarray(out["valid"])
  assert valid[:4].all() and not valid[4:].any()
  assert (np.asarray(state["pos"]) == 8).all() and np.asarray(state["live"]).all()
  assert engine.pages_in_use(state) == 3 and (np.asarray(out["pages_used"]) == 3).all()


def test_the_paged_decode_step_and_insert_compile_for_v5e():
  """The paged programs AOT-compiled for v5e:2x2 (abstract TPU devices, no chip): the decode
  scan (beside the dense one) and the insert."""
  from jaxrl.models import abstract_model
  from jaxrl.parallel.compile import topology_devices
  from jaxrl.train import programs as pg

  devs = topology_devices("v5e:2x2")
  mesh = make_mesh(1, 2, 2, devices=devs)
  cfg = get_preset("tiny-qwen2")
  graphdef = abstract_model(cfg)[0]
  params = pg.params_of(abstract_model(cfg), mesh, "sampler")
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(max_new_tokens=48))
  assert not engine.join_weights  # one product per weight on TPU (backends.joins_decode_weights)
  slots, max_len, page_size, pages = 8, 64, 16, 12
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep)

  def abstract(state_fn, shardings):
    return jax.tree.map(lambda x, s: pg.spec(x.shape, x.dtype, s), jax.eval_shape(state_fn),
                        shardings)

  paged_state = abstract(
      lambda: engine._paged_init_fn(slots, max_len // page_size, pages, page_size)(
          jnp.int32(max_len)), engine._paged_shardings(slots))
  dense_state = abstract(lambda: engine._init_fn(slots, max_len)(jnp.int32(max_len)),
                         engine._state_shardings(slots, max_len))
  for state in (paged_state, dense_state):
    compiled = jax.jit(lambda p, s, k: engine._steps_fn(p, s, k, steps=2),
                       donate_argnums=1).lower(params, state, key).compile()
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    assert {d.platform for d in compiled.input_shardings[0][1]["live"].device_set} == {"tpu"}
    # No copy of the q, k and v weights joined per KV head ([D, K per chip, G + 2, H]), nor of
    # gate and up stacked ([D, 2, F per chip]).
    joined = (f"[{cfg.embed_dim},{cfg.num_kv_heads // 2},"
              f"{cfg.num_heads // cfg.num_kv_heads + 2},{cfg.head_dim}]")
    stacked = f"[{cfg.embed_dim},2,{cfg.mlp_dim // 2}]"
    assert joined not in compiled.as_text() and stacked not in compiled.as_text()
  P = 2
  prefix = {"kv": [(pg.spec((P, cfg.num_kv_heads, 16, cfg.head_dim), "float32", rep),) * 2
                   for _ in range(cfg.num_layers)],
            "logits": pg.spec((P, cfg.vocab_size), "float32", rep),
            "length": pg.spec((P,), "int32", rep), "tokens": pg.spec((P,), "int32", rep),
            "logprobs": pg.spec((P,), "float32", rep), "key": key}
  idx = pg.spec((slots,), "int32", rep)
  jax.jit(engine._insert_paged_fn, donate_argnums=0).lower(
      paged_state, prefix, idx, idx, idx, idx, pg.spec((slots,), "bool", rep)).compile()
