"""Record readers, bad-row errors, and the grain SFT pipeline, checked on hand-made arrays."""

import collections
import json
import logging

import numpy as np
import pytest

from jaxrl import cli
from jaxrl.data import (ByteTokenizer, read_array_record, read_jsonl, read_records, sft_batches,
                        write_jsonl)
from jaxrl.errors import ConfigError
from jaxrl.tasks import get_task

TOK = ByteTokenizer()


def _write(tmp_path, lines, name="d.jsonl"):
  path = tmp_path / name
  path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                          for line in lines), encoding="utf-8")
  return str(path)


def _drain(it):
  return list(it)


def _texts(batch, key="inputs"):
  """Each row's text between bos and the first pad (one example per row, no packing)."""
  return [TOK.decode(row) for row in batch[key]]


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", ["rl", "sft"])
def test_export_round_trips_through_read_jsonl(tmp_path, capsys, fmt):
  out = str(tmp_path / f"{fmt}.jsonl")
  args = ["data", "export", "--task", "addition", "--split", "test", "--n", "25", "--out", out,
          "--format", fmt, "--seed", "3"]
  if fmt == "sft":
    args += ["--error-rate", "0.2"]
  cli.main(args)
  assert f"wrote 25 {fmt} records of task 'addition' (test split, seed 3)" in capsys.readouterr(
      ).out
  records, skipped = read_jsonl(out, fmt)
  task = get_task("addition")
  want = (task.sft_records("test", 25, 3, error_rate=0.2) if fmt == "sft" else
          task.records("test", 25, 3))
  assert skipped == 0 and records == want
  assert records[4].source == f"{out} line 5"


def test_export_writes_the_systematic_slips(tmp_path):
  out = str(tmp_path / "slips.jsonl")
  cli.main(["data", "export", "--task", "addition", "--n", "200", "--out", out, "--format",
            "sft", "--error-rate", "0.6", "--error-mode", "systematic", "--seed", "4"])
  records, _ = read_jsonl(out, "sft")
  task = get_task("addition")
  assert records == task.sft_records("train", 200, 4, error_rate=0.6, error_mode="systematic")
  slips = [r for r, a in zip(records, task.records("train", 200, 4))
           if r["completion"] != a["answer"]]
  assert slips and all(task.slip(r["prompt"], "") == r["completion"] for r in slips)


def test_export_rejects_error_rate_without_sft(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["data", "export", "--task", "sort", "--n", "2", "--out", str(tmp_path / "x"),
              "--error-rate", "0.1"])
  assert e.value.code == 2 and "--format sft" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    cli.main(["data", "export", "--task", "sort", "--n", "2", "--out", str(tmp_path / "x"),
              "--error-mode", "systematic"])
  assert e.value.code == 2 and "--error-mode applies to --format sft only" in (
      capsys.readouterr().err)


def test_prefs_and_rl_extras_round_trip(tmp_path):
  prefs = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
           {"prompt": "héllo ✓", "chosen": "a\nb", "rejected": "c"}]
  path = str(tmp_path / "p.jsonl")
  write_jsonl(path, prefs)
  assert read_jsonl(path, "prefs") == (prefs, 0)
  rl = [{"prompt": "1+1=", "answer": "2", "difficulty": 3, "tags": ["easy"]}]
  write_jsonl(path, rl)
  assert read_jsonl(path, "rl") == (rl, 0)  # extra fields reach the reward functions


def test_chat_records_are_normalised(tmp_path):
  path = _write(tmp_path, [
      {"messages": [{"role": "user", "content": "12+34="},
                    {"role": "assistant", "content": "46"}]},
      {"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="},
                    {"role": "assistant", "content": "3"}]},
      {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                    {"role": "user", "content": "2+2="},
                    {"role": "assistant", "content": "4"}]},
      {"prompt": "5+5=", "completion": "10"},
  ])
  records, _ = read_jsonl(path, "sft")
  # The text form is for tokenizers without a chat template; the messages stay for those with.
  assert [{k: r[k] for k in ("prompt", "completion")} for r in records] == [
      {"prompt": "12+34=", "completion": "46"},
      {"prompt": "Add.\n\n1+2=", "completion": "3"},
      {"prompt": "user: hi\nassistant: yo\nuser: 2+2=\nassistant: ", "completion": "4"},
      {"prompt": "5+5=", "completion": "10"},
  ]
  assert [len(r.get("messages", [])) for r in records] == [2, 3, 4, 0]


def test_blank_lines_are_not_rows(tmp_path):
  path = _write(tmp_path, [{"prompt": "a", "answer": "b"}, "", "   ",
                           {"prompt": "c", "answer": "d"}])
  records, skipped = read_jsonl(path, "rl")
  assert skipped == 0 and [r.source for r in records] == [f"{path} line 1", f"{path} line 4"]


# ----------------------------------------------------------------------------- bad rows

GOOD = {"prompt": "1+1=", "completion": "2"}
BAD_ROWS = [
    ("{not json", "sft", r"line 2: the row is not valid JSON"),
    ("[1, 2]", "sft", r"line 2: the row is a JSON list, not an object"),
    ({"prompt": "1+1="}, "sft", r"line 2: field 'completion' is missing"),
    ({"prompt": 7, "completion": "2"}, "sft", r"line 2: field 'prompt' is a int, not a string"),
    ({"prompt": "1+1=", "completion": "  "}, "sft", r"line 2: field 'completion' is empty"),
    ({"prompt": "1+1=", "answer": None}, "rl", r"line 2: field 'answer' is a NoneType"),
    ({"prompt": "q", "chosen": "a"}, "prefs", r"line 2: field 'rejected' is missing"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "prefs", r"line 2: field 'prompt' is empty"),
    ({"messages": "hi"}, "sft", r"line 2: field 'messages' is a str, not a list"),
    ({"messages": [{"role": "user", "content": "x"}]}, "sft",
     r"line 2: field 'messages' has 1 turn"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}, "sft",
     r"line 2: field 'messages\[1\].role' is 'bot'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}, "sft",
     r"line 2 messages\[1\]: field 'content' is missing"),
    ({"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]},
     "sft", r"line 2: field 'messages\[1\].role' is 'user': the final turn must be"),
]


@pytest.mark.parametrize("row,kind,message", BAD_ROWS)
def test_each_bad_row_names_file_line_and_field(tmp_path, row, kind, message):
  good = GOOD if kind == "sft" else (
      {"prompt": "1+1=", "answer": "2"} if kind == "rl" else
      {"prompt": "q", "chosen": "a", "rejected": "b"})
  path = _write(tmp_path, [good, row, good])
  with pytest.raises(ConfigError, match=r"d\.jsonl " + message) as e:
    read_jsonl(path, kind)
  assert str(e.value).startswith(path) and "on_bad_row=skip" in str(e.value)
  records, skipped = read_jsonl(path, kind, on_bad_row="skip")
  assert skipped == 1 and records == [good, good]


def test_skip_reports_the_count_in_the_log(tmp_path, caplog):
  path = _write(tmp_path, [GOOD, {"prompt": "x"}, "oops", GOOD, {"completion": "y"}])
  with caplog.at_level(logging.WARNING):
    records, skipped = read_jsonl(path, "sft", on_bad_row="skip")
  assert (len(records), skipped) == (2, 3)
  assert "skipped 3 bad row(s) of 5" in caplog.text and "line 2" in caplog.text


def test_bad_arguments_are_config_errors(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"):
    read_jsonl(str(tmp_path / "missing.jsonl"), "sft")
  path = _write(tmp_path, [GOOD])
  with pytest.raises(ConfigError, match="kind='chat'.*sft, rl, prefs"):
    read_jsonl(path, "chat")
  with pytest.raises(ConfigError, match="on_bad_row='drop'.*error, skip"):
    read_jsonl(path, "sft", on_bad_row="drop")


def test_over_long_rows_error_or_are_skipped(tmp_path):
  # "ab"->"c" needs 1+2+1+1-1 = 4 positions; the long completion needs 1+2+20+1-1 = 23.
  path = _write(tmp_path, [{"prompt": "ab", "completion": "c"},
                           {"prompt": "ab", "completion": "x" * 20},
                           {"prompt": "y" * 30, "completion": "c"}])
  records, _ = read_jsonl(path, "sft")
  with pytest.raises(ConfigError, match=rf"{path} line 2: field 'completion' makes the row 23 "
                     r"tokens long, over seq_len=8"):
    sft_batches(records, TOK, seq_len=8, batch_size=1, seed=0)
  it = sft_batches(records, TOK, seq_len=8, batch_size=1, seed=0, num_epochs=1,
                   on_bad_row="skip")
  assert it.skipped == 2 and len(_drain(it)) == 1
  with pytest.raises(ConfigError, match=r"record 0: field 'prompt' makes the row 32 tokens"):
    sft_batches([{"prompt": "y" * 30, "completion": "c"}], TOK, seq_len=8, batch_size=1,
                seed=0)


def test_records_built_in_code_are_validated_too():
  with pytest.raises(ConfigError, match=r"record 1: field 'completion' is a int"):
    sft_batches([GOOD, {"prompt": "a", "completion": 3}], TOK, seq_len=8, batch_size=1,
                seed=0)


# ----------------------------------------------------------------------------- batches


def test_padded_batch_matches_hand_computed_arrays():
  # Bytes are shifted by 3: a=100, b=101, c=102, x=123, y=124, z=125; bos=1, eos=2, pad=0.
  records = [{"prompt": "ab", "completion": "c"}, {"prompt": "x", "completion": "yz"}]
  batch = next(sft_batches(records, TOK, seq_len=6, batch_size=2, seed=0, shuffle=False))
  want = {
      "inputs": [[1, 100, 101, 102, 0, 0], [1, 123, 124, 125, 0, 0]],
      "targets": [[100, 101, 102, 2, 0, 0], [123, 124, 125, 2, 0, 0]],
      "loss_mask": [[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0]],
      "positions": [[0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 0, 0]],
      "segment_ids": [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]],
  }
  assert sorted(batch) == sorted(want)
  for k, v in want.items():
    np.testing.assert_array_equal(batch[k], np.asarray(v), err_msg=k)
  assert batch["loss_mask"].dtype == np.float32
  assert all(batch[k].dtype == np.int32 for k in want if k != "loss_mask")


def test_a_row_that_exactly_fits_is_kept():
  # 1 + 2 + 1 + 1 = 5 tokens -> 4 positions, exactly seq_len.
  batch = next(sft_batches([{"prompt": "ab", "completion": "c"}], TOK, seq_len=4,
                           batch_size=1, seed=0))
  np.testing.assert_array_equal(batch["targets"], [[100, 101, 102, 2]])


def test_packing_puts_several_examples_in_one_row():
  records = [{"prompt": "ab", "completion": "c"}, {"prompt": "x", "completion": "yz"},
             {"prompt": "a", "completion": "b"}]
  # 4 + 4 + 3 positions: the first two fill a row of 8, the third starts the next row.
  batches = _drain(sft_batches(records, TOK, seq_len=8, batch_size=1, seed=0, shuffle=False,
                               num_epochs=1, packing=True))
  assert len(batches) == 2
  first, second = batches
  want = {
      "inputs": [[1, 100, 101, 102, 1, 123, 124, 125]],
      "targets": [[100, 101, 102, 2, 123, 124, 125, 2]],
      "loss_mask": [[0, 0, 1, 1, 0, 1, 1, 1]],
      "positions": [[0, 1, 2, 3, 0, 1, 2, 3]],
      "segment_ids": [[1, 1, 1, 1, 2, 2, 2, 2]],
  }
  for k, v in want.items():
    np.testing.assert_array_equal(first[k], np.asarray(v), err_msg=k)
  np.testing.assert_array_equal(second["inputs"], [[1, 100, 101, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(second["segment_ids"], [[1, 1, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(second["positions"], [[0, 1, 2, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(second["loss_mask"], [[0, 1, 1, 0, 0, 0, 0, 0]])
  assert first["segment_ids"].dtype == np.int32 and first["loss_mask"].dtype == np.float32


def test_packing_keeps_every_token_once():
  records = get_task("addition").sft_records("train", 40, 0)
  batches = _drain(sft_batches(records, TOK, seq_len=32, batch_size=2, seed=1, num_epochs=1,
                               packing=True))
  rows = [(b["inputs"][i], b["segment_ids"][i], b["loss_mask"][i], b["targets"][i])
          for b in batches for i in range(2)]
  assert max(int(s.max()) for _, s, _, _ in rows) >= 3  # several short examples per row
  seen = []
  for inputs, seg, mask, targets in rows:
    for s in range(1, int(seg.max()) + 1):
      prompt_and_completion = TOK.decode(np.append(inputs[seg == s], targets[seg == s][-1]))
      completion = TOK.decode(targets[(seg == s) & (mask == 1)])
      seen.append((prompt_and_completion, completion))
  want = [(r["prompt"] + r["completion"], r["completion"]) for r in records]
  # drop_remainder may leave out at most one partial batch of rows.
  assert set(seen) <= set(want) and len(seen) >= len(want) - 2 * 4


def _prompts(it, n=None):
  out = []
  for i, b in enumerate(it):
    if n is not None and i >= n:
      break
    out += _texts(b)
  return out


def test_shuffle_is_deterministic_per_seed_and_differs_across_seeds():
  records = get_task("sort").sft_records("train", 64, 0)
  kw = dict(seq_len=24, batch_size=4, num_epochs=1)
  a = _prompts(sft_batches(records, TOK, seed=1, **kw))
  assert a == _prompts(sft_batches(records, TOK, seed=1, **kw))
  b = _prompts(sft_batches(records, TOK, seed=2, **kw))
  unshuffled = _prompts(sft_batches(records, TOK, seed=1, shuffle=False, **kw))
  assert a != b and a != unshuffled
  assert sorted(a) == sorted(b) == sorted(unshuffled)
  assert unshuffled == [r["prompt"] + r["completion"] for r in records]


def test_epochs_cover_the_data_and_reshuffle():
  records = get_task("reverse").sft_records("train", 12, 0)
  texts = _prompts(sft_batches(records, TOK, seq_len=24, batch_size=3, seed=0, num_epochs=3))
  assert len(texts) == 36
  counts = collections.Counter(texts)
  assert counts == collections.Counter(r["prompt"] + r["completion"] for r in records * 3)
  assert texts[:12] != texts[12:24]  # each epoch has its own order
  forever = sft_batches(records, TOK, seq_len=24, batch_size=5, seed=0)
  assert len(_prompts(forever, n=20)) == 100  # num_epochs=None never runs out


def test_shards_are_disjoint_and_cover_the_data():
  records = [{"prompt": f"p{i}:", "completion": str(i)} for i in range(30)]
  shards = [_prompts(sft_batches(records, TOK, seq_len=12, batch_size=1, seed=0, num_epochs=1,
                                 shard_index=k, shard_count=3)) for k in range(3)]
  assert [len(s) for s in shards] == [10, 10, 10]
  union = [t for s in shards for t in s]
  assert sorted(union) == sorted(f"p{i}:{i}" for i in range(30))
  assert set(shards[1]) == {f"p{i}:{i}" for i in range(1, 30, 3)}


def test_each_shard_reads_only_its_own_rows():
  class Spy(list):
    read = set()

    def __getitem__(self, i):
      Spy.read.add(i)
      return super().__getitem__(i)

  records = Spy({"prompt": f"p{i}:", "completion": str(i)} for i in range(10))
  sft_batches(records, TOK, seq_len=12, batch_size=1, seed=0, shard_index=1, shard_count=4)
  assert Spy.read == {1, 5, 9}


def test_bad_pipeline_arguments_are_config_errors():
  for kw, msg in [({"batch_size": 0}, "batch_size=0"), ({"shard_index": 2, "shard_count": 2},
                  "shard_index=2"), ({"num_epochs": 0}, "num_epochs=0"),
                  ({"on_bad_row": "ignore"}, "on_bad_row='ignore'")]:
    with pytest.raises(ConfigError, match=msg):
      sft_batches([GOOD], TOK, **{"seq_len": 8, "batch_size": 1, "seed": 0, **kw})
  with pytest.raises(ConfigError, match="has no usable SFT rows"):
    sft_batches([{"prompt": "x" * 10, "completion": "y"}], TOK, seq_len=4, batch_size=1,
                seed=0, on_bad_row="skip")


@pytest.mark.parametrize("packing", [False, True])
def test_iterator_state_restores_exactly(packing):
  records = get_task("addition").sft_records("train", 50, 0)
  kw = dict(seq_len=32, batch_size=4, seed=7, packing=packing)  # forever: crosses epochs
  it = sft_batches(records, TOK, **kw)
  for _ in range(9):
    next(it)
  # The state must survive a JSON round trip: that is how checkpoints store it.
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(25)]
  resumed = sft_batches(records, TOK, **kw)
  resumed.set_state(state)
  got = [next(resumed) for _ in range(25)]
  for e, g in zip(expected, got):
    for k in e:
      np.testing.assert_array_equal(e[k], g[k])
  # And a fresh iterator is not already there: the restore is what made them equal.
  fresh = [next(sft_batches(records, TOK, **kw)) for _ in range(1)]
  assert not np.array_equal(fresh[0]["inputs"], expected[0]["inputs"])


def test_iterator_checkpoints_with_orbax(tmp_path):
  import grain
  import orbax.checkpoint as ocp
  records = get_task("sort").sft_records("train", 30, 0)
  kw = dict(seq_len=24, batch_size=4, seed=3)
  it = sft_batches(records, TOK, **kw)
  for _ in range(5):
    next(it)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
  expected = next(it)
  resumed = sft_batches(records, TOK, **kw)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(resumed)))
  got = next(resumed)
  for k in expected:
    np.testing.assert_array_equal(expected[k], got[k])


# ----------------------------------------------------------------------------- array_record


def _example_class():
  """tf.train.Example built with the protobuf library from its .proto definition (no TF)."""
  from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
  f = descriptor_pb2.FileDescriptorProto(name="jaxrl_test_example.proto", package="jt",
                                         syntax="proto3")
  T = descriptor_pb2.FieldDescriptorProto
  for name, typ in [("BytesList", T.TYPE_BYTES), ("FloatList", T.TYPE_FLOAT),
                    ("Int64List", T.TYPE_INT64)]:
    m = f.message_type.add(name=name)
    m.field.add(name="value", number=1, type=typ, label=T.LABEL_REPEATED)
  feat = f.message_type.add(name="Feature")
  feat.oneof_decl.add(name="kind")
  for i, name in enumerate(["bytes_list", "float_list", "int64_list"]):
    feat.field.add(name=name, number=i + 1, type=T.TYPE_MESSAGE, label=T.LABEL_OPTIONAL,
                   type_name=".jt." + ["BytesList", "FloatList", "Int64List"][i], oneof_index=0)
  feats = f.message_type.add(name="Features")
  entry = feats.nested_type.add(name="FeatureEntry")
  entry.options.map_entry = True
  entry.field.add(name="key", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
  entry.field.add(name="value", number=2, type=T.TYPE_MESSAGE, label=T.LABEL_OPTIONAL,
                  type_name=".jt.Feature")
  feats.field.add(name="feature", number=1, type=T.TYPE_MESSAGE, label=T.LABEL_REPEATED,
                  type_name=".jt.Features.FeatureEntry")
  ex = f.message_type.add(name="Example")
  ex.field.add(name="features", number=1, type=T.TYPE_MESSAGE, label=T.LABEL_OPTIONAL,
               type_name=".jt.Features")
  pool = descriptor_pool.DescriptorPool()
  pool.Add(f)
  return message_factory.GetMessageClass(pool.FindMessageTypeByName("jt.Example"))


def _tf_example(Example, **features) -> bytes:
  ex = Example()
  for k, v in features.items():
    feature = ex.features.feature[k]
    if isinstance(v, str):
      feature.bytes_list.value.append(v.encode())
    elif isinstance(v, float):
      feature.float_list.value.append(v)
    else:
      feature.int64_list.value.extend(v if isinstance(v, list) else [v])
  return ex.SerializeToString()


def _write_array_record(path, payloads):
  from array_record.python.array_record_module import ArrayRecordWriter
  w = ArrayRecordWriter(str(path), "group_size:1")
  for p in payloads:
    w.write(p)
  w.close()


def test_array_record_json_and_tf_example_records(tmp_path):
  Example = _example_class()
  d = tmp_path / "gsm_tiny" / "1.0.0"
  d.mkdir(parents=True)
  _write_array_record(d / "gsm_tiny-train.array_record-00000-of-00002", [
      json.dumps({"question": "1+2=", "answer": "3"}).encode(),
      _tf_example(Example, question="héllo?", answer="4", level=-2, ids=[5, 300], w=0.5),
  ])
  _write_array_record(d / "gsm_tiny-train.array_record-00001-of-00002", [
      _tf_example(Example, question="9+9=", answer="18"),
      _tf_example(Example, question="no answer"),
  ])
  fields = {"question": "prompt"}
  with pytest.raises(ConfigError, match=r"00001-of-00002 record 1: field 'answer' is missing"):
    read_array_record(str(d), "rl", fields=fields)
  records, skipped = read_records(str(d / "*train*"), "rl", on_bad_row="skip", fields=fields)
  assert skipped == 1
  assert records == [
      {"prompt": "1+2=", "answer": "3"},
      {"prompt": "héllo?", "answer": "4", "level": -2, "ids": [5, 300], "w": 0.5},
      {"prompt": "9+9=", "answer": "18"},
  ]
  assert records[2].source.endswith("00001-of-00002 record 0")


def test_array_record_feeds_sft_batches(tmp_path):
  path = tmp_path / "sft.array_record"
  records = get_task("addition").sft_records("train", 8, 0)
  _write_array_record(path, [json.dumps(r).encode() for r in records])
  read, _ = read_array_record(str(path), "sft")
  assert read == records
  batch = next(sft_batches(read, TOK, seq_len=16, batch_size=8, seed=0, shuffle=False))
  assert _texts(batch) == [r["prompt"] + r["completion"] for r in records]


def test_array_record_bad_record_and_missing_path(tmp_path):
  path = tmp_path / "bad.array_record"
  _write_array_record(path, [b"\xff\xff\xff"])
  with pytest.raises(ConfigError, match=r"bad\.array_record record 0: the record is neither"):
    read_array_record(str(path), "sft")
  with pytest.raises(ConfigError, match="no array_record files"):
    read_array_record(str(tmp_path / "nothing*"), "sft")
