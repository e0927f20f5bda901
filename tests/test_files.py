"""Data files on disk (jaxrl/data/files.py): Parquet, Arrow files and `datasets` save_to_disk
directories (written here with pyarrow alone), the data.fields mapping, and bad files and rows
named by file, row and field. Nothing downloads."""

import json
import os

import ml_collections
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl import cli
from jaxrl.data import files, read_jsonl, read_records
from jaxrl.data.prefs import read_prefs
from jaxrl.errors import ConfigError
from jaxrl.rewards import REWARDS
from jaxrl.train.data import records as trainer_records

GSM = {"question": "prompt"}


def _parquet(path, columns, schema=None):
  pq.write_table(pa.table(columns, schema=schema), str(path))
  return str(path)


def _save_to_disk(directory, table, shards=2):
  """The layout datasets' Dataset.save_to_disk writes: data-*.arrow Arrow IPC streams, listed
  in state.json, beside dataset_info.json."""
  os.makedirs(directory)
  per = -(-table.num_rows // shards)
  names = []
  for k in range(shards):
    name = f"data-{k:05d}-of-{shards:05d}.arrow"
    with pa.OSFile(os.path.join(directory, name), "wb") as sink:
      with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table.slice(k * per, per))
    names.append({"filename": name})
  with open(os.path.join(directory, "state.json"), "w") as f:
    json.dump({"_data_files": names, "_fingerprint": "0123", "_format_columns": None,
               "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
               "_split": "train"}, f)
  with open(os.path.join(directory, "dataset_info.json"), "w") as f:
    json.dump({"features": {n: {"_type": "Value"} for n in table.schema.names}}, f)
  return str(directory)


def _one_line(e) -> str:
  text = str(e.value)
  assert "\n" not in text and "Traceback" not in text
  return text


# ----------------------------------------------------------------------------- Parquet


def test_parquet_rl_with_field_mapping(tmp_path):
  path = _parquet(tmp_path / "train.parquet", {
      "question": ["What is 1 + 2?", "What is 3 + 4?"],
      "answer": ["1 + 2 = 3\n#### 3", "3 + 4 = 7\n#### 7"],
      "level": [1, 2]})
  recs, skipped = read_records(path, "rl", fields=GSM)
  assert skipped == 0
  assert recs == [{"prompt": "What is 1 + 2?", "answer": "1 + 2 = 3\n#### 3", "level": 1},
                  {"prompt": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7", "level": 2}]
  assert recs[1].source == f"{path} row 1"
  # the generic reader gives the renamed rows, unchecked against a record kind
  assert files.read_records(path, GSM)[0]["prompt"] == "What is 1 + 2?"


def test_parquet_bad_rows_name_file_row_and_field(tmp_path):
  path = _parquet(tmp_path / "bad.parquet", {
      "question": ["a?", "b?", "c?", ""], "answer": ["1", None, "3", "4"]})
  with pytest.raises(ConfigError) as e:
    read_records(path, "rl", fields=GSM)
  assert _one_line(e) == (f"{path} row 1: field 'answer' is missing: every row needs a "
                          "non-empty 'answer' string (or set on_bad_row=skip).")
  recs, skipped = read_records(path, "rl", fields=GSM, on_bad_row="skip")
  assert [r["prompt"] for r in recs] == ["a?", "c?"] and skipped == 2  # null, then empty
  ints = _parquet(tmp_path / "ints.parquet", {"prompt": [7], "answer": ["7"]})
  with pytest.raises(ConfigError, match=r"ints\.parquet row 0: field 'prompt' is a int, not a "
                     "string"):
    read_records(ints, "rl")


def test_field_mapping_errors(tmp_path):
  path = _parquet(tmp_path / "t.parquet", {"question": ["q"], "prompt": ["p"], "answer": ["1"]})
  with pytest.raises(ConfigError) as e:
    read_records(path, "rl", fields={"problem": "prompt"})
  assert _one_line(e) == (f"{path}: column 'problem', which data.fields maps to 'prompt', is not "
                          "there: its columns are question, prompt, answer.")
  with pytest.raises(ConfigError, match="column 'prompt' is there already and data.fields maps "
                     "'question' to it too"):
    read_records(path, "rl", fields=GSM)
  with pytest.raises(ConfigError, match=r"data.fields maps two columns to 'prompt'"):
    read_records(path, "rl", fields={"question": "prompt", "answer": "prompt"})
  with pytest.raises(ConfigError, match=r"data.fields='question' is not a mapping"):
    read_records(path, "rl", fields="question")
  # a ConfigDict (what a config file holds) is a mapping too
  recs, _ = read_records(path, "rl", fields=ml_collections.ConfigDict(
      {"question": "prompt", "prompt": "original"}))
  assert recs[0] == {"prompt": "q", "original": "p", "answer": "1"}


def test_jsonl_takes_the_same_mapping(tmp_path):
  path = tmp_path / "gsm.jsonl"
  path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n"
                  + json.dumps({"q": "2+2?", "answer": "#### 4"}) + "\n")
  with pytest.raises(ConfigError) as e:
    read_records(str(path), "rl", fields=GSM)
  assert _one_line(e) == (f"{path} line 2: field 'question' is missing (data.fields maps it to "
                          "'prompt'): give every row one, or change data.fields (or set "
                          "on_bad_row=skip).")
  recs, skipped = read_jsonl(str(path), "rl", fields=GSM, on_bad_row="skip")
  assert recs == [{"prompt": "1+1?", "answer": "#### 2"}] and skipped == 1


def test_unreadable_empty_missing_and_unknown_files(tmp_path):
  good = _parquet(tmp_path / "good.parquet", {"prompt": ["p"] * 50, "answer": ["1"] * 50})
  cut = tmp_path / "cut.parquet"
  cut.write_bytes(open(good, "rb").read()[:-40])
  with pytest.raises(ConfigError) as e:
    read_records(str(cut), "rl")
  assert _one_line(e).startswith(f"{cut} is not a readable Parquet file (pyarrow: ")
  junk = tmp_path / "junk.arrow"
  junk.write_bytes(b"not arrow at all")
  with pytest.raises(ConfigError, match=r"junk\.arrow is not a readable Arrow file \(pyarrow: "):
    read_records(str(junk), "rl")
  empty = _parquet(tmp_path / "empty.parquet", {"prompt": pa.array([], pa.string())})
  with pytest.raises(ConfigError) as e:
    read_records(empty, "rl")
  assert _one_line(e) == (f"data file {empty} has no rows: give one with at least one record.")
  with pytest.raises(ConfigError) as e:
    read_records(str(tmp_path / "nope.parquet"), "rl")
  # Any format will do in its place, so the sentence names them all (not the missing one's).
  assert _one_line(e) == (f"data file {str(tmp_path / 'nope.parquet')!r} does not exist: give "
                          "the path of a .jsonl, .parquet or .arrow file, a save_to_disk "
                          "directory or array_record files.")
  csv = tmp_path / "data.csv"
  csv.write_text("prompt,answer\n")
  with pytest.raises(ConfigError) as e:
    read_records(str(csv), "rl")
  assert _one_line(e) == (f"data file {str(csv)!r} has the extension '.csv', which jaxrl does "
                          "not read: give a .jsonl, .parquet or .arrow file, a directory saved "
                          "with datasets' save_to_disk, or array_record files.")
  with pytest.raises(ConfigError, match="is a directory without datasets' save_to_disk files"):
    read_records(str(tmp_path), "rl")


# ----------------------------------------------------------------------------- Arrow


def test_save_to_disk_directory_with_chat_rows_and_mapping(tmp_path):
  convs = [[{"role": "user", "content": f"{i}+1="}, {"role": "assistant", "content": str(i + 1)}]
           for i in range(5)]
  table = pa.table({"conversation": convs, "id": list(range(5))})
  d = _save_to_disk(tmp_path / "chat" / "train", table, shards=2)
  assert files.file_format(d) == "saved"
  recs, _ = read_records(d, "sft", fields={"conversation": "messages"})
  assert [(r["prompt"], r["completion"]) for r in recs] == [(f"{i}+1=", str(i + 1))
                                                            for i in range(5)]
  assert recs[4].source == f"{d} row 4"  # numbered across data-00000 and data-00001


def test_save_to_disk_bad_rows_and_dataset_dict(tmp_path):
  table = pa.table({"question": ["a", "b", "c", "d"], "answer": ["1", "2", "3", None]})
  d = _save_to_disk(tmp_path / "gsm" / "test", table, shards=2)
  with pytest.raises(ConfigError) as e:
    read_records(d, "rl", fields=GSM)
  assert _one_line(e) == (f"{d} row 3: field 'answer' is missing: every row needs a non-empty "
                          "'answer' string (or set on_bad_row=skip).")
  recs, skipped = read_records(d, "rl", fields=GSM, on_bad_row="skip")
  assert len(recs) == 3 and skipped == 1
  top = tmp_path / "gsm"
  (top / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
  with pytest.raises(ConfigError) as e:
    read_records(str(top), "rl")
  assert _one_line(e) == (f"{top} holds a DatasetDict (splits test): give one split's "
                          f"directory, e.g. {top / 'test'}.")
  os.remove(os.path.join(d, "data-00001-of-00002.arrow"))
  with pytest.raises(ConfigError, match=r"data-00001-of-00002\.arrow' does not exist: give the "
                     "path of the Arrow file state.json lists"):
    read_records(d, "rl", fields=GSM)


def test_single_arrow_files_in_both_ipc_formats(tmp_path):
  table = pa.table({"prompt": ["x", "y"], "chosen": ["good", "fine"], "rejected": ["bad", "no"]})
  stream, filefmt = tmp_path / "s.arrow", tmp_path / "f.arrow"
  with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
    w.write_table(table)
  with pa.OSFile(str(filefmt), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
    w.write_table(table)
  for path in (stream, filefmt):
    pairs, _ = read_prefs(str(path))  # the reward-model / DPO reader goes through it too
    assert [p["chosen"] for p in pairs] == ["good", "fine"]


# ----------------------------------------------------------------------------- trainers


def test_the_trainers_reader_takes_data_fields(tmp_path):
  """jaxrl.train.data.records (SFT, DPO and GRPO read their files through it)."""
  train = _parquet(tmp_path / "train.parquet", {"question": ["1+1?"], "answer": ["#### 2"]})
  held = _save_to_disk(tmp_path / "test", pa.table({"question": ["2+2?"], "answer": ["#### 4"]}),
                       shards=1)
  config = ml_collections.ConfigDict(dict(seed=0, data=dict(
      train_file=train, eval_file=held, on_bad_row="error", fields=GSM)))
  tr, ho, skipped = trainer_records(config, None, "rl", build=None, what="rows")
  assert tr == [{"prompt": "1+1?", "answer": "#### 2"}] and skipped == 0
  assert ho == [{"prompt": "2+2?", "answer": "#### 4"}]


def test_data_fields_from_the_command_line(repo_root, capsys, tmp_path, monkeypatch):
  """--config.data.fields takes a dict literal; a bad column is one line on stderr, exit 2."""
  monkeypatch.chdir(repo_root)
  path = _parquet(tmp_path / "sft.parquet", {"question": ["1+1="], "completion": ["2"]})
  with pytest.raises(SystemExit) as e:
    cli.main(["sft", "--config", "configs/sft_tiny.py:runlocal", "--config.data.task=",
              f"--config.data.train_file={path}", "--config.data.fields={'q': 'prompt'}",
              "--workdir", str(tmp_path / "run")])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip().endswith(
      f"{path}: column 'q', which data.fields maps to 'prompt', is not there: its columns are "
      "question, completion.")


# ----------------------------------------------------------------------------- the fixture


def test_gsm8k_fixture_is_deterministic_disjoint_and_verifiable(tmp_path):
  a = files.write_gsm8k_fixture(str(tmp_path / "a"), n_train=64, n_test=16, seed=3)
  b = files.write_gsm8k_fixture(str(tmp_path / "b"), n_train=64, n_test=16, seed=3)
  assert sorted(a) == ["test", "train"]
  rows = {s: files.read_records(a[s]) for s in a}
  assert rows == {s: files.read_records(b[s]) for s in b}
  assert files.read_records(files.write_gsm8k_fixture(str(tmp_path / "c"), n_train=64,
                                                      n_test=16, seed=4)["train"]) != rows["train"]
  assert len(rows["train"]) == 64 and len(rows["test"]) == 16
  assert not {r["question"] for r in rows["train"]} & {r["question"] for r in rows["test"]}
  assert rows["train"][0]["question"].startswith("What is ")
  # GSM8K's shape: a rationale, then "#### N", which the gsm8k reward reads
  recs, _ = read_records(a["train"], "rl", fields=GSM)
  answers = [r["answer"] for r in recs]
  assert all("\n#### " in x for x in answers)
  assert REWARDS["gsm8k_strict"](answers, batch={"answer": answers}) == [1.0] * 64
  wrong = [x.rsplit("#### ", 1)[0] + "#### 1000" for x in answers]
  assert REWARDS["gsm8k"](wrong, batch={"answer": answers}) == [0.0] * 64
