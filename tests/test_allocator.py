"""The console script re-executes itself once on tcmalloc (jaxrl/backends/cpu/allocator.py)."""

import os
import shutil
import subprocess
import sys

import pytest

from jaxrl.backends.cpu import allocator
from jaxrl.errors import ConfigError

PROBE = ("from jaxrl.backends.cpu import allocator; allocator.ensure(); import os; "
         "print(allocator.loaded() or 'none', os.environ.get('_JAXRL_TCMALLOC_TRIED'), "
         "os.environ.get('LD_PRELOAD', ''), sep='|')")


def _probe(**env):
  base = {k: v for k, v in os.environ.items()
          if k not in ("LD_PRELOAD", "_JAXRL_TCMALLOC_TRIED", allocator.ENV)}
  res = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True,
                       text=True, timeout=120)
  assert res.returncode == 0, res.stderr
  return res.stdout.strip().splitlines()[-1].split("|")


def test_find_honours_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv(allocator.ENV, "0")
  assert allocator.find() is None
  assert "JAXRL_TCMALLOC=0" in allocator.describe() or allocator.loaded()
  lib = tmp_path / "libtcmalloc_custom.so"
  lib.write_bytes(b"")
  monkeypatch.setenv(allocator.ENV, str(lib))
  assert allocator.find() == str(lib)
  monkeypatch.setenv(allocator.ENV, str(tmp_path / "missing.so"))
  with pytest.raises(ConfigError, match="JAXRL_TCMALLOC=.*missing.so.*is not a file"):
    allocator.find()


def test_turned_off_means_no_reexec():
  loaded, tried, preload = _probe(JAXRL_TCMALLOC="0")
  assert (loaded, tried, preload) == ("none", "None", "")


def _stand_in(tmp_path):
  """A preloadable library whose mapped name says libtcmalloc: a copy of the libm this
  interpreter already maps (preloading it changes nothing), so the re-exec path is tested on
  every machine, with or without TCMalloc installed."""
  with open("/proc/self/maps") as f:
    libm = next(line.split()[-1] for line in f if "/libm.so" in line or "/libm-" in line)
  lib = tmp_path / "libtcmalloc_standin.so"
  shutil.copyfile(libm, lib)
  return str(lib)


def test_console_script_reexecs_once_with_the_library(tmp_path):
  lib = _stand_in(tmp_path)
  loaded, tried, preload = _probe(JAXRL_TCMALLOC=lib)
  assert loaded == lib and tried == "1" and preload.split(":")[0] == lib
  # the CLI says so (and a re-exec'd process does not re-exec again: one banner, exit 0)
  res = subprocess.run([sys.executable, "-m", "jaxrl", "info"], capture_output=True,
                       text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items()
                               if k not in ("LD_PRELOAD", "_JAXRL_TCMALLOC_TRIED")},
                            allocator.ENV: lib})
  assert res.returncode == 0, res.stderr
  lines = [x for x in res.stdout.splitlines() if x.startswith("allocator")]
  assert lines == [f"allocator          tcmalloc ({lib})"], res.stdout


def test_the_console_script_reexecs_before_it_loads_jax():
  """Everything the jaxrl command imports before its re-exec (jaxrl.__main__: the package, the
  backends' switch, the allocator) leaves jax unloaded: the command's imports run once, after
  the re-exec, not twice (about 3 s a command: docs/guides/cpu-notes.md)."""
  res = subprocess.run([sys.executable, "-c", "import sys, jaxrl.__main__; "
                        "print(sorted(m for m in ('jax', 'jaxlib', 'numpy', 'flax') "
                        "if m in sys.modules))"], capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr
  assert res.stdout.strip() == "[]", res.stdout


def test_bad_library_path_is_one_clear_line(tmp_path):
  res = subprocess.run([sys.executable, "-m", "jaxrl", "info"], capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, allocator.ENV: str(tmp_path / "nope.so")})
  assert res.returncode == 2
  assert "Traceback" not in res.stderr
  assert "JAXRL_TCMALLOC=" in res.stderr and "nope.so" in res.stderr and "0" in res.stderr


def test_module_runs_a_command_on_tcmalloc():
  """`python -m jaxrl.backends.cpu.allocator CMD` (what `make test` runs pytest with)."""
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
  cmd = [sys.executable, "-m", "jaxrl.backends.cpu.allocator", sys.executable, "-c",
         "import os; print(os.environ.get('LD_PRELOAD', ''))"]
  res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
  assert res.returncode == 0, res.stderr
  lib = allocator.find()
  assert res.stdout.strip() == (lib or "")
  off = subprocess.run(cmd, env={**env, allocator.ENV: "0"}, capture_output=True, text=True,
                       timeout=120)
  assert off.returncode == 0 and off.stdout.strip() == ""
