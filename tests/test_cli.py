"""The `jaxrl` console script: commands, tables, and one-line errors without tracebacks."""

import os
import subprocess
import sys

import pytest

from conftest import JAXRL, ROOT
from jaxrl import cli


def test_help_lists_the_commands(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  out = capsys.readouterr().out
  for command in ("info", "model", "sweep", "plan", "bench", "convert", "demo", "data", "sft",
                  "rm", "grpo", "ppo", "dpo", "sample", "launch", "compare", "plot"):
    assert f"    {command} " in out


def test_model_prints_a_sharded_table(capsys, repo_root, devices):
  cli.main(["model", "--config", os.path.join(repo_root, "configs/tiny.py:tp")])
  out = capsys.readouterr().out
  assert "learner spec" in out
  assert "(tensor, (data,fsdp))" in out  # the embedding is 2-D sharded on 8 devices
  assert "on 8 devices (mesh data=1 x fsdp=2 x tensor=4, layout learner)" in out


def test_info_reports_devices_and_mesh(capsys, devices):
  cli.main(["info", "--config.mesh.tensor=2"])
  out = capsys.readouterr().out
  assert "devices            8 (cpu)" in out
  assert "Mesh(data=1 x fsdp=4 x tensor=2) over 8 cpu devices" in out


LIBTPU_NOISE = ("host bounds", "InitGoogle", "TPU_WORKER")


def test_the_console_script_on_a_cpu_machine_does_not_print_libtpus_errors():
  """Without a TPU, jax loaded libtpu (installed for --compile) to find no chip, and it printed
  "Failed to find host bounds...", "Logging before InitGoogle()" and an E0000 TPU_WORKER line
  before every command's output; `import jaxrl` (so the console script, a notebook or a
  script) now asks for the CPU first. `jaxrl plan` of a slice's config still loads libtpu, for
  abstract TPU chips: it names a slice for libtpu's start-up, which then looks for none
  (backends.quiet_libtpu_off_tpu)."""
  from jaxrl.backends import accelerator_here
  if accelerator_here():
    pytest.skip("this machine has an accelerator: jax should look for it")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  bare = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                        env=env, capture_output=True, text=True)
  if not any(x in bare.stderr for x in LIBTPU_NOISE):
    pytest.skip("jax alone prints no libtpu errors here (libtpu not installed)")
  res = subprocess.run([sys.executable, "-c", "import jaxrl, jax; print(jax.devices())"],
                       env=env, capture_output=True, text=True)
  assert res.returncode == 0 and "CpuDevice" in res.stdout, res.stderr
  assert not [x for x in LIBTPU_NOISE if x in res.stdout + res.stderr], res.stderr
  res = subprocess.run([JAXRL, "info"], env=env, capture_output=True, text=True)
  assert res.returncode == 0 and "backend            cpu" in res.stdout, res.stderr
  assert not [x for x in LIBTPU_NOISE if x in res.stdout + res.stderr], res.stderr
  res = subprocess.run([JAXRL, "plan", "--config", "configs/qwen3.py:0.6b,grpo,v5e"], env=env,
                       cwd=ROOT, capture_output=True, text=True)
  assert res.returncode == 0 and "8 abstract TPU chips" in res.stdout, res.stderr
  assert not [x for x in LIBTPU_NOISE if x in res.stdout + res.stderr], res.stderr


def test_sweep_dry_run_lists_runs(capsys, repo_root, tmp_path):
  cli.main(["sweep", "--config", os.path.join(repo_root, "configs/tiny.py"), "--dry-run",
            "--workdir", str(tmp_path)])
  out = capsys.readouterr().out
  assert "8 runs (dry run: nothing launched)" in out
  assert "--config.model.preset=tiny-llama3 --config.layout=sampler" in out
  assert not any(tmp_path.iterdir())


def test_sweep_with_a_bad_run_exits_2_naming_it_before_running_any(capsys, tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("from jaxrl.algorithms.sft import default_config\n"
                 "def get_config():\n  return default_config()\n"
                 "def sweep():\n  yield {'optim.lr': 1e-3}\n  yield {'optim.lrr': 1e-4}\n")
  with pytest.raises(SystemExit) as e:
    cli.main(["sweep", "--config", str(bad), "--command", "model", "--workdir", str(tmp_path)])
  assert e.value.code == 2
  captured = capsys.readouterr()
  assert "sweep run 1 ({'optim.lrr': 0.0001})" in captured.err and "optim.lr" in captured.err
  assert "--- run" not in captured.out  # nothing ran, not even the good first run


def test_bad_override_exits_2_with_one_line(capsys, repo_root):
  with pytest.raises(SystemExit) as e:
    cli.main(["model", "--config", os.path.join(repo_root, "configs/tiny.py"),
              "--config.model.num_layerz=3"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "num_layerz" in err and "num_layers" in err


def test_console_script_errors_have_no_traceback(repo_root):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  res = subprocess.run([JAXRL, "model", "--config", "configs/tiny.py",
                        "--config.mesh.data=3", "--config.mesh.fsdp=1"],
                       cwd=repo_root, env=env, capture_output=True, text=True, timeout=120)
  assert res.returncode == 2
  assert "Traceback" not in res.stderr
  assert "needs 3 devices but there are 8" in res.stderr
