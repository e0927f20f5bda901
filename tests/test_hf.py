"""Hugging Face interop against transformers, via committed fixtures (no torch here).

tests/fixtures/make_hf_fixtures.py made tests/fixtures/hf/{llama,qwen2,qwen3} offline with torch
and transformers: tiny random-weight checkpoints, transformers' logits and greedy continuations,
tokenizer ids and chat-template renderings, and the logit diff of a jaxrl export loaded back in
transformers. Everything runs on the 8-device mesh, learner layout, fsdp 2 x tensor 4.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxrl import cli
from jaxrl import config as config_lib
from jaxrl.data.hf_tokenizer import HFTokenizer
from jaxrl.errors import ConfigError
from jaxrl.io import hf
from jaxrl.io.params import load_params, save_params
from jaxrl.models import apply, init_cache
from jaxrl.parallel import cache_sharding, make_mesh, param_shardings

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
FAMILIES = ("llama", "qwen2", "qwen3")
FWD = jax.jit(lambda g, p, t, pos=None, cache=None: apply(g, p, t, pos, cache=cache),
              static_argnums=0)


def fixture(name):
  return os.path.join(FIXTURES, name)


def hf_tensors(path) -> dict[str, np.ndarray]:
  """Every tensor of an HF directory, by name (single file or sharded)."""
  out = {}
  for f in sorted(os.listdir(path)):
    if f.endswith(".safetensors"):
      out.update(load_file(os.path.join(path, f)))
  return out


def leaves_equal(a, b) -> bool:
  fa, fb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  return [p for p, _ in fa] == [p for p, _ in fb] and all(
      x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
      for (_, x), (_, y) in zip(fa, fb))


@pytest.fixture(scope="module")
def mesh(devices):
  return make_mesh(data=1, fsdp=2, tensor=4)


@pytest.fixture(scope="module")
def loaded(mesh):
  """family -> (cfg, graphdef, params, reader log), each fixture loaded once."""
  out = {}
  for name in FAMILIES:
    reader = hf._Reader()
    cfg, graphdef, params = hf.load_hf(fixture(name), mesh, "learner", reader=reader)
    out[name] = (cfg, graphdef, params, reader.reads)
  return out


# ----------------------------------------------------------------------------- config.json


def test_config_json_maps_each_family():
  llama = hf.config_from_hf(hf.read_hf_config(fixture("llama")))
  qwen2 = hf.config_from_hf(hf.read_hf_config(fixture("qwen2")))
  qwen3 = hf.config_from_hf(hf.read_hf_config(fixture("qwen3")))
  assert (llama.qkv_bias, llama.qk_norm, llama.tie_embeddings) == (False, False, False)
  assert llama.rope_theta == 500000.0 and llama.norm_eps == 1e-5
  assert llama.rope_scaling == hf.RopeScaling(8.0, 1.0, 4.0, 32)  # from rope_parameters (v5)
  assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.tie_embeddings) == (True, False, True)
  assert qwen2.num_layers == 3 and qwen2.head_dim == 16 and qwen2.rope_theta == 1e6
  assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.tie_embeddings) == (False, True, True)
  assert qwen3.head_dim == 32 and qwen3.embed_dim // qwen3.num_heads == 16  # head_dim != D/N
  for cfg in (llama, qwen2, qwen3):
    assert cfg.vocab_size == 512 and cfg.param_dtype == "float32"
    # config_to_hf writes the pre-v5 keys (rope_theta, rope_scaling); both read back the same.
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg


def test_bf16_checkpoint_dtype_is_kept():
  hfc = dict(hf.read_hf_config(fixture("qwen3")), dtype="bfloat16")
  assert hf.config_from_hf(hfc).param_dtype == "bfloat16"
  assert hf.config_from_hf(hfc, param_dtype="float32").param_dtype == "float32"


@pytest.mark.parametrize("patch, pattern", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     r"architecture GPT2LMHeadModel is not supported: jaxrl reads LlamaForCausalLM, "
     r"Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     r"rope_scaling type 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"use_sliding_window": True}, r"use_sliding_window=true is not supported"),
])
def test_unsupported_configs_name_the_field(patch, pattern):
  with pytest.raises(ConfigError, match=pattern):
    hf.config_from_hf({**hf.read_hf_config(fixture("qwen3")), **patch})


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(loaded, name):
  cfg, graphdef, params, _ = loaded[name]
  ref = np.load(os.path.join(fixture(name), "reference.npz"))
  logits, _ = FWD(graphdef, params, jnp.asarray(ref["tokens"], jnp.int32))
  diff = np.abs(np.asarray(logits) - ref["logits"]).max()
  # fp32 on both sides; the logits reach |50|, so 1e-4 is a relative error of ~2e-6.
  assert diff < 1e-4, f"{name}: max |logit diff| {diff}"
  assert np.abs(ref["logits"]).max() > 4.0  # the fixture's logits are spread, not near-uniform


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_decode_matches_transformers(mesh, loaded, name):
  """Prefill plus cached single-token steps (the sampler's path) reproduce transformers'
  greedy continuation."""
  cfg, graphdef, params, _ = loaded[name]
  ref = np.load(os.path.join(fixture(name), "reference.npz"))
  prompt, want = ref["prompt"].astype(np.int32), ref["greedy"]
  B, P = prompt.shape
  S = P + want.shape[1]
  cache = jax.device_put(init_cache(cfg, B, S), [cache_sharding(mesh, cfg, B, S)] * cfg.num_layers)
  logits, cache = FWD(graphdef, params, jnp.asarray(prompt),
                      jnp.broadcast_to(jnp.arange(P), (B, P)), cache=cache)
  out = []
  tok = np.asarray(logits)[:, -1].argmax(-1)
  for i in range(want.shape[1]):
    out.append(tok)
    logits, cache = FWD(graphdef, params, jnp.asarray(tok[:, None], jnp.int32),
                        jnp.full((B, 1), P + i), cache=cache)
    tok = np.asarray(logits)[:, -1].argmax(-1)
  np.testing.assert_array_equal(np.stack(out, 1), want)


def test_params_land_in_the_learner_layout_from_shard_sized_reads(mesh, loaded):
  for name in FAMILIES:
    cfg, _, params, reads = loaded[name]
    want = param_shardings(cfg, mesh, "learner")
    assert all(jax.tree.leaves(jax.tree.map(
        lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), params, want)))
    maps = hf.tensor_map(cfg)
    full = {m.hf_name: int(np.prod(m.hf_shape)) for m in maps.values()}
    for tensor, shape in reads:
      if len(shape) == 2:  # every matrix is sharded over fsdp=2 at least: no whole reads
        assert int(np.prod(shape)) <= full[tensor] // 2, (tensor, shape)
    # Each distinct shard is read once, however many of this host's devices hold it.
    count = {}
    for tensor, _ in reads:
      count[tensor] = count.get(tensor, 0) + 1
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
      m = maps[hf._path_of(path)]
      shards = {tuple((s.start, s.stop) for s in hf._norm_index(ix, x.shape))
                for ix in x.sharding.devices_indices_map(x.shape).values()}
      assert count[m.hf_name] == len(shards), m.hf_name


def test_sharded_index_checkpoint_reads_every_file(loaded):
  files = hf._weight_files(fixture("qwen2"))
  assert os.path.isfile(os.path.join(fixture("qwen2"), "model.safetensors.index.json"))
  assert len(set(files.values())) == 7
  _, _, _, reads = loaded["qwen2"]
  assert {t for t, _ in reads} == set(files)  # every tensor of every shard was read


# ----------------------------------------------------------------------------- export


def test_export_is_bit_exact_and_reimports_bit_exact(tmp_path, mesh, loaded):
  for name in FAMILIES:
    cfg, _, params, _ = loaded[name]
    out = tmp_path / name
    files = hf.save_hf(str(out), cfg, params, max_shard_bytes=150_000)
    assert "model.safetensors.index.json" in files and len(files) > 3
    index = json.load(open(out / "model.safetensors.index.json"))
    assert set(index["weight_map"].values()) == {f for f in files if f.endswith(".safetensors")}
    # Readable by whoever may read the JSON beside them (safetensors alone writes them 0600).
    assert {os.stat(out / f).st_mode & 0o777 for f in files} == {
        os.stat(out / "config.json").st_mode & 0o777}
    original, exported = hf_tensors(fixture(name)), hf_tensors(str(out))
    assert set(original) == set(exported)
    for k, v in original.items():
      assert exported[k].dtype == v.dtype and np.array_equal(exported[k], v), k
    cfg2, _, params2 = hf.load_hf(str(out), mesh)
    assert cfg2 == cfg and leaves_equal(params, params2)


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_loaded_the_jaxrl_export_identically(name):
  """Recorded offline by make_hf_fixtures.py: the fixture went through `jaxrl convert`
  hf-to-jaxrl and jaxrl-to-hf, and transformers loaded the result."""
  check = json.load(open(os.path.join(fixture(name), "export_check.json")))
  assert check["max_abs_logit_diff"] == 0.0 and check["state_dict_equal"] is True
  assert "model.safetensors.index.json" in check["exported_files"]


def test_bf16_export_round_trip(tmp_path, mesh):
  cfg, _, params = hf.load_hf(fixture("qwen3"), mesh, param_dtype="bfloat16")
  assert params["embed"].dtype == jnp.bfloat16
  hf.save_hf(str(tmp_path), cfg, params)
  assert hf.read_hf_config(str(tmp_path))["torch_dtype"] == "bfloat16"
  with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
    assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
  cfg2, _, params2 = hf.load_hf(str(tmp_path), mesh)
  assert cfg2.param_dtype == "bfloat16" and leaves_equal(params, params2)


# ----------------------------------------------------------------------------- errors


def _copy(name, tmp_path):
  dst = tmp_path / name
  shutil.copytree(fixture(name), dst)
  return dst


def test_missing_tensor_is_named(tmp_path, mesh):
  dst = _copy("llama", tmp_path)
  tensors = load_file(str(dst / "model.safetensors"))
  del tensors["model.layers.1.mlp.down_proj.weight"]
  save_file(tensors, str(dst / "model.safetensors"))
  with pytest.raises(ConfigError, match=r"tensor model\.layers\.1\.mlp\.down_proj\.weight is "
                     r"missing"):
    hf.load_hf(str(dst), mesh)


def test_missing_tensor_in_sharded_index_is_named(tmp_path, mesh):
  dst = _copy("qwen2", tmp_path)
  index = json.load(open(dst / "model.safetensors.index.json"))
  del index["weight_map"]["model.layers.2.self_attn.k_proj.bias"]
  json.dump(index, open(dst / "model.safetensors.index.json", "w"))
  with pytest.raises(ConfigError, match=r"tensor model\.layers\.2\.self_attn\.k_proj\.bias is "
                     r"missing"):
    hf.load_hf(str(dst), mesh)


def test_missing_shard_file_is_named(tmp_path, mesh):
  dst = _copy("qwen2", tmp_path)
  os.remove(dst / "model-00003-of-00007.safetensors")
  with pytest.raises(ConfigError, match=r"is in model-00003-of-00007\.safetensors, which is "
                     r"missing"):
    hf.load_hf(str(dst), mesh)


def test_shape_mismatch_is_named(tmp_path, mesh):
  dst = _copy("qwen3", tmp_path)
  cfg = json.load(open(dst / "config.json"))
  cfg["intermediate_size"] = 96
  json.dump(cfg, open(dst / "config.json", "w"))
  with pytest.raises(ConfigError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has "
                     r"shape \[128, 64\] but config\.json implies \[96, 64\]"):
    hf.load_hf(str(dst), mesh)


def test_unsupported_architecture_is_named(tmp_path, mesh):
  dst = _copy("llama", tmp_path)
  cfg = json.load(open(dst / "config.json"))
  cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
  json.dump(cfg, open(dst / "config.json", "w"))
  with pytest.raises(ConfigError, match=r"architecture MistralForCausalLM is not supported"):
    hf.load_hf(str(dst), mesh)


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("name", FAMILIES)
def test_tokenizer_matches_transformers(name):
  tok = HFTokenizer(fixture(name))
  ref = json.load(open(os.path.join(fixture(name), "tokenizer_ref.json")))
  for case in ref["texts"]:
    assert tok.encode(case["text"]) == case["ids"]
    # transformers adds the special tokens its post-processor holds: bos for Llama 3, none
    # for Qwen; encode(bos=True) is that, through jaxrl's explicit flag.
    assert tok.encode(case["text"], bos=True) == case["ids_with_special"]
    assert tok.decode(case["ids"]) == case["decoded"] == case["text"]
    assert tok.eos_id == case["eos_id"] and tok.bos_id == case["bos_id"]
    assert tok.pad_id == (case["pad_id"] if case["pad_id"] is not None else case["eos_id"])
  assert tok.encode("hi", eos=True)[-1] == tok.eos_id
  assert tok.vocab_size <= 512


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_template_matches_transformers(name):
  tok = HFTokenizer(fixture(name))
  ref = json.load(open(os.path.join(fixture(name), "tokenizer_ref.json")))
  chats = ref["chats"]
  assert len(chats) >= 6 and {c["add_generation_prompt"] for c in chats} == {False, True}
  for case in chats:
    text = tok.apply_chat_template(case["messages"],
                                   add_generation_prompt=case["add_generation_prompt"],
                                   **case["kwargs"])
    assert text == case["text"]
    assert tok.encode_chat(case["messages"], add_generation_prompt=case["add_generation_prompt"],
                           **case["kwargs"]) == case["ids"]


def test_chat_template_from_chat_template_jinja(tmp_path):
  """transformers >= 4.5x saves the template to chat_template.jinja instead of the config."""
  dst = _copy("qwen3", tmp_path)
  cfg = json.load(open(dst / "tokenizer_config.json"))
  (dst / "chat_template.jinja").write_text(cfg.pop("chat_template"))
  json.dump(cfg, open(dst / "tokenizer_config.json", "w"))
  case = json.load(open(dst / "tokenizer_ref.json"))["chats"][-1]
  assert HFTokenizer(str(dst)).apply_chat_template(
      case["messages"], add_generation_prompt=case["add_generation_prompt"],
      **case["kwargs"]) == case["text"]


def test_re_export_replaces_old_shards(tmp_path, loaded):
  cfg, _, params, _ = loaded["llama"]
  hf.save_hf(str(tmp_path), cfg, params, max_shard_bytes=100_000)
  assert os.path.isfile(tmp_path / "model.safetensors.index.json")
  assert hf.save_hf(str(tmp_path), cfg, params)[0] == "model.safetensors"
  assert sorted(f for f in os.listdir(tmp_path) if "safetensors" in f) == ["model.safetensors"]


def test_chat_special_tokens_decode_and_skip():
  tok = HFTokenizer(fixture("qwen3"))
  ids = tok.encode_chat([{"role": "user", "content": "Hello!"}], add_generation_prompt=True)
  assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nHello!<|im_end|>\n" \
                                                "<|im_start|>assistant\n"
  assert tok.decode(ids) == "user\nHello!\nassistant\n"


def test_chat_mask_covers_assistant_turns_only():
  tok = HFTokenizer(fixture("llama"))
  messages = [{"role": "user", "content": "What is 12 plus 30?"},
              {"role": "assistant", "content": "The answer is 42."},
              {"role": "user", "content": "And 1 + 1?"},
              {"role": "assistant", "content": "2"}]
  ids, mask = tok.encode_chat_with_mask(messages, date_string="26 Jul 2024")
  assert ids == tok.encode_chat(messages, date_string="26 Jul 2024") and len(mask) == len(ids)
  masked = tok.decode([i for i, m in zip(ids, mask) if m], skip_special=False)
  assert masked == "The answer is 42.<|eot_id|>2<|eot_id|>"


@pytest.mark.parametrize("name, completion", [
    ("llama", "Now she has 8 apples.<|eot_id|>"),
    ("qwen2", "  Now she has 8 apples.  <|im_end|>\n"),
    # Qwen3 writes an empty think block into the final answer unless one is given.
    ("qwen3", "<think>\n\n</think>\n\n  Now she has 8 apples.  <|im_end|>\n"),
])
def test_chat_sft_split(name, completion):
  tok = HFTokenizer(fixture(name))
  messages = [{"role": "user", "content": "Alice has 3 apples and buys 5 more."},
              {"role": "assistant", "content": "  Now she has 8 apples.  "}]
  kw = {"date_string": "26 Jul 2024"} if name == "llama" else {}
  prompt, comp = tok.encode_chat_sft(messages, **kw)
  assert tok.decode(comp, skip_special=False) == completion
  assert tok.decode(prompt + comp, skip_special=False) == tok.apply_chat_template(messages, **kw)
  assert tok.decode(prompt, skip_special=False) == tok.apply_chat_template(
      messages[:1], add_generation_prompt=True, **kw)


def test_chat_mask_refuses_templates_that_rewrite_history():
  tok = HFTokenizer(fixture("qwen3"))  # Qwen3 drops the reasoning of earlier turns
  messages = [{"role": "user", "content": "a"},
              {"role": "assistant", "content": "b", "reasoning_content": "think"},
              {"role": "user", "content": "c"},
              {"role": "assistant", "content": "d"}]
  with pytest.raises(ConfigError, match=r"renders turn 1 differently"):
    tok.encode_chat_with_mask(messages)


def test_tokenizer_errors(tmp_path):
  with pytest.raises(ConfigError, match=r"holds no tokenizer\.json"):
    HFTokenizer(str(tmp_path))
  dst = _copy("qwen2", tmp_path)
  cfg = json.load(open(dst / "tokenizer_config.json"))
  cfg["eos_token"] = "<|not_a_token|>"
  del cfg["chat_template"]
  json.dump(cfg, open(dst / "tokenizer_config.json", "w"))
  with pytest.raises(ConfigError, match=r"eos_token='<\|not_a_token\|>' is not in"):
    HFTokenizer(str(dst))
  cfg["eos_token"] = "<|im_end|>"
  json.dump(cfg, open(dst / "tokenizer_config.json", "w"))
  with pytest.raises(ConfigError, match=r"has no chat_template"):
    HFTokenizer(str(dst)).apply_chat_template([{"role": "user", "content": "x"}])


# ----------------------------------------------------------------------------- CLI and config


def test_convert_cli_round_trip(tmp_path, mesh, loaded, capsys):
  src = fixture("qwen2")
  cli.main(["convert", "hf-to-jaxrl", "--src", src, "--out", str(tmp_path / "j"),
            "--config.mesh.tensor=4"])
  assert sorted(os.listdir(tmp_path / "j")) == ["config.json", "hf", "params"]
  cfg, _, params = load_params(str(tmp_path / "j"), mesh, "learner")
  assert leaves_equal(params, loaded["qwen2"][2])
  cli.main(["convert", "jaxrl-to-hf", "--checkpoint", str(tmp_path / "j"), "--out",
            str(tmp_path / "h"), "--max-shard-mb", "0.2"])
  out = capsys.readouterr().out
  assert "hf-to-jaxrl: 162,624 parameters (float32, 3 layers, family qwen2)" in out
  original, exported = hf_tensors(src), hf_tensors(str(tmp_path / "h"))
  assert set(original) == set(exported)
  assert all(np.array_equal(original[k], exported[k]) for k in original)
  # The tokenizer travels, and the HF config keeps the fields jaxrl does not model.
  assert HFTokenizer(str(tmp_path / "h")).chat_template == HFTokenizer(src).chat_template
  assert hf.read_hf_config(str(tmp_path / "h"))["max_window_layers"] == \
      hf.read_hf_config(src)["max_window_layers"]


def test_convert_cli_errors_are_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["convert", "jaxrl-to-hf", "--checkpoint", str(tmp_path), "--out", str(tmp_path)])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "is not a jaxrl checkpoint" in err


def test_save_and_load_params_across_layouts(tmp_path, mesh, loaded):
  cfg, _, params, _ = loaded["llama"]
  save_params(str(tmp_path / "c"), cfg, params)
  cfg2, _, p2 = load_params(str(tmp_path / "c"), make_mesh(fsdp=8), "learner")
  assert cfg2 == cfg and leaves_equal(params, p2)
  assert p2["embed"].sharding.shard_shape((512, 64)) == (512, 8)  # restored as fsdp=8 shards


def test_model_hf_path_in_a_config(repo_root, mesh, loaded):
  spec = os.path.join(repo_root, "configs", "qwen3_0p6b.py")
  config = config_lib.load_config(spec + ":fixture")
  cfg = config_lib.model_config(config)
  assert cfg == loaded["qwen3"][0]  # config.json replaced the preset
  cfg2, _, params = hf.params_from_config(config, mesh)
  assert leaves_equal(params, loaded["qwen3"][2])
  # Overrides still apply on top of config.json.
  config = config_lib.load_config(spec + ":fixture", ["--config.model.max_seq_len=64"])
  assert config_lib.model_config(config).max_seq_len == 64
  # Before the download the preset's shapes stand in, and loading weights names the path.
  config = config_lib.load_config(spec, ["--config.model.hf_path=/nonexistent/Qwen3-0.6B"])
  assert config_lib.model_config(config).num_params == 596_049_920
  with pytest.raises(ConfigError, match=r"model\.hf_path='/nonexistent/Qwen3-0.6B' holds no "
                     r"config\.json"):
    hf.params_from_config(config, mesh)


def test_random_init_without_hf_path(mesh):
  config = config_lib.base_config()
  config.model.preset = "tiny-qwen3"
  config.model.num_layers = 1  # compile time: the path, not the size, is under test
  cfg, _, params = hf.params_from_config(config, mesh)
  assert cfg.qk_norm and params["layers"][0]["attn"]["q_norm"]["scale"].shape == (32,)


def test_two_processes_read_only_their_shards(tmp_path, free_port):
  """Two processes x 4 CPU devices form one fsdp 2 x tensor 4 mesh: each process reads half of
  every matrix (its fsdp row) and never a whole one, the logits still match transformers, and
  the export (gathered tensor by tensor, written by process 0) is bit-exact."""
  import subprocess
  import sys
  port = free_port
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_two_hosts.py")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  procs = [subprocess.Popen([sys.executable, script, str(i), str(port), fixture("qwen2"),
                             str(tmp_path / "out")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  results = []
  for p in procs:
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-3000:]
    results.append(json.loads(out.strip().splitlines()[-1]))
  for r in results:
    assert (r["devices"], r["local"]) == (8, 4)
    assert r["max_logit_diff"] < 1e-4
    for name, n in r["read"].items():
      if name.endswith("_proj.weight") or name == "model.embed_tokens.weight":
        assert n == r["full"][name] // 2, (r["process"], name, n)  # its fsdp row, once
    assert set(r["read"]) == set(r["full"])
  original, exported = hf_tensors(fixture("qwen2")), hf_tensors(str(tmp_path / "out"))
  assert set(original) == set(exported)
  assert all(np.array_equal(original[k], exported[k]) for k in original)


def test_trainers_start_from_hf_weights_and_tokenizer(tmp_path, repo_root, devices):
  """model.hf_path gives the trainers the checkpoint's tokenizer and weights: an SFT pulse on
  the Qwen3 fixture starts from exactly its params and runs with its BPE tokenizer."""
  import jax
  import optax

  from jaxrl import config as config_lib
  from jaxrl.data.hf_tokenizer import HFTokenizer, tokenizer_for
  from jaxrl.io.hf import load_hf
  from jaxrl.parallel import make_mesh
  from jaxrl.algorithms import sft
  from jaxrl.train.state import init_train_state, start_from_hf
  fixture = os.path.join(repo_root, "tests", "fixtures", "hf", "qwen3")
  config = config_lib.load_config(os.path.join(repo_root, "configs/sft_tiny.py:runlocal"),
                                  [f"model.hf_path={fixture}", "train.steps=2",
                                   "data.seq_len=48",  # the chat template's tokens too
                                   "train.log_every=1", "eval.every=2", "eval.examples=8",
                                   "eval.batch_size=8"])
  assert isinstance(tokenizer_for(config), HFTokenizer)
  mesh = make_mesh()
  cfg = config_lib.model_config(config)
  _, state, _ = init_train_state(cfg, mesh, optax.adamw(1e-3), seed=0)
  state = start_from_hf(config, state, mesh)
  _, _, ref = load_hf(fixture, mesh, "learner", cfg=cfg)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  summary = sft.run(config, str(tmp_path / "sft"), out=lambda *a: None)
  assert summary["status"] == "completed" and np.isfinite(summary["metrics"]["loss"])
  assert "eval/accuracy" in summary["eval"]
