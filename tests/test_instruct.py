"""Instruct checkpoints end to end: one tokenizer and prompt path (jaxrl.data.prompts) for
sampling, GRPO and SFT; `jaxrl sample` on Hugging Face checkpoints and run directories.

The references are transformers' own, recorded in tests/fixtures/hf/*/ by
tests/fixtures/make_hf_fixtures.py: reference.npz ("prompt" ids and the "greedy" tokens of
full-forward argmax decoding) and tokenizer_ref.json (apply_chat_template texts and ids).
"""

import json
import os
import shutil

import numpy as np
import pytest

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl.data import ByteTokenizer, read_jsonl
from jaxrl.data.hf_tokenizer import HFTokenizer, eos_ids, generation_eos_ids
from jaxrl.data.pipeline import sft_batches, tokenize_sft
from jaxrl.data.prompts import Prompts, render_prompt, render_prompt_text
from jaxrl.errors import ConfigError

HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
FAMILIES = ("qwen3", "qwen2", "llama")


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _sample(tmp_path, prompts, *args):
  """`jaxrl sample` through the CLI's entry function; the completions it wrote."""
  work = tmp_path / "sample"
  cli.main(["sample", "--config", "configs/sample_tiny.py", "--prompts", prompts,
            "--workdir", str(work), "--config.sampling.slots=8", *args])
  return [json.loads(line) for line in open(work / "completions.jsonl")]


def _fails(capsys, args) -> str:
  with pytest.raises(SystemExit) as e:
    cli.main(args)
  assert e.value.code == 2
  return capsys.readouterr().err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- jaxrl sample


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_reproduces_transformers_greedy_tokens(family, tmp_path, repo_root, devices,
                                                      monkeypatch):
  """`jaxrl sample --config.model.hf_path=FIXTURE` (greedy) gives transformers' greedy tokens
  for the recorded prompts: the checkpoint's real weights, not a random init."""
  monkeypatch.chdir(repo_root)
  ref = np.load(os.path.join(HF, family, "reference.npz"))
  prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p.tolist()} for p in ref["prompt"]])
  rows = _sample(tmp_path, prompts, f"--config.model.hf_path={HF}/{family}", "--n", "1",
                 "--config.sampling.mode=greedy",
                 f"--config.sampling.max_new_tokens={ref['greedy'].shape[1]}")
  assert [r["completion_ids"] for r in rows] == ref["greedy"].tolist()
  assert [r["prompt_ids"] for r in rows] == ref["prompt"].tolist()
  for r in rows:
    assert r["finish_reason"] == "length" and len(r["logprobs"]) == len(r["completion_ids"])
    assert all(np.isfinite(lp) and lp <= 0 for lp in r["logprobs"])


def test_generation_config_eos_list_stops_sampling(tmp_path, repo_root, devices, monkeypatch):
  """generation_config.json's eos_token_id (an int or a list) is read, and each id ends a
  completion with finish_reason "eos": with 22 listed, the first recorded greedy completion
  (22, 22, ...) stops after one token; the second (319, ...) runs to the length."""
  monkeypatch.chdir(repo_root)
  ckpt = tmp_path / "qwen3"
  shutil.copytree(os.path.join(HF, "qwen3"), ckpt)
  tok = HFTokenizer(str(ckpt))
  assert eos_ids(tok) == (tok.eos_id,) == (2,)  # no generation_config.json: eos alone
  assert eos_ids(ByteTokenizer()) == (2,)
  (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 22}))
  assert generation_eos_ids(str(ckpt)) == (22,)
  (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 22]}))
  assert HFTokenizer(str(ckpt)).eos_ids == (2, 22)
  ref = np.load(os.path.join(HF, "qwen3", "reference.npz"))
  prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt_ids": p.tolist()} for p in ref["prompt"]])
  rows = _sample(tmp_path, prompts, f"--config.model.hf_path={ckpt}", "--n", "1",
                 "--config.sampling.mode=greedy", "--config.sampling.max_new_tokens=8")
  assert [r["completion_ids"] for r in rows] == [[22], ref["greedy"][1].tolist()]
  assert [r["finish_reason"] for r in rows] == ["eos", "length"]
  (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "x"]}))
  with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id=\[2, 'x'\] is "
                     "not a token id"):
    HFTokenizer(str(ckpt))


def test_a_config_with_hf_path_never_samples_random_weights(tmp_path, capsys, repo_root,
                                                            monkeypatch):
  """model.hf_path without its weights, config.json or tokenizer is one sentence naming what is
  missing, and nothing is sampled."""
  monkeypatch.chdir(repo_root)
  prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}])
  no_weights = tmp_path / "no_weights"
  shutil.copytree(os.path.join(HF, "qwen3"), no_weights,
                  ignore=shutil.ignore_patterns("*.safetensors"))
  no_tokenizer = tmp_path / "no_tokenizer"
  shutil.copytree(os.path.join(HF, "qwen3"), no_tokenizer,
                  ignore=shutil.ignore_patterns("tokenizer*"))
  cases = {
      str(no_weights): f"{str(no_weights)!r} holds no *.safetensors files",
      str(no_tokenizer): f"model.hf_path={str(no_tokenizer)!r} holds no tokenizer.json",
      str(tmp_path / "absent"): f"model.hf_path={str(tmp_path / 'absent')!r} holds no",
  }
  for i, (path, message) in enumerate(cases.items()):
    work = tmp_path / f"s{i}"
    err = _fails(capsys, ["sample", "--config", "configs/sample_tiny.py", "--prompts", prompts,
                          f"--config.model.hf_path={path}", "--workdir", str(work)])
    assert message in err, err
    assert not os.path.exists(work / "completions.jsonl")


def test_sample_prompt_files_take_prompt_and_messages_rows(tmp_path, capsys, repo_root, devices,
                                                           monkeypatch):
  """Prompt and messages rows both sample, rendered with the checkpoint's chat template (a
  plain prompt as one user turn, as transformers renders it); bad rows are named by file,
  line and field."""
  monkeypatch.chdir(repo_root)
  ref = json.load(open(os.path.join(HF, "qwen2", "tokenizer_ref.json")))
  first = next(c for c in ref["chats"] if c["add_generation_prompt"])  # one user turn
  question = first["messages"][0]["content"]
  prompts = _jsonl(tmp_path / "p.jsonl", [
      {"prompt": question, "answer": "42"},
      {"messages": [{"role": "user", "content": question}]}])
  rows = _sample(tmp_path, prompts, f"--config.model.hf_path={HF}/qwen2", "--n", "2",
                 "--config.sampling.max_new_tokens=4")
  assert len(rows) == 4
  for r in rows:
    assert r["prompt_text"] == first["text"] and r["prompt_ids"] == first["ids"]
    assert r["finish_reason"] in ("eos", "length") and len(r["completion_ids"]) <= 4
  assert rows[0]["answer"] == "42" and rows[2]["messages"][0]["content"] == question
  bad = tmp_path / "bad.jsonl"
  for content, where in [
      ('{"prompt": "a"}\n{"messages": [{"role": "user"}]}\n',
       "line 2 messages[0]: field 'content' is missing"),
      ('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "a"}, '
       '{"role": "assistant", "content": "b"}]}\n',
       "line 3: field 'messages[1].role' is 'assistant'"),
      ('{"prompt_ids": [1, -3]}\n', "line 1: field 'prompt_ids' is not a non-empty list"),
      ('{"question": "a"}\n', "line 1: field 'prompt' is missing")]:
    bad.write_text(content)
    err = _fails(capsys, ["sample", "--config", "configs/sample_tiny.py", "--prompts", str(bad),
                          "--workdir", str(tmp_path / "bad")])
    assert err.startswith(f"jaxrl sample: error: {bad} {where}"), err


def test_sample_reads_parquet_prompt_files_with_field_mapping(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  from jaxrl.sampler.command import read_prompts
  path = str(tmp_path / "test.parquet")
  pq.write_table(pa.table({"question": ["What is 1 + 2?", "What is 2 + 2?"],
                           "answer": ["#### 3", "#### 4"]}), path)
  records = read_prompts(path, fields={"question": "prompt"})
  assert [dict(r) for r in records] == [{"prompt": "What is 1 + 2?", "answer": "#### 3"},
                                        {"prompt": "What is 2 + 2?", "answer": "#### 4"}]
  with pytest.raises(ConfigError, match="field 'prompt' is missing"):
    read_prompts(path)


def test_sample_from_a_run_dir_takes_the_runs_tokenizer(tmp_path, repo_root, devices,
                                                        monkeypatch):
  """An SFT run started from model.hf_path records it; `jaxrl sample --checkpoint RUN` (no
  hf_path given) samples that run's params with the checkpoint's tokenizer and chat template.
  The SFT trains every assistant turn of multi-turn chats (data.train_on=all_assistant)."""
  monkeypatch.chdir(repo_root)
  turn = [{"role": "user", "content": "What is 12 plus 30?"},
          {"role": "assistant", "content": "42."}]
  train = _jsonl(tmp_path / "train.jsonl", [
      {"messages": turn + [{"role": "user", "content": "And 3 apples?"},
                           {"role": "assistant", "content": "8 apples."}]}] * 16)
  run = str(tmp_path / "sft")
  cli.main(["sft", "--config", "configs/sft_tiny.py:runlocal", "--workdir", run,
            f"--config.model.hf_path={HF}/qwen2", "--config.data.task=",
            f"--config.data.train_file={train}", "--config.data.train_on=all_assistant",
            "--config.data.seq_len=128", "--config.data.batch_size=8", "--config.train.steps=2",
            "--config.eval.every=0", "--config.train.save_every=2"])
  prompts = _jsonl(tmp_path / "p.jsonl", [{"messages": turn[:1]}])
  rows = _sample(tmp_path, prompts, "--checkpoint", run, "--n", "1",
                 "--config.sampling.mode=greedy", "--config.sampling.max_new_tokens=4")
  tok = HFTokenizer(os.path.join(HF, "qwen2"))
  assert rows[0]["prompt_ids"] == tok.encode_chat(turn[:1], add_generation_prompt=True)
  sampled = json.load(open(tmp_path / "sample" / "config.json"))
  assert sampled["model"]["hf_path"] == f"{HF}/qwen2"
  # A trainer continuing the run (init.checkpoint) adopts it the same way.
  from jaxrl.train.run import adopt_hf_path, recorded_hf_path
  assert recorded_hf_path(run) == recorded_hf_path(run + "/checkpoints") == f"{HF}/qwen2"
  config = config_lib.load_config("configs/grpo_tiny.py", [f"init.checkpoint={run}"])
  adopt_hf_path(config, config.init.checkpoint, key="init.checkpoint", say=lambda *a: None)
  assert config.model.hf_path == f"{HF}/qwen2"
  assert config_lib.model_config(config).num_layers == 3  # the checkpoint's, not tiny's


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_prompts_render_as_apply_chat_template(family):
  """render_prompt of a chat record equals transformers' apply_chat_template(messages,
  add_generation_prompt=True) text and ids, template options (tools, date_string,
  enable_thinking) passed through data.chat_template_kwargs; a plain prompt renders as one
  user turn."""
  tok = HFTokenizer(os.path.join(HF, family))
  ref = json.load(open(os.path.join(HF, family, "tokenizer_ref.json")))
  chats = [c for c in ref["chats"] if c["add_generation_prompt"]]
  assert len(chats) >= 3
  for chat in chats:
    data = {"chat_template_kwargs": chat["kwargs"]}
    record = {"messages": chat["messages"]}
    assert render_prompt_text(record, tok, data) == chat["text"]
    assert render_prompt(record, tok, data) == chat["ids"]
  first = chats[0]
  assert [m["role"] for m in first["messages"]] == ["user"]
  plain = {"prompt": first["messages"][0]["content"]}
  assert render_prompt(plain, tok, {"chat_template_kwargs": first["kwargs"]}) == first["ids"]
  # data.chat=False: bos + the text, as transformers' encode() with its special tokens adds.
  text = ref["texts"][0]
  assert render_prompt({"prompt": text["text"]}, tok, {"chat": False}) == \
      text["ids_with_special"]


def test_chat_options_system_prompt_and_thinking():
  tok = HFTokenizer(os.path.join(HF, "qwen3"))
  record = {"prompt": "What is 12 plus 30?"}
  data = {"system_prompt": "Be brief.", "chat_template_kwargs": {"enable_thinking": False}}
  assert render_prompt_text(record, tok, data) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 plus 30?"
      "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
  # A record with its own system turn keeps it.
  own = {"messages": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}]}
  assert render_prompt_text(own, tok, data).startswith("<|im_start|>system\nMine.<|im_end|>")
  # Options that would be ignored are errors.
  byte = ByteTokenizer()
  with pytest.raises(ConfigError, match="data.chat=True but the tokenizer has no chat template"):
    render_prompt(record, byte, {"chat": True})
  with pytest.raises(ConfigError, match="data.chat_template_kwargs is set but prompts are not"):
    render_prompt(record, tok, {"chat": False, "chat_template_kwargs": {"enable_thinking": 0}})
  # Chat off: the system prompt goes first, joined by a blank line.
  assert render_prompt_text(record, byte, {"system_prompt": "Be brief."}) == \
      "Be brief.\n\nWhat is 12 plus 30?"


def test_byte_tokenizer_prompts_are_unchanged():
  """The built-in tiny tasks keep their exact prompt ids (bos + bytes): GRPO's demo numbers do
  not move."""
  config = config_lib.load_config("configs/grpo_tiny.py")
  prompts = Prompts(ByteTokenizer(), config.data)
  assert not prompts.chat
  for text in ("12+34=", "sort 3142:", "reverse abc:"):
    assert prompts.ids({"prompt": text, "answer": "x"}) == ByteTokenizer().encode(text, bos=True)


def test_rl_records_take_prompt_and_messages_rows(tmp_path):
  rows = [{"prompt": "2+2=", "answer": "4", "level": 1},
          {"messages": [{"role": "system", "content": "Add."},
                        {"role": "user", "content": "2+3="}], "answer": "5"}]
  records, _ = read_jsonl(_jsonl(tmp_path / "rl.jsonl", rows), "rl")
  assert records[0] == rows[0]  # extras kept for the rewards
  assert records[1]["prompt"] == "Add.\n\n2+3=" and records[1]["messages"] == rows[1]["messages"]
  assert records[1].source == f"{tmp_path}/rl.jsonl line 2"
  tok = HFTokenizer(os.path.join(HF, "qwen2"))
  assert render_prompt(records[1], tok) == tok.encode_chat(rows[1]["messages"],
                                                           add_generation_prompt=True)
  for bad, message in [
      ({"messages": [{"role": "user", "content": "a"}]}, "line 1: field 'answer' is missing"),
      ({"messages": "hi", "answer": "1"}, "line 1: field 'messages' is a str"),
      ({"messages": [{"role": "bot", "content": "a"}], "answer": "1"},
       "line 1: field 'messages[0].role' is 'bot'")]:
    with pytest.raises(ConfigError) as e:
      read_jsonl(_jsonl(tmp_path / "bad.jsonl", [bad]), "rl")
    assert str(e.value).startswith(f"{tmp_path}/bad.jsonl {message}"), str(e.value)


def test_grpo_rollout_prompts_are_chat_templated(tmp_path, repo_root, devices, monkeypatch):
  """GRPO on an instruct checkpoint with a user's JSONL of prompt and messages rows samples
  from exactly transformers' apply_chat_template(add_generation_prompt=True) ids, and stops on
  the checkpoint's eos."""
  from jaxrl.algorithms.grpo import experience, trainer
  monkeypatch.chdir(repo_root)
  ref = json.load(open(os.path.join(HF, "qwen3", "tokenizer_ref.json")))
  chat = next(c for c in ref["chats"] if c["add_generation_prompt"] and not c["kwargs"])
  user = chat["messages"][0]["content"]
  train = _jsonl(tmp_path / "rl.jsonl", [{"prompt": user, "answer": "42"},
                                         {"messages": chat["messages"], "answer": "42"}] * 2)
  config = config_lib.load_config("configs/qwen3_0p6b.py:fixture", [
      "data.task=", f"data.train_file={train}", f"data.eval_file={train}",
      "rewards=exact_match"])
  p, state = trainer.setup(config, str(tmp_path / "grpo"), out=lambda *a: None)
  try:
    assert p.rollouts.engine.sampling.stop_tokens == (p.tokenizer.eos_id,)
    assert p.evaluator.ids == [chat["ids"]] * 4  # the held-out eval prompts the same way
    prompts = next(p.rollouts.stream)
    params_s = p.rollouts.sampler_copy.refresh(state.params)
    rollout, rewards, _ = experience.sample(p, params_s, prompts, 0, 0)
    for i in range(len(rollout.lengths)):
      assert rollout.prompt_ids[i, :rollout.prompt_lengths[i]].tolist() == chat["ids"]
    assert rewards.shape == (len(prompts) * config.rollout.group_size,)
  finally:
    p.close()


# ----------------------------------------------------------------------------- SFT


def test_train_on_all_assistant_masks_every_assistant_turn():
  tok = HFTokenizer(os.path.join(HF, "qwen2"))
  messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="},
              {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2="},
              {"role": "assistant", "content": "4"}]
  record = {"prompt": "", "completion": "4", "messages": messages}

  def trained(data):
    ex = tokenize_sft(record, tok, data)
    return tok.decode(ex["targets"][ex["loss_mask"] > 0], skip_special=False)

  assert trained({"train_on": "all_assistant"}) == "3<|im_end|>\n4<|im_end|>\n"
  assert trained({"train_on": "last"}) == trained(None) == "4<|im_end|>\n"
  ex = tokenize_sft(record, tok, {"train_on": "all_assistant"})
  ids, _ = tok.encode_chat_with_mask(messages)
  np.testing.assert_array_equal(ex["inputs"], ids[:-1])
  # Through the batches, as `jaxrl sft` builds them.
  batch = next(sft_batches([record], tok, seq_len=64, batch_size=1, seed=0,
                           data_cfg={"train_on": "all_assistant"}))
  assert tok.decode(batch["targets"][0][batch["loss_mask"][0] > 0], skip_special=False) == \
      "3<|im_end|>\n4<|im_end|>\n"
  # Without a chat template: the multi-turn rollouts' plain-text convention (jaxrl.data.chat),
  # each assistant turn and its eos trained.
  ex = tokenize_sft(record, ByteTokenizer(), {"train_on": "all_assistant"})
  assert ByteTokenizer().decode(ex["targets"][ex["loss_mask"] > 0], skip_special=False) == \
      "3<eos>4<eos>"


def test_sft_prompt_rows_use_the_same_prompt_as_sampling():
  """An SFT {"prompt", "completion"} row on an instruct checkpoint trains on the very prompt ids
  GRPO and `jaxrl sample` feed (the chat template's generation prompt), then the answer."""
  tok = HFTokenizer(os.path.join(HF, "qwen3"))
  data = {"chat_template_kwargs": {"enable_thinking": False}}
  ex = tokenize_sft({"prompt": "What is 12 plus 30?", "completion": "42"}, tok, data)
  prompt = render_prompt({"prompt": "What is 12 plus 30?"}, tok, data)
  seq = np.concatenate([ex["inputs"], ex["targets"][-1:]])
  assert seq[:len(prompt)].tolist() == prompt
  assert tok.decode(ex["targets"][ex["loss_mask"] > 0], skip_special=False) == "42<|im_end|>\n"
  # The byte tokenizer: bos + prompt, completion + eos, as before.
  byte = tokenize_sft({"prompt": "1+2=", "completion": "3"}, ByteTokenizer())
  assert ByteTokenizer().decode(byte["inputs"], skip_special=False) == "<bos>1+2=3"


# ----------------------------------------------------------------------------- DPO and RM


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_dpo_and_rm_take_the_prompt_keys_and_pass_them_to_their_batches(command, repo_root):
  """DPO and RM configs carry data.chat, chat_template_kwargs and system_prompt like SFT and
  GRPO, and the skeleton's batches hand the data section to the maker, so `data.chat=False`
  reaches the pair tokenizer (before, these trainers always chat-templated an instruct
  checkpoint's pairs, with no way to turn it off)."""
  import types
  from jaxrl.data import prefs
  from jaxrl.train.run import Run
  config = config_lib.load_config(os.path.join(repo_root, "configs", f"{command}_tiny.py"),
                                  ["data.chat=False", "data.system_prompt=Be brief."])
  assert config.data.chat is False and config.data.system_prompt == "Be brief."
  seen = {}

  def make(records, tokenizer, **kwargs):
    seen.update(kwargs)
    return iter(())

  fake = types.SimpleNamespace(config=config, tokenizer=None, replicas=1)
  Run.batches(fake, make, [])
  assert seen["data_cfg"] is config.data
  # What data.chat=False changes for an instruct tokenizer: the pair's prompt is plain text.
  tok = HFTokenizer(os.path.join(HF, "qwen3"))
  pair = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
  plain = prefs.tokenize_pair(pair, tok, config.data)
  templated = prefs.tokenize_pair(pair, tok, None)
  assert len(plain["chosen"]["inputs"]) < len(templated["chosen"]["inputs"])
  # Plain text: the system prompt, a blank line, the prompt and the answer; no template turns.
  assert tok.decode(plain["chosen"]["inputs"].tolist()) == "Be brief.\n\n2+2=4"
  assert "<|im_start|>" in tok.decode(templated["chosen"]["inputs"].tolist(), skip_special=False)
