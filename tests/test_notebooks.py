"""notebooks/*.ipynb: each one is executed headless (nbclient) and must run without an error.

Every notebook in notebooks/ is picked up, so a new notebook is tested by being added."""

import glob
import os

import nbformat
import pytest

from conftest import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_notebooks_are_there_clean_and_install_first():
  names = [os.path.basename(p) for p in NOTEBOOKS]
  assert {"quickstart.ipynb", "own_checkpoint.ipynb", "reward_hacking.ipynb"} <= set(names)
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    # Committed without outputs (small diffs); the first code cell installs jaxrl on Colab.
    assert all(not c.outputs and c.execution_count is None for c in code), path
    assert 'find_spec("jaxrl") is None' in code[0].source, path


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_executes_without_error(path, tmp_path):
  from nbclient import NotebookClient
  nb = nbformat.read(path, as_version=4)
  # The kernel gets this process's environment (its faster-compiling XLA flags, compilation
  # cache and PYTHONPATH, so jaxrl imports and the install cell does nothing) on one CPU
  # device, as a Colab CPU runtime has: the three ran in 147 s against 227 s on conftest's 8
  # fake devices (2026-12-01, AMD EPYC, cold cache); sharding is the short tests' job.
  client = NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute(env=subprocess_env(1))  # raises CellExecutionError, naming the cell, on error
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert any("jaxrl from" in o.get("text", "") for o in outputs)
  assert any(": 1 cpu device(s)" in o.get("text", "") for o in outputs)  # the env took effect
