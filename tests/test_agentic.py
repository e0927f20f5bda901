"""Multi-turn and tool-use rollouts (jaxrl.envs): tool-call parsing in the Qwen/Hermes and
Llama 3 formats, tool results rendered as transformers renders them (the committed qwen2
reference, made offline by tests/fixtures/make_hf_fixtures.py with apply_chat_template and
tools=), the loss mask of a crafted 3-turn conversation, KV continuation against re-prefill,
the calculator's refusals, the registry's errors, a GRPO pulse with a user's environment, and
(slow) GRPO learning to call the calculator from an SFT warm start."""

import json
import os

import jax
import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl.data.hf_tokenizer import HFTokenizer
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.envs import EnvError, builtin_envs, env_factory, load_env_module
from jaxrl.envs.calculator import CalcError, CalculatorEnv, calculate
from jaxrl.data.chat import ChatRenderer, assistant_turn, parse_tool_calls, tool_format
from jaxrl.envs.games import GuessNumberEnv
from jaxrl.envs.rollout import conversations
from jaxrl.errors import ConfigError
from jaxrl.algorithms import grpo
from jaxrl.algorithms.grpo.batch import grouped_learner_batch, learner_batch
from jaxrl.sampler import Rollout
from jaxrl.sampler import metrics as rollout_metrics

HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


# ----------------------------------------------------------------------------- parsing


def test_hermes_tool_calls_parse_and_malformed_ones_are_sentences():
  one = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
  assert parse_tool_calls(one, "hermes") == ([{"name": "calculator",
                                               "arguments": {"expression": "12*34"}}], [])
  two = one + 'then <tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
  calls, errors = parse_tool_calls(two, "hermes")
  assert [c["name"] for c in calls] == ["calculator", "add"] and not errors
  assert calls[1]["arguments"] == {"a": 1}  # arguments given as a JSON string
  assert parse_tool_calls("The answer is 408.", "hermes") == ([], [])
  for bad, says in [
      ('<tool_call>{"name": "calculator", "arguments": {"expr</tool_call>', "not valid JSON"),
      ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
      ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "not a JSON object"),
      ('<tool_call>[1, 2]</tool_call>', "not a JSON object"),
      ('<tool_call>{"name": "calculator", "arguments": {}}', "not closed"),
  ]:
    calls, errors = parse_tool_calls(bad, "hermes")
    assert calls == [] and len(errors) == 1 and says in errors[0], (bad, errors)
  # A good call beside a bad one: both are reported.
  calls, errors = parse_tool_calls(one + "<tool_call>{oops}</tool_call>", "hermes")
  assert len(calls) == 1 and len(errors) == 1
  turn = assistant_turn(one, "hermes")
  assert turn["tool_calls"] == [{"type": "function", "function": {
      "name": "calculator", "arguments": {"expression": "12*34"}}}]


def test_llama3_json_tool_calls_parse_and_malformed_ones_are_sentences():
  call = '{"name": "calculator", "parameters": {"expression": "2+2"}}'
  want = [{"name": "calculator", "arguments": {"expression": "2+2"}}]
  assert parse_tool_calls(call, "llama3") == (want, [])
  assert parse_tool_calls("<|python_tag|>" + call, "llama3") == (want, [])
  assert parse_tool_calls(" " + call.replace("parameters", "arguments") + "\n", "llama3") == (
      want, [])
  calls, errors = parse_tool_calls(call + "; " + call, "llama3")
  assert calls == want * 2 and not errors
  assert parse_tool_calls("It is 4.", "llama3") == ([], [])
  for bad in ['{"name": "calculator", "parameters": {', '{"parameters": {}}',
              '{"name": "f", "parameters": 3}']:
    calls, errors = parse_tool_calls(bad, "llama3")
    assert calls == [] and len(errors) == 1, (bad, errors)
  with pytest.raises(ConfigError, match="tool format"):
    parse_tool_calls(call, "xml")


def test_tool_format_follows_the_template():
  assert tool_format(HFTokenizer(os.path.join(HF, "qwen2"))) == "hermes"
  assert tool_format(ByteTokenizer()) == "hermes"

  class Llama31:  # the marker Llama 3.1's template carries for tool results
    chat_template = "{% if message.role == 'ipython' %}<|python_tag|>{% endif %}"
  assert tool_format(Llama31()) == "llama3"


# ----------------------------------------------------------------------------- rendering


def test_tool_result_rendering_equals_transformers_with_tools():
  """The prompt (tools= in the template), the model's own tokens and the rendered tool
  result are, token for token, transformers' apply_chat_template(tools=[TOOL],
  add_generation_prompt=True) of the whole chat (qwen2's committed reference)."""
  tok = HFTokenizer(os.path.join(HF, "qwen2"))
  ref = json.load(open(os.path.join(HF, "qwen2", "tokenizer_ref.json")))
  case = next(c for c in ref["chats"] if "tools" in c["kwargs"] and c["add_generation_prompt"])
  user, call_msg, result = case["messages"]
  tools = case["kwargs"]["tools"]
  r = ChatRenderer(tok)
  prompt = r.prompt_ids([user], tools)
  model_text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
  model = tok.encode(model_text) + [tok.eos_id]  # as sampled: the turn ends on <|im_end|>
  turn = assistant_turn(tok.decode(model), r.format)
  assert turn["tool_calls"] == call_msg["tool_calls"] and not turn["tool_call_errors"]
  obs = r.observation_ids([user], turn, [result], tools)
  assert prompt + model + obs == case["ids"]
  assert tok.decode(prompt + model + obs, skip_special=False) == case["text"]


# ----------------------------------------------------------------------------- the driver


def scripted(tok, script, prompts_seen):
  """A generator that 'samples' the scripted turns: script[conversation][turn] is the text of
  that turn, ended by eos; each call records the prompts it was given."""
  calls = [0]

  def gen(ids, n, seed):
    turn = calls[0]
    calls[0] += 1
    prompts_seen.append([list(x) for x in ids])
    rows = [c for c in range(len(script)) if len(script[c]) > turn]
    toks = [tok.encode(script[c][turn]) + [tok.eos_id] for c in rows]
    L = max(map(len, toks))
    ids_out = np.zeros((len(toks), L), np.int32)
    lps = np.zeros((len(toks), L), np.float32)
    for i, t in enumerate(toks):
      ids_out[i, :len(t)] = t
      lps[i, :len(t)] = -0.25  # every sampled token carries a (made-up) sampler log-prob
    lengths = np.array([len(t) for t in toks], np.int32)
    return Rollout(prompt_ids=np.zeros((len(toks), 1), np.int32), prompt_lengths=lengths * 0,
                   completion_ids=ids_out, completion_mask=(ids_out * 0 + 1), logprobs=lps,
                   lengths=lengths, finish_reasons=["stop"] * len(toks),
                   prompt_index=np.arange(len(toks)), stats={"prefill_s": 0.0})
  return gen


def runs(mask_row):
  """Run-length encoding of a 0/1 row: [(value, count), ...]."""
  out = []
  for v in mask_row:
    if out and out[-1][0] == v:
      out[-1][1] += 1
    else:
      out.append([v, 1])
  return [tuple(x) for x in out]


def test_three_turn_mask_covers_exactly_the_models_tokens():
  tok = HFTokenizer(os.path.join(HF, "qwen2"))
  call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
  broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>'
  script = [[call, broken, "408"], ["400"]]  # a group of two conversations
  seen = []
  ro, rewards, extra = conversations(
      scripted(tok, script, seen), [{"prompt": "12*34=", "answer": "408"}],
      env=("calculator", CalculatorEnv), renderer=ChatRenderer(tok), n=2, seed=0, max_turns=3,
      budget=512, pad_id=tok.pad_id, decode=tok.decode)
  np.testing.assert_array_equal(rewards, [1.0, 0.0])
  st = ro.stats
  assert (st["env_turns"], st["env_tool_calls"], st["env_bad_tool_calls"]) == (2.0, 1.0, 1.0)
  assert extra["accuracy"] == 0.5 and st["env_s"] >= 0.0
  turns = [tok.encode(t) + [tok.eos_id] for t in script[0]]
  # Later turns are prompted with the whole conversation so far (re-prefill).
  assert seen[1][0] == list(ro.prompt_ids[0, :ro.prompt_lengths[0]]) + list(
      ro.completion_ids[0, :len(seen[1][0]) - ro.prompt_lengths[0]])
  c = int(ro.lengths[0])
  mask = ro.completion_mask[0, :c]
  spans = runs(mask)
  assert [v for v, _ in spans] == [1, 0, 1, 0, 1]
  assert [k for v, k in spans if v] == [len(t) for t in turns]
  comp = ro.completion_ids[0, :c]
  assert [list(comp[mask == 1])] == [sum(turns, [])]
  between = tok.decode(comp[mask == 0], skip_special=False)
  assert "<tool_response>\n408\n</tool_response>" in between and "not valid JSON" in between
  assert "12*34" not in between  # the model's call is trained, never an untrained input
  # The learner's masks, both layouts: exactly the model's tokens as targets, with their
  # sampler log-probs; template and tool tokens are inputs only (no loss, no KL).
  p = int(ro.prompt_lengths[0])
  b = learner_batch(ro, length=p + ro.completion_ids.shape[1] + 8, pad_id=tok.pad_id)
  target_mask = b["mask"][0, p - 1:p - 1 + c]
  np.testing.assert_array_equal(target_mask, mask)
  assert b["mask"][0].sum() == sum(map(len, turns))
  np.testing.assert_array_equal(b["targets"][0, p - 1:p - 1 + c][mask == 1], comp[mask == 1])
  np.testing.assert_array_equal(b["sampler_logp"][0] != 0, b["mask"][0] > 0)
  g = grouped_learner_batch(ro, prompt_len=1024, group=2, pad_id=tok.pad_id, width=512)
  np.testing.assert_array_equal(g["mask"][0, :c], mask)
  assert g["mask"][0, c:].sum() == 0 and g["mask"][1].sum() == len(tok.encode("400")) + 1
  # response_length counts the model's tokens only.
  assert rollout_metrics(ro)["response_length/mean"] == (
      sum(map(len, turns)) + len(tok.encode("400")) + 1) / 2


def test_budget_and_max_turns_end_a_conversation():
  tok = ByteTokenizer()
  call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
  ro, rewards, _ = conversations(
      scripted(tok, [[call] * 5], []), [{"prompt": "1+1=", "answer": "2"}],
      env=("calculator", CalculatorEnv), renderer=ChatRenderer(tok, {"chat": False}), n=1,
      seed=0, max_turns=3, budget=400, pad_id=tok.pad_id, decode=tok.decode)
  assert ro.stats["env_turns"] == 3.0 and rewards[0] == 0.0 and ro.finish_reasons == ["stop"]
  ro, _, _ = conversations(
      scripted(tok, [[call] * 5], []), [{"prompt": "1+1=", "answer": "2"}],
      env=("calculator", CalculatorEnv), renderer=ChatRenderer(tok, {"chat": False}), n=1,
      seed=0, max_turns=5, budget=len(call) + 20, pad_id=tok.pad_id, decode=tok.decode)
  assert ro.finish_reasons == ["length"] and ro.lengths[0] <= len(call) + 20


def test_calculator_demonstrations_are_the_drivers_conversations():
  """The SFT warm start's demonstrations (data.tool_rate, plain text, train_on=all_assistant)
  are token for token the conversations the driver writes when the model says those turns,
  with the loss on exactly the tokens the rollout's completion_mask trains."""
  from jaxrl.data.pipeline import tokenize_sft
  from jaxrl.data.records import check_record
  from jaxrl.envs.calculator import demonstrations
  from jaxrl.tasks import get_task
  tok, data = ByteTokenizer(), {"train_on": "all_assistant"}
  demos = demonstrations(get_task("multiply"), "train", 40, 0, tool_rate=0.25)
  called = [d for d in demos if len(d["messages"]) == 4]
  assert 4 <= len(called) <= 16 and demonstrations(
      get_task("multiply"), "train", 40, 0, tool_rate=0.25) == demos  # seeded
  for demo in (called[0], next(d for d in demos if len(d["messages"]) == 2)):
    m = demo["messages"]
    record = {"prompt": m[0]["content"], "answer": m[-1]["content"]}
    ro, rewards, _ = conversations(
        scripted(tok, [[t["content"] for t in m if t["role"] == "assistant"]], []), [record],
        env=("calculator", CalculatorEnv), renderer=ChatRenderer(tok, data), n=1, seed=0,
        max_turns=3, budget=400, pad_id=tok.pad_id, decode=tok.decode)
    assert rewards[0] == 1.0  # the demonstrated answer is right, with the tool or without
    ex = tokenize_sft(check_record(demo, "sft", "demo"), tok, data)
    p, c = int(ro.prompt_lengths[0]), int(ro.lengths[0])
    seq = list(ro.prompt_ids[0, :p]) + list(ro.completion_ids[0, :c])
    assert list(ex["inputs"]) + [ex["targets"][-1]] == seq
    np.testing.assert_array_equal(ex["loss_mask"][p - 1:], ro.completion_mask[0, :c])
    assert ex["loss_mask"][:p - 1].sum() == 0
  with pytest.raises(ConfigError, match="data.tool_rate=1.5 is not valid"):
    demonstrations(get_task("multiply"), "train", 4, 0, tool_rate=1.5)


def test_guess_number_game_is_verifiable():
  env = GuessNumberEnv()
  env.reset({"prompt": "guess 1-16 #1:", "answer": "11"})
  assert env.step([], {"content": "8"})[0][0]["content"] == "higher"
  assert env.step([], {"content": "13"})[0][0]["content"] == "lower"
  assert env.step([], {"content": "no idea"})[:3] == ([{"role": "user",
                                                        "content": "say a number"}], 0.0, False)
  assert env.step([], {"content": "11"})[1:3] == (1.0, True)


# ----------------------------------------------------------------------------- calculator


def test_calculator_computes_and_refuses_code():
  assert calculate("123 * 45") == 5535 and calculate("(2 + 3) ** 2 - 7 // 2") == 22
  assert calculate("-3 / 4") == -0.75 and calculate("10 % 4") == 2
  for bad in ["__import__('os')", "__import__('os').system('true')", "(lambda: 1)()",
              "lambda: 1", "x", "a.b", "().__class__", "[1, 2][0]", "'a' * 3", "1 if 1 else 2",
              "1 < 2", "9 ** 9 ** 9", "10 ** 100", "2 ** 1000", "10**40 * 10**40", "1 / 0",
              "True + 1", "1" * 201, "open('/etc/passwd')", "(" * 100 + "1" + ")" * 100,
              "{1: 2}", "f'{1}'", "1e400", "(-8) ** 0.5", 12]:
    with pytest.raises(CalcError):
      calculate(bad)


def test_calculator_env_answers_calls_and_counts_bad_ones():
  env = CalculatorEnv()
  assert env.reset({"prompt": "12*34=", "answer": "408"}) == [{"role": "user",
                                                               "content": "12*34="}]
  obs, reward, done, info = env.step([], assistant_turn(
      '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
      '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
      '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}'
      '</tool_call><tool_call>{bad</tool_call>', "hermes"))
  assert [m["content"] for m in obs][0] == "408" and all(m["role"] == "tool" for m in obs)
  assert obs[2]["content"].startswith("error: Call is not allowed")
  assert (reward, done, info) == (0.0, False, {"tool_calls": 4, "bad_tool_calls": 2})
  assert env.step([], assistant_turn("408", "hermes"))[1:3] == (1.0, True)


# ----------------------------------------------------------------------------- registry


def test_registry_and_env_errors_are_one_sentence(tmp_path):
  cfg = grpo.default_config()
  assert env_factory(cfg) is None
  cfg.data.env = "calculater"
  with pytest.raises(ConfigError, match="Did you mean 'calculator'"):
    env_factory(cfg)
  cfg.data.env = "calculator"
  assert env_factory(cfg) == ("calculator", builtin_envs()["calculator"])
  cfg.env_module = "x.py"
  with pytest.raises(ConfigError, match="both set"):
    env_factory(cfg)
  with pytest.raises(ConfigError, match="does not exist"):
    load_env_module(str(tmp_path / "missing.py"))
  (tmp_path / "empty.py").write_text("X = 1\n")
  with pytest.raises(ConfigError, match="defines no make_env"):
    load_env_module(str(tmp_path / "empty.py"))

  class Broken(CalculatorEnv):
    def step(self, messages, turn):
      raise KeyError("secret")

  tok = ByteTokenizer()
  with pytest.raises(EnvError, match=r"environment 'broken' raised KeyError in step\(\)"):
    conversations(scripted(tok, [["1"]], []), [{"prompt": "1=", "answer": "1"}],
                  env=("broken", Broken), renderer=ChatRenderer(tok, {"chat": False}), n=1,
                  seed=0, max_turns=2, budget=64, pad_id=0, decode=tok.decode)

  class BadReturn(CalculatorEnv):
    def step(self, messages, turn):
      return "done"

  with pytest.raises(EnvError, match="not \\(observation messages or None"):
    conversations(scripted(tok, [["1"]], []), [{"prompt": "1=", "answer": "1"}],
                  env=("bad", BadReturn), renderer=ChatRenderer(tok, {"chat": False}), n=1,
                  seed=0, max_turns=2, budget=64, pad_id=0, decode=tok.decode)


def test_grpo_config_errors(repo_root, tmp_path, devices):
  spec = os.path.join(repo_root, "configs/agentic_tiny.py:runlocal")
  for overrides, says in [(["rewards=task"], "set --config.rewards=env"),
                          (["data.env=", "rewards=task", "rollout.max_turns=3"],
                           "needs an environment"),
                          (["data.env=", "rewards=env", "rollout.max_turns=1"],
                           "this run has none"),
                          (["rollout.kv_cache=paged"], "set rollout.kv_admission=reserve"),
                          (["rollout.async_generation=True", "placement.mode=disaggregated",
                            "rollout.partial_rollouts=True", "rollout.streaming=True"],
                           "turn rollout.streaming off")]:
    with pytest.raises(ConfigError, match=says):
      grpo.setup(config_lib.load_config(spec, overrides), str(tmp_path / "x"),
                 out=lambda *a: None)


# ----------------------------------------------------------------------------- GRPO


USER_ENV = '''
class Countdown:
  """Say a number below the last one; three turns of that is a win."""
  tools = None

  def reset(self, record):
    self.turns = 0
    return [{"role": "user", "content": record["prompt"]}]

  def step(self, messages, turn):
    self.turns += 1
    if self.turns == 3:
      return None, 1.0, True, {"correct": True}
    return [{"role": "user", "content": "again"}], 0.1, False, {}


def make_env():
  return Countdown()
'''


@pytest.mark.parametrize("asynchronous", [False, True])
def test_grpo_pulse_with_a_users_environment(repo_root, tmp_path, devices, asynchronous):
  """Two GRPO steps over a user's env_module: three turns each, the env's rewards summed,
  and the env metrics logged; synchronous, and async (k = 2, disaggregated 4 + 4 devices:
  the sampler's conversations overlap the learner's update), with partial rollouts (a
  conversation in flight goes on under newer weights) over the paged KV cache (reserve
  admission: a held conversation keeps its pages)."""
  path = tmp_path / "countdown.py"
  path.write_text(USER_ENV)
  spec = os.path.join(repo_root, "configs/agentic_tiny.py:runlocal")
  config = config_lib.load_config(spec, ["data.env=", f"env_module={path}",
                                         "rollout.max_new_tokens=4"] + [
      "placement.mode=disaggregated", "rollout.async_generation=True",
      "rollout.max_staleness=2", "rollout.partial_rollouts=True", "rollout.kv_cache=paged",
      "rollout.kv_admission=reserve", "rollout.page_size=4"] * asynchronous)
  workdir = str(tmp_path / "run")
  summary = grpo.run(config, workdir, out=lambda *a: None)
  assert summary["status"] == "completed"
  rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))][1:]
  assert [r["step"] for r in rows] == [1, 2]
  if asynchronous:  # step n samples with version max(n - 2, 0)'s weights
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0]
    assert all(r["sampler/kv_pages_peak"] > 0 and r["sampler/kv_preemptions"] == 0
               for r in rows)
  for row in rows:
    # A turn cut at 4 tokens is still a turn: every conversation runs the env's three turns.
    assert row["env/turns/mean"] == 3.0 and row["reward/mean"] == pytest.approx(1.2)
    assert row["env/tool_calls/mean"] == 0.0 and row["env/bad_tool_calls"] == 0.0
    assert row["timing_s/env"] >= 0.0 and np.isfinite(row["loss"])
    # Model tokens only: at most 4 per turn, though each conversation holds more.
    assert 3.0 <= row["response_length/mean"] <= 12.0
  # The held-out eval holds the same conversations, greedy, on the task's test split: every
  # one runs three turns and earns 1.2, a full mark.
  evals = [r for r in rows if "eval/accuracy" in r]
  assert [r["step"] for r in evals] == [2]
  assert evals[0]["eval/accuracy"] == 1.0 and evals[0]["eval/reward"] == pytest.approx(1.2)
  assert evals[0]["eval/turns/mean"] == 3.0 and evals[0]["eval/tool_calls/mean"] == 0.0


# ----------------------------------------------------------------------------- KV continuation


@pytest.fixture(scope="module")
def model(devices):
  """The tiny-qwen2 preset on 2 (fsdp) x 4 (tensor) devices, its logits spread as in
  test_sampler (no near-ties, so greedy comparisons are decisive)."""
  from jaxrl.models import get_preset
  from jaxrl.parallel import init_params, make_mesh
  mesh = make_mesh(1, 2, 4)
  cfg = get_preset("tiny-qwen2")
  graphdef, params = init_params(cfg, mesh, "sampler", seed=0)
  return mesh, cfg, graphdef, dict(params, embed=params["embed"] * 5.0)


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_kv_continuation_equals_reprefill(model, cache):
  """Engine.extend: two slots decode their first turns, then each appends an observation of
  its own length to its KV; the logits after it equal a fresh prefill of the whole
  conversation (prompt, sampled tokens, observation), and the next token is drawn from them.
  Paged (pages of 4 positions): the appended positions cross pages, which the slots take from
  the pool, and the padding's writes past them are dropped."""
  from jaxrl.sampler import Engine, SamplingParams
  mesh, cfg, graphdef, params = model
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(greedy=True, max_new_tokens=32,
                                                               eos_id=None))
  key = jax.random.key(0)
  prompts = [[1, 40, 41, 42, 43], [1, 50, 51]]
  tokens = np.zeros((2, 16), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  prefix = engine.prefill(params, tokens, [len(p) for p in prompts], key)
  if cache == "paged":
    state = engine.init_paged_state(2, 64, pages=32, page_size=4)
  else:
    state = engine.init_decode_state(2, 64)
  state, first = engine.insert_many(prefix, state, rows=[0, 1], slots=[0, 1], samples=[0, 1])
  state, out = engine.generate_steps(params, state, key, steps=3)
  if cache == "paged":  # positions 0-7 and 0-5 written: two pages each
    assert engine.pages_in_use(state) == 4
  said = [[int(first["tokens"][b])] + [int(t) for t in np.asarray(out["tokens"])[:, b]]
          for b in range(2)]
  obs = [[7, 8, 9, 10], [11, 12]]
  obs_et = np.zeros((2, 8), np.int32)
  for b, o in enumerate(obs):
    obs_et[b, :len(o)] = o
  state, ext = engine.extend(params, state, key, slots=[0, 1], tokens_et=obs_et,
                             length_e=[len(o) for o in obs])
  if cache == "paged":  # slot 0 writes positions 8-12 (two pages more), slot 1 6-8 (one)
    assert engine.pages_in_use(state) == 7
  full = [p + s + o for p, s, o in zip(prompts, said, obs)]
  tokens = np.zeros((2, 32), np.int32)
  for i, f in enumerate(full):
    tokens[i, :len(f)] = f
  ref = engine.prefill(params, tokens, [len(f) for f in full], key)
  logits, ref_logits = np.asarray(ext["logits"]), np.asarray(ref["logits"])
  np.testing.assert_allclose(logits, ref_logits, atol=2e-4, rtol=2e-4)
  assert np.abs(ref_logits).max() > 1.0  # not a trivially flat comparison
  np.testing.assert_array_equal(np.asarray(ext["tokens"]), ref_logits.argmax(-1))
  # Decoding goes on from the continued KV: one more step equals the full forward's argmax.
  state, step = engine.generate_steps(params, state, key, steps=1)
  nxt = [f + [int(t)] for f, t in zip(full, np.asarray(ext["tokens"]))]
  tokens = np.zeros((2, 32), np.int32)
  for i, f in enumerate(nxt):
    tokens[i, :len(f)] = f
  ref2 = engine.prefill(params, tokens, [len(f) for f in nxt], key)
  np.testing.assert_array_equal(np.asarray(step["tokens"])[0],
                                np.asarray(ref2["logits"]).argmax(-1))


@pytest.mark.parametrize("cache", ["dense", "paged"])
def test_kv_continuing_driver_equals_the_reprefill_driver(model, cache):
  """Greedy, the continuously batched KV-continuing driver (envs.rollout.continued) and the
  re-prefill driver (each turn prompted with the whole conversation) give the same
  conversations, token for token, with the same masks and log-probs: 2 groups of 2 on 2
  slots (the second group waits for free slots), every turn cut at 4 tokens or ended on eos,
  and the user's three-turn environment answering in between. Paged (pages of 4 positions,
  reserve admission): a group's conversations share their prompt's full pages, each held
  conversation keeps its own while its environment steps, and a finished one frees them for
  the next group."""
  from jaxrl.envs.rollout import continued
  from jaxrl.sampler import Engine, SamplingParams, generate
  mesh, cfg, graphdef, params = model
  tok = ByteTokenizer()
  engine = Engine(graphdef, cfg, mesh, sampling=SamplingParams(
      greedy=True, max_new_tokens=4, eos_id=tok.eos_id))
  scope = {}
  exec(USER_ENV, scope)
  records = [{"prompt": p, "answer": ""} for p in ("12*34=", "5*6=")]
  kw = dict(env=("countdown", scope["make_env"]), renderer=ChatRenderer(tok, {"chat": False}),
            n=2, seed=3, max_turns=3, budget=48, pad_id=tok.pad_id, decode=tok.decode)
  cache_kw = dict(kv_cache="paged", kv_admission="reserve", page_size=4) if cache == "paged" else {}
  ro, rewards, _ = continued(engine, params, records, slots=2, steps_per_call=4,
                             max_prompt_len=16, **cache_kw, **kw)
  # Stepped in the loop instead of in threads: the same conversations.
  same, same_rewards, _ = continued(engine, params, records, slots=2, steps_per_call=4,
                                    max_prompt_len=16, env_workers=0, **cache_kw, **kw)
  np.testing.assert_array_equal(same.completion_ids, ro.completion_ids)
  np.testing.assert_array_equal(same_rewards, rewards)
  # Partial rollouts: a new version before every device call (the same weights, so the same
  # conversations); each model token records the version that drew it, tool tokens -1.
  calls = iter(range(1000))
  part, _, _ = continued(engine, params, records, slots=2, steps_per_call=4, max_prompt_len=16,
                         weights=lambda: (next(calls), params), **cache_kw, **kw)
  np.testing.assert_array_equal(part.completion_ids, ro.completion_ids)
  inside = np.arange(ro.completion_ids.shape[1])[None, :] < ro.lengths[:, None]
  model_tok = inside & (ro.completion_mask == 1)
  assert (part.versions[model_tok] >= 0).all() and (part.versions[~model_tok] == -1).all()
  assert all(len(set(v[m].tolist())) > 2 for v, m in zip(part.versions, model_tok))
  assert all((np.diff(v[m]) >= 0).all() for v, m in zip(part.versions, model_tok))
  ref, ref_rewards, _ = conversations(
      lambda ids, n, seed: generate(engine, params, ids, n=n, seed=seed, slots=2,
                                    steps_per_call=4, pad_id=tok.pad_id), records, **kw)
  assert ro.stats["env_turns"] == 3.0 and ro.stats["extend_calls"] >= 2
  if cache == "paged":  # one group's pages at a time: a finished conversation's are freed
    pages = -(-(ro.prompt_lengths + ro.lengths + 1) // 4)  # + 1: a pending token's position
    assert 0 < ro.stats["kv_pages_peak"] <= max(pages[:2].sum(), pages[2:].sum())
  np.testing.assert_array_equal(rewards, ref_rewards)
  np.testing.assert_array_equal(ro.lengths, ref.lengths)
  np.testing.assert_array_equal(ro.completion_ids, ref.completion_ids)
  np.testing.assert_array_equal(ro.completion_mask, ref.completion_mask)
  np.testing.assert_allclose(ro.logprobs, ref.logprobs, atol=1e-4)
  assert ro.finish_reasons == ref.finish_reasons
  assert 0 < ro.completion_mask.sum() < (ro.completion_mask.shape[1] * len(ro.lengths))


# ----------------------------------------------------------------------------- learning

# Bars below the worst of the 12 cells measured (+0.680 and +0.977: see the docstring). A
# policy that does not learn keeps its step-0 eval (the warm start's greedy accuracy) and
# fails both.
ACCURACY_GAIN = 0.40
TOOL_CALL_GAIN = 0.80


@pytest.mark.slow
def test_grpo_learns_to_call_the_calculator(sft_calculator, tmp_path, repo_root, bars):
  """The calculator recipe (configs/agentic_tiny.py, docs/guides/agentic.md): from the SFT
  warm start (sft_calculator, committed: 15% of its demonstrations call the tool, so greedy it
  answers in its head), GRPO with the calculator environment's reward raises the multi-turn
  held-out eval's accuracy by learning to call the tool: eval/accuracy and
  eval/tool_calls/mean (128 greedy conversations of multiply's test split) both rise from
  step 0 to step 30.

  What fails is copying (the call's operands, the result into the answer). How well a warm
  start copies follows the float rounding of the machine that trained it: trained in the
  suite, on an Intel Xeon (AVX-512, AMX) the former recipe (20 steps, 64 held-out prompts)
  gained +0.219 where an AMD EPYC gained +0.656, and SFT and GRPO both at the seed gave
  +0.344 to +0.742 over 12 cells (docs/guides/agentic.md). From the one committed warm start,
  GRPO's own rounding does not move it here; its seed does. The 12 cells of tools/learning_sweep.py
  (docs/design.md, Testing; 2026-12-06, AMD EPYC Zen 2, AVX2, 2 cores; native = AVX2), GRPO
  at the seed:

  cells (ISA dots seed: held-out accuracy gain; tool calls gain):
  native eigen 0: +0.680, +0.977
  native ynnpack 0: +0.680, +0.977
  AVX eigen 0: +0.680, +0.977
  AVX ynnpack 0: +0.680, +0.977
  native eigen 1: +0.789, +0.984
  native ynnpack 1: +0.789, +0.984
  AVX eigen 1: +0.789, +0.984
  AVX ynnpack 1: +0.789, +0.984
  native eigen 2: +0.680, +0.984
  native ynnpack 2: +0.680, +0.984
  AVX eigen 2: +0.680, +0.984
  AVX ynnpack 2: +0.680, +0.984
  AVX-512 cells (an Intel Xeon with AMX, 2 cores, 2026-12-07; --isa native):
  AVX-512 eigen 0: +0.680, +0.977
  AVX-512 ynnpack 0: +0.680, +0.977
  AVX-512 eigen 1: +0.789, +0.984
  AVX-512 ynnpack 1: +0.789, +0.984
  AVX-512 eigen 2: +0.680, +0.984
  AVX-512 ynnpack 2: +0.680, +0.984
  worst +0.680 and +0.977 (seed 0); bars +0.40 and +0.80. The six AVX-512 cells
  (an Intel Xeon, the CPU that failed the former recipe) gave the AMD's figures seed for seed:
  from the committed warm start this GRPO rounds alike on both. The recipe's rollouts and eval now allocate the KV cache
  whole (rollout.grow_cache=False), which gave every logged figure of the cells native eigen 0,
  native ynnpack 0 and AVX eigen 1 (and native eigen 1, 2) to the bit in 57-64 s alone, against
  73-86 s with the growing window (2026-12-07, alternated in one run). The warm start took 4-5
  minutes of the suite before it was committed. (A warm start trained pinned
  to one core, XLA's threads 1 instead of 2, rounds differently again: from one such, GRPO
  gained +0.422 to +0.562 over the same cells.)
  """
  from conftest import LEARN_SEED, jaxrl_cli
  grpo = str(tmp_path / "grpo")
  jaxrl_cli(["grpo", "--config", os.path.join(repo_root, "configs/agentic_tiny.py"),
             "--workdir", grpo, f"--config.init.checkpoint={sft_calculator}",
             f"--config.seed={LEARN_SEED}"], cwd=repo_root)
  rows = [json.loads(x) for x in open(os.path.join(grpo, "metrics.jsonl"))]
  evals = [r for r in rows if "eval/accuracy" in r]
  first, last = evals[0], evals[-1]
  assert (first["step"], last["step"]) == (0, 30)
  assert first["eval/tool_calls/mean"] <= 0.25  # the warm start mostly answers in its head
  tool_gain = last["eval/tool_calls/mean"] - first["eval/tool_calls/mean"]
  gain = last["eval/accuracy"] - first["eval/accuracy"]
  bars.above("held-out accuracy gain", gain, ACCURACY_GAIN)
  bars.above("tool calls gain", tool_gain, TOOL_CALL_GAIN)
  bars.check()
