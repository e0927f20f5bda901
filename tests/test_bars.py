"""The learning tests' bars (conftest.Bars) and the sweep that tabulates them over CPU kinds and
seeds (tools/learning_sweep.py)."""

import os
import sys

import pytest

from conftest import ROOT, Bars

sys.path.insert(0, os.path.join(ROOT, "tools"))
import learning_sweep  # noqa: E402


def test_bars_record_every_figure_and_check_fails_on_any_miss():
  recorded = []
  bars = Bars(lambda name, value: recorded.append((name, value)))
  bars.above("gain", 0.31, 0.25)
  bars.below("KL max", 0.12, 0.1)
  bars.above("tool calls", 0.9, 0.5)
  assert recorded == [("gain", "0.3100 > 0.25"), ("KL max", "0.1200 < 0.1"),
                      ("tool calls", "0.9000 > 0.5")]
  with pytest.raises(AssertionError, match=r"missed: KL max 0.1200 \(bar < 0.1\)") as e:
    bars.check()
  assert "gain" not in str(e.value) and "tool calls" not in str(e.value)
  ok = Bars(lambda *a: None)
  ok.above("gain", 0.26, 0.25)
  ok.check()


def test_the_sweep_tabulates_each_figure_over_cells_with_the_worst(tmp_path):
  cells = {}
  for seed, (gain, outcome) in enumerate([(0.31, ""), (0.22, "<failure message='x'/>")]):
    xml = tmp_path / f"native-eigen-seed{seed}.xml"
    xml.write_text(
        "<testsuites><testsuite><testcase classname='tests.test_agentic' name='test_calc'>"
        f"<properties><property name='gain' value='{gain:.4f} &gt; 0.25'/></properties>"
        f"{outcome}</testcase></testsuite></testsuites>")
    cells[("native", "eigen", seed)] = learning_sweep.read_cell(str(xml))
  assert cells[("native", "eigen", 1)]["test_agentic::test_calc"][0] == "failed"
  text = learning_sweep.table(cells)
  assert ("test_agentic::test_calc: 2 cells; bars: gain > 0.25\n"
          "  cells (ISA dots seed: gain):") in text
  assert "  native eigen 0: +0.310\n" in text
  assert "  native eigen 1: +0.220  (misses: gain)" in text
  assert "  worst gain: +0.220 (native eigen 1); bar > 0.25, margin 0.030" in text
  assert learning_sweep.seeds_of("0-2,5") == [0, 1, 2, 5]
