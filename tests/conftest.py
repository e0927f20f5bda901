"""Every test runs on CPU with 8 fake devices, so each sharding path runs here."""

import os
import tempfile

# Optimisation level 0 compiles the tiny test programs about 4x faster on CPU and runs them
# only about 10% slower; the tests compile far more than they run.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session: the xdist workers and the subprocesses the
# end-to-end tests start compile the same train steps, and each compile then happens once.
# (Set here, in the controller, before the workers start, so all of them inherit one folder.)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxrl-jit-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def devices():
  assert jax.device_count() == 8, "conftest must fake 8 CPU devices before jax initialises"
  return jax.devices()


@pytest.fixture
def repo_root():
  return ROOT


def subprocess_env(devices=8, *, test_flags=True):
  """This test process's environment (its XLA flags and compilation cache) for a jaxrl
  subprocess with `devices` fake CPU devices; test_flags=False gives plain XLA flags, as a
  user's run has. Test modules import it (`from conftest import subprocess_env`)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count") and test_flags]
  flags.append(f"--xla_force_host_platform_device_count={devices}")
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))


@pytest.fixture
def free_port():
  """A TCP port on 127.0.0.1 that was free a moment ago: the coordinator of a two-process run."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _session_dir(tmp_path_factory):
  """A folder of this pytest session that every xdist worker shares: the workers' base temp
  dirs are children of the session's, so their parent; without xdist, the base temp itself
  (its parent outlives the session, and stale runs there could pass for fresh ones)."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _shared_sft(tmp_path_factory, name: str, overrides: dict) -> str:
  """The run dir of one tiny SFT policy on addition, trained once per test session and shared
  by the xdist workers: the first to take the lock trains it, the others wait and reuse the
  finished run dir. Tests must only read it (copy it to resume from it).

  It trains as `jaxrl sft` in a subprocess on one CPU device under default XLA flags, as a
  user's run would: 1000 steps take about half as long as in this process's 8 fake devices at
  optimisation level 0, which suits the many small programs of the tests, not a long run."""
  import fcntl
  import subprocess
  import sys
  shared = _session_dir(tmp_path_factory)
  workdir = shared / name
  with open(shared / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (workdir / "summary.json").exists():
      settings = {"train.steps": 1000, "train.log_every": 100, "train.save_every": 1000,
                  "eval.every": 1000, **overrides}
      jaxrl = os.path.join(os.path.dirname(sys.executable), "jaxrl")
      env = dict(os.environ, JAX_PLATFORMS="cpu",
                 XLA_FLAGS="--xla_force_host_platform_device_count=1")
      res = subprocess.run([jaxrl, "sft", "--config", os.path.join(ROOT, "configs", "sft_tiny.py"),
                            "--workdir", str(workdir)] +
                           [f"--config.{k}={v}" for k, v in settings.items()],
                           env=env, capture_output=True, text=True, timeout=1800)
      assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
  return str(workdir)


@pytest.fixture(scope="session")
def sft_addition(tmp_path_factory):
  """A tiny SFT policy on addition from demonstrations with 20% random slips (1000 steps):
  held-out greedy accuracy about 0.82-0.84, the right answer each prompt's mode. Reward models
  and DPO start from it (its features are good enough for an honest RM to reach ~0.7)."""
  return _shared_sft(tmp_path_factory, "sft_addition", {"data.error_rate": 0.2})


@pytest.fixture(scope="session")
def sft_slip(tmp_path_factory):
  """The demo's SFT policy: demonstrations that drop the carry on 60% of the sums with one
  (1000 steps). SFT learns the slip (held-out ~0.4-0.65), so RL that rewards the right answer
  has a real fix to make."""
  return _shared_sft(tmp_path_factory, "sft_slip", {"data.error_mode": "systematic",
                                                    "data.error_rate": 0.6})


@pytest.fixture(scope="session")
def reward_models(sft_addition, tmp_path_factory):
  """Run dirs of two reward models trained from the sft_addition policy, once per session
  and shared by the xdist workers (file-locked like sft_addition, and trained the same way: as
  `jaxrl rm` in a one-device subprocess under default XLA flags): "honest" (configs/rm_tiny.py:
  chosen = the correct sum) and "biased" (:biased, a labeller preferring longer answers).
  Tests must only read them."""
  import fcntl
  import subprocess
  import sys
  shared = _session_dir(tmp_path_factory)
  dirs = {"honest": shared / "rm_honest", "biased": shared / "rm_biased"}
  jaxrl = os.path.join(os.path.dirname(sys.executable), "jaxrl")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  with open(shared / "reward_models.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    for name, workdir in dirs.items():
      if not (workdir / "summary.json").exists():
        arg = "" if name == "honest" else ":biased"
        settings = {"init.checkpoint": sft_addition, "train.log_every": 100}
        if name == "biased":  # its labeller's taste is learnt by step 100 (measured: 1.0)
          settings.update({"train.steps": 100, "train.save_every": 100})
        else:  # 0.523 -> 0.582 / 0.568 / 0.617 / 0.621 at steps 400 / 800 / 1200 / 1600 (~40 s)
          settings.update({"train.steps": 1600, "train.save_every": 1600})
        res = subprocess.run([jaxrl, "rm", "--config",
                              os.path.join(ROOT, "configs", f"rm_tiny.py{arg}"),
                              "--workdir", str(workdir)] +
                             [f"--config.{k}={v}" for k, v in settings.items()],
                             env=env, capture_output=True, text=True, timeout=1800)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
  return {k: str(v) for k, v in dirs.items()}
