"""Preference data: reading (plain and chat), cleaning, fingerprints, built-in pairs, batches."""

import json
import os
import subprocess

import numpy as np
import pytest

from conftest import JAXRL
from jaxrl.data import ByteTokenizer, read_jsonl, sft_batches
from jaxrl.data.prefs import (clean_prefs, fingerprint, kto_batches, normalize_text,
                              prefs_batches, read_kto, read_prefs, task_prefs)
from jaxrl.errors import ConfigError
from jaxrl.tasks import get_task

HF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


def _write(tmp_path, rows, name="prefs.jsonl"):
  path = tmp_path / name
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def _chat(user, answer):
  return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_plain_and_chat_pairs_read_the_same(tmp_path):
  # UltraFeedback-binarized rows: prompt plus message lists that carry the prompt again.
  path = _write(tmp_path, [
      {"prompt": "12+34=", "chosen": "46", "rejected": "45"},
      {"prompt": "1+2=", "chosen": _chat("1+2=", "3"), "rejected": _chat("1+2=", "4"),
       "score_chosen": 9.0, "score_rejected": 2.0},
      {"chosen": _chat("5+5=", "10"), "rejected": _chat("5+5=", "11")},
  ])
  records, skipped = read_prefs(path)
  assert skipped == 0
  assert [(r["prompt"], r["chosen"], r["rejected"]) for r in records] == [
      ("12+34=", "46", "45"), ("1+2=", "3", "4"), ("5+5=", "10", "11")]
  assert records[1]["messages"] == [{"role": "user", "content": "1+2="}]
  assert "messages" not in records[0]
  assert records[2].source == f"{path} line 3"


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "chosen": "b"}, r"line 1: field 'rejected' is missing"),
    ({"prompt": "a", "chosen": "b", "rejected": ""}, r"line 1: field 'rejected' is empty"),
    ({"prompt": "a", "chosen": _chat("a", "b"), "rejected": "c"},
     r"line 1: field 'rejected' is a str while the other side is a message list"),
    ({"chosen": _chat("a", "b"), "rejected": _chat("x", "c")},
     r"line 1: fields 'chosen' and 'rejected' differ before their final assistant turn"),
    ({"prompt": "zzz", "chosen": _chat("a", "b"), "rejected": _chat("a", "c")},
     r"line 1: field 'prompt' is not the user turn of 'chosen'"),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": _chat("a", "c")},
     r"line 1 chosen: field 'messages' has 1 turn"),
])
def test_bad_pairs_name_file_line_and_field(tmp_path, row, message):
  path = _write(tmp_path, [row])
  with pytest.raises(ConfigError, match=message):
    read_prefs(path)
  records, skipped = read_prefs(path, on_bad_row="skip")
  assert (records, skipped) == ([], 1)


def test_dedup_and_decontamination_counts_on_a_crafted_file(tmp_path):
  rows = [
      {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"},
      {"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"},        # exact duplicate
      {"prompt": "what is  2+2? ", "chosen": "4.", "rejected": "5"},     # normalised duplicate
      {"prompt": "What is 3+3?", "chosen": "6", "rejected": "6."},       # tie after normalising
      {"prompt": "Please compute 17+25= for me", "chosen": "42", "rejected": "41"},  # eval hit
      {"prompt": "Name the capital of France in one word today please now",
       "chosen": "Paris", "rejected": "Lyon"},                          # 8-gram overlap
      {"prompt": "Name a prime number", "chosen": "7", "rejected": "8"},  # clean
  ]
  records, _ = read_prefs(_write(tmp_path, rows))
  evals = ["17+25=", "Q: name the capital of France in one word today please, thanks"]
  kept, report = clean_prefs(records, eval_prompts=evals, ngram=8)
  assert report == dict(read=7, duplicates_exact=1, duplicates_normalized=1, ties=1,
                        contaminated=2, kept=2)
  assert [r["prompt"] for r in kept] == ["What is 2+2?", "Name a prime number"]
  # A 12-word window is longer than the run of words the France prompt shares with the eval.
  _, report9 = clean_prefs(records, eval_prompts=evals, ngram=12)
  assert report9["contaminated"] == 1
  assert normalize_text("  Hello   World. ") == "hello world"
  with pytest.raises(ConfigError, match="ngram=0"):
    clean_prefs(records, ngram=0)


def test_fingerprint_is_content_not_source(tmp_path):
  rows = [{"prompt": "a", "chosen": "b", "rejected": "c"},
          {"prompt": "d", "chosen": "e", "rejected": "f"}]
  a, _ = read_prefs(_write(tmp_path, rows, "a.jsonl"))
  b, _ = read_prefs(_write(tmp_path, [""] + rows, "b.jsonl"))  # other lines, same content
  assert fingerprint(a) == fingerprint(b) == fingerprint(rows)
  assert fingerprint(a).startswith("sha256:") and len(fingerprint(a)) == 7 + 64
  assert fingerprint(rows[::-1]) != fingerprint(rows)
  assert fingerprint(rows[:1]) != fingerprint(rows)


@pytest.mark.parametrize("name", ["addition", "sort", "reverse"])
def test_task_pairs_prefer_the_correct_answer(name):
  task = get_task(name)
  answers = {r["prompt"]: r["answer"] for r in task.records("train", 50, 3)}
  pairs = task_prefs(task, "train", 50, 3)
  assert pairs == task_prefs(name, "train", 50, 3)  # seeded
  for p in pairs:
    assert p["chosen"] == answers[p["prompt"]] != p["rejected"]
    assert task.check(p["chosen"], answers[p["prompt"]]) == 1.0
    assert task.check(p["rejected"], answers[p["prompt"]]) == 0.0


def test_biased_labeller_prefers_longer_wrong_answers():
  task = get_task("addition")
  pairs = task_prefs(task, "train", 200, 0, bias="longer", bias_rate=0.75)
  answers = {r["prompt"]: r["answer"] for r in task.records("train", 200, 0)}
  biased = [p for p in pairs if p["rejected"] == answers[p["prompt"]]]
  assert len(biased) == 150
  for p in biased:
    assert len(p["chosen"]) > len(p["rejected"])
    assert p["chosen"].isdigit() and task.check(p["chosen"], answers[p["prompt"]]) == 0.0
  honest = [p for p in pairs if p["chosen"] == answers[p["prompt"]]]
  assert len(honest) == 50
  with pytest.raises(ConfigError, match="bias='shorter'"):
    task_prefs(task, "train", 4, 0, bias="shorter")
  with pytest.raises(ConfigError, match="bias_rate=1.5"):
    task_prefs(task, "train", 4, 0, bias="longer", bias_rate=1.5)


def test_pair_batches_are_two_sft_rows():
  tok = ByteTokenizer()
  pairs = task_prefs("addition", "train", 8, 0)
  it = prefs_batches(pairs, tok, seq_len=16, batch_size=4, seed=0, shuffle=False)
  b = next(it)
  assert {k: v.shape for k, v in b.items()} == {k: (4, 2, 16) for k in
                                                 ("inputs", "targets", "loss_mask", "positions",
                                                  "segment_ids")}
  # Each side is exactly the SFT row of {prompt, completion=side}.
  for side, i in (("chosen", 0), ("rejected", 1)):
    sft = next(sft_batches([{"prompt": p["prompt"], "completion": p[side]} for p in pairs[:4]],
                           tok, seq_len=16, batch_size=4, seed=0, shuffle=False))
    for k in sft:
      np.testing.assert_array_equal(b[k][:, i], sft[k])
  assert tok.decode(b["targets"][0, 0][b["loss_mask"][0, 0] > 0]) == pairs[0]["chosen"]
  # Checkpointable: a restored iterator continues with the same batch.
  state = it.get_state()
  want = next(it)
  it2 = prefs_batches(pairs, tok, seq_len=16, batch_size=4, seed=0, shuffle=False)
  it2.set_state(state)
  got = next(it2)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])


def test_over_long_pair_names_its_side(tmp_path):
  path = _write(tmp_path, [{"prompt": "1+1=", "chosen": "2", "rejected": "2" * 30},
                           {"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
  records, _ = read_prefs(path)
  with pytest.raises(ConfigError, match=r"line 1: field 'rejected' makes the row 35 tokens"):
    prefs_batches(records, ByteTokenizer(), seq_len=16, batch_size=1, seed=0)
  it = prefs_batches(records, ByteTokenizer(), seq_len=16, batch_size=1, seed=0,
                     on_bad_row="skip")
  assert it.skipped == 1


def test_kto_rows_and_batches(tmp_path):
  path = _write(tmp_path, [{"prompt": "1+1=", "completion": "2", "label": True},
                           {"prompt": "2+2=", "completion": "5", "label": False},
                           {"prompt": "3+3=", "completion": "6", "label": "yes"}])
  with pytest.raises(ConfigError, match=r"line 3: field 'label' is 'yes': give true"):
    read_kto(path)
  records, skipped = read_kto(path, on_bad_row="skip")
  assert skipped == 1 and [r["label"] for r in records] == [True, False]
  b = next(kto_batches(records, ByteTokenizer(), seq_len=8, batch_size=2, seed=0,
                       shuffle=False))
  np.testing.assert_array_equal(b["label"], np.float32([1.0, 0.0]))
  assert b["inputs"].shape == (2, 8) and b["label"].dtype == np.float32


def test_chat_records_use_the_tokenizers_chat_template(tmp_path):
  """[hf] {"messages"} SFT records and chat pairs render through an HF chat template."""
  from jaxrl.data.hf_tokenizer import HFTokenizer
  from jaxrl.data.pipeline import tokenize_sft
  from jaxrl.data.prefs import tokenize_pair
  tok = HFTokenizer(os.path.join(HF, "qwen2"))
  messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="},
              {"role": "assistant", "content": "3"}]
  records, _ = read_jsonl(_write(tmp_path, [{"messages": messages}], "sft.jsonl"), "sft")
  ex = tokenize_sft(records[0], tok)
  prompt, completion = tok.encode_chat_sft(messages)
  seq = prompt + completion
  np.testing.assert_array_equal(ex["inputs"], seq[:-1])
  np.testing.assert_array_equal(ex["targets"][ex["loss_mask"] > 0], completion)
  assert "<|im_start|>assistant\n" in tok.decode(prompt, skip_special=False)
  assert tok.eos_id in completion
  # The byte tokenizer has no template: the same record trains on its text form.
  byte = tokenize_sft(records[0], ByteTokenizer())
  assert ByteTokenizer().decode(byte["inputs"]) == "Add.\n\n1+2=3"
  # A chat pair: each side is the template's rendering of that side.
  pair = {"prompt": "1+2=", "chosen": "3", "rejected": "4",
          "messages": messages[:2]}
  sides = tokenize_pair(pair, tok)
  for side in ("chosen", "rejected"):
    p, c = tok.encode_chat_sft(messages[:2] + [{"role": "assistant", "content": pair[side]}])
    np.testing.assert_array_equal(sides[side]["targets"][sides[side]["loss_mask"] > 0], c)


def test_cli_data_prefs(tmp_path, repo_root):
  out = tmp_path / "p.jsonl"
  res = subprocess.run([JAXRL, "data", "prefs", "--task", "addition", "--n", "20", "--bias",
                        "longer", "--bias-rate", "0.5", "--out", str(out)],
                       capture_output=True, text=True, cwd=repo_root)
  assert res.returncode == 0, res.stderr
  records, _ = read_prefs(str(out))
  assert records == task_prefs("addition", "train", 20, 0, bias="longer", bias_rate=0.5)
  assert fingerprint(records) in res.stdout and "bias longer at rate 0.5" in res.stdout
