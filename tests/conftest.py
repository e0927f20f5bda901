"""Every test runs on CPU with 8 fake devices, so each sharding path runs here."""

import json
import os
import sys
import tempfile

# The XLA flags the suite was started with (`make test-isa`'s --xla_cpu_max_isa, say): the
# end-to-end runs keep them when they drop the suite's own. (Kept in the environment, read by
# the xdist workers, which inherit the flags below.)
USER_XLA_FLAGS = os.environ.setdefault("JAXRL_SUITE_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
# Optimisation level 0 compiles the tiny test programs about 4x faster on CPU and runs them
# only about 10% slower; the tests compile far more than they run.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session: the xdist workers and the subprocesses the
# end-to-end tests start compile the same train steps, and each compile then happens once.
# (Set here, in the controller, before the workers start, so all of them inherit one folder.)
# The controller removes it at the end (pytest_unconfigure) unless the caller named the folder.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:  # (not setdefault: its argument made an empty folder in every xdist worker)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl-jit-cache-")
# Every compile, however short: most of the tests' programs compile in under half a second, at
# level 0, and many recur from test to test (test_sampler, test_paged, test_sharding and
# test_model: 139 s at a 0.5 s threshold, 126 s at 0; 2026-12-06, AMD EPYC, -n 2).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The seed of the learning tests' runs and of the shared runs they start from: 0 in CI;
# tools/learning_sweep.py sets it to measure each bar's spread over seeds.
LEARN_SEED = int(os.environ.get("JAXRL_LEARN_SEED", "0"))
# The `jaxrl` console script of the environment running the tests.
JAXRL = os.path.join(os.path.dirname(sys.executable), "jaxrl")


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
  user's run has (with the flags the suite was started with). Test modules import it (`from
  conftest import subprocess_env`)."""
  flags = [f for f in (os.environ["XLA_FLAGS"] if test_flags else USER_XLA_FLAGS).split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  flags.append(f"--xla_force_host_platform_device_count={devices}")
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))


class Bars:
  """A learning test's figures beside their bars. `above(name, value, bar)` and `below(...)`
  record a figure as a junit-XML property ("value > bar"; tools/learning_sweep.py tabulates
  them over CPU kinds and seeds) and `check()` asserts them all at once, so a cell that misses
  one bar still reports every figure. The fixture fails a test that never calls check()."""

  def __init__(self, record_property):
    self._record, self._bars, self.checked = record_property, [], False

  def above(self, name: str, value: float, bar: float):
    self._add(name, value, ">", bar)

  def below(self, name: str, value: float, bar: float):
    self._add(name, value, "<", bar)

  def _add(self, name, value, op, bar):
    self._record(name, f"{float(value):.4f} {op} {bar}")
    self._bars.append((name, float(value), op, bar))

  def check(self):
    self.checked = True
    missed = [f"{n} {v:.4f} (bar {op} {b})" for n, v, op, b in self._bars
              if not (v > b if op == ">" else v < b)]
    assert not missed, "missed: " + "; ".join(missed)


@pytest.fixture
def bars(record_property):
  b = Bars(record_property)
  yield b
  assert b.checked, "a learning test recorded bars and never checked them"


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


def jaxrl_cli(args: list[str], *, cwd=None, devices: int = 1, timeout: int = 1800):
  """Runs `jaxrl ARGS` as a user would: a subprocess on `devices` CPU devices under default XLA
  flags (not this suite's faster-compiling ones; the long learning runs are run-bound, not
  compile-bound, and run 2-3x faster so: GRPO's 80 steps with a reward model took 49 s on one
  device against 101 s in this process's 8 fake devices at optimisation level 0). Asserts it
  succeeded and returns the finished process (its .stdout and .stderr)."""
  import subprocess
  res = subprocess.run([JAXRL, *args], env=subprocess_env(devices, test_flags=False),
                       cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)
  assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
  return res


def _shared_run(tmp_path_factory, name: str, command: str, config: str, settings: dict) -> str:
  """The run dir of `jaxrl COMMAND --config configs/CONFIG` with `settings`, trained once per
  test session and shared by the xdist workers: the first to take the lock trains it, the others
  wait and reuse the finished run dir. Tests must only read it (copy it to resume from it).
  Its seed is LEARN_SEED.

  It trains as `jaxrl_cli` runs it, on one CPU device under default XLA flags, as a user's run
  would: SFT's 1000 steps take about a third as long as in 8 fake devices (8,700 against 2,900
  tokens/s, measured 2026-12-01), which suits the many small programs of the tests, not a long
  run."""
  import fcntl
  shared = _session_dir(tmp_path_factory)
  workdir = shared / name
  with open(shared / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (workdir / "summary.json").exists():
      jaxrl_cli([command, "--config", os.path.join(ROOT, "configs", config), "--workdir",
                 str(workdir)] + [f"--config.{k}={v}" for k, v in
                                  {"seed": LEARN_SEED, **settings}.items()])
  return str(workdir)


@pytest.fixture(scope="session")
def sft_addition():
  """A tiny SFT policy on addition from demonstrations with 20% random slips (configs/
  sft_tiny.py, 1000 steps at its lr 1e-3, seed 0), committed: tests/fixtures/sft_addition, made
  by tests/fixtures/make_warm_starts.py. Held-out greedy accuracy 0.895, the right answer each
  prompt's mode (SFT seeds 0-4 on this recipe: median 0.852, 0.617-0.894 over the 12 cells of
  tools/learning_sweep.py, 2026-12-06; seed 1 was the low one). Reward models, DPO and the
  two-process GRPO tests start from it. Trained here it took ~100 s of the suite, and each CPU
  kind rounded it into a different policy."""
  return _committed_warm_start("sft_addition")


@pytest.fixture(scope="session")
def sft_slip():
  """The demo's SFT policy (configs/sft_tiny.py with jaxrl.demo.SFT_OVERRIDES: 1000 steps at
  lr 1e-3 on demonstrations that drop the carry on 60% of the sums with one, seed 0),
  committed whole (optimizer state too: the demo test resumes it as `jaxrl demo`'s finished SFT
  stage): tests/fixtures/sft_slip, made by tests/fixtures/make_warm_starts.py. SFT learns the
  slip (held-out 0.645; 0.496-0.703 over the 12 cells of tools/learning_sweep.py, 2026-12-06;
  docs/guides/recipes.md), so RL that rewards the right answer has a real fix to make. Trained
  here it took ~90 s of the suite, and each CPU kind rounded it into a different policy."""
  return _committed_warm_start("sft_slip")


@pytest.fixture(scope="session")
def reward_models(sft_addition, tmp_path_factory):
  """Run dirs of two reward models trained from the sft_addition policy, once per session and
  shared by the xdist workers (as `jaxrl rm`, like the SFT fixtures): "honest"
  (configs/rm_tiny.py: chosen = the correct sum) and "biased" (:biased, a labeller preferring
  longer answers). Tests must only read them."""
  return {
      # 600 steps, not 1600: it plateaus by 400-600 (1600 steps had seed 0 at 0.525 -> 0.793 /
      # 0.803 / 0.805 / 0.814 at steps 400 / 800 / 1200 / 1600), and 600 take 50-70 s, not ~100
      "honest": _shared_run(tmp_path_factory, "rm_honest", "rm", "rm_tiny.py", {
          "init.checkpoint": sft_addition, "train.log_every": 100, "train.steps": 600,
          "train.save_every": 600}),
      # its labeller's taste is learnt by step 100 (measured: 1.0)
      "biased": _shared_run(tmp_path_factory, "rm_biased", "rm", "rm_tiny.py:biased", {
          "init.checkpoint": sft_addition, "train.log_every": 100, "train.steps": 100,
          "train.save_every": 100})}


@pytest.fixture(scope="session")
def rm_logprob(sft_addition, tmp_path_factory):
  """A well-trained reward model (configs/rm_tiny.py:logprob, 400 steps from sft_addition: its
  head adds the backbone's response log-prob; held-out pairwise accuracy 0.957 at step 0, 0.945
  at 400, from the lr-1e-3 sft_addition, 2026-12-03; rm_tiny over seeds 0-4 from sft_tiny's
  policy: 0.963-0.973 (docs/guides/recipes.md): the log-prob feature carries it from the
  start)."""
  return _shared_run(tmp_path_factory, "rm_logprob", "rm", "rm_tiny.py:logprob", {
      "init.checkpoint": sft_addition, "train.log_every": 100})


@pytest.fixture(scope="session")
def sft_calculator():
  """The calculator recipe's warm start (configs/agentic_tiny.py:sft, seed 0), committed:
  tests/fixtures/calculator_sft, made by tests/fixtures/make_warm_starts.py (SFT on calculator
  conversations, 15% of them calling the tool, so greedy it answers in its head;
  tests/test_agentic.py's learning test gives its figures). Trained here it took 4-5 of the
  suite's minutes, and from CPU to CPU its rounding made a different policy."""
  return _committed_warm_start("calculator_sft")


def _committed_warm_start(name: str) -> str:
  """tests/fixtures/NAME, a warm start of tests/fixtures/make_warm_starts.py: what its
  config.json says of the training (seed, model, data, optim, train) must be today's recipe."""
  from jaxrl import config as config_lib
  from jaxrl.train import rundir
  from jaxrl.algorithms.sft import CHOICES
  sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))
  try:
    from make_warm_starts import WARM_STARTS
  finally:
    sys.path.pop(0)
  config_file, settings = WARM_STARTS[name]
  path = os.path.join(ROOT, "tests", "fixtures", name)
  recipe = config_lib.load_config(os.path.join(ROOT, "configs", config_file),
                                  [f"{k}={v}" for k, v in settings.items()],
                                  choices=CHOICES).to_dict()
  saved = rundir.read_config(path)

  def unset_dropped(x):  # None is a key left unset: as a key added since, at its default
    if isinstance(x, dict):
      return {k: unset_dropped(v) for k, v in x.items() if v is not None}
    return x
  changed = [k for k in ("seed", "model", "data", "optim", "train")
             if unset_dropped(json.loads(json.dumps(recipe[k], default=str)))
             != unset_dropped(saved.get(k))]
  assert not changed, (f"configs/{config_file}'s {changed} differ from the committed warm start "
                       f"{name}'s: rerun tests/fixtures/make_warm_starts.py {name}")
  return path


_SHARED_RUNS = {"reward_models", "rm_logprob"}
# Which of the two workers trains each shared run: a test that reads several goes to the worker
# of the first it reads in this order. Worker 0 trains the two reward models, worker 1
# rm_logprob. Dealt alternately by file order instead, a test on each worker wanted
# `reward_models` at about the same time, and one worker sat on its lock while the other
# trained it (setups of 111 and 117 s, CI at 14812a9, 2026-12-02).
_BUILDER = {"reward_models": 0, "rm_logprob": 1}


@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m learning` sees the marks added here
def pytest_collection_modifyitems(config, items):
  """Orders the session for the Makefile's `-n 2 --dist worksteal`, which hands each worker one
  contiguous half of this list and lets a worker that runs dry take half of the other's queue
  from its end. The slow end-to-end tests that read the shared runs above go first, each to the
  worker that trains the run it needs (_BUILDER), so the runs are trained early and neither
  worker waits on the other's; the other slow tests follow, dealt alternately (worker 1, with
  the shorter head, first); the fast tests fill the tails, where stealing evens out the finish.
  Before, one worker could end on a five-minute test while the other sat idle."""
  def worker(item):
    used = _SHARED_RUNS & set(getattr(item, "fixturenames", ()))
    return next((_BUILDER[r] for r in _BUILDER if r in used), None)

  for item in items:  # a test with bars (the `bars` fixture) is a learning test
    if "bars" in getattr(item, "fixturenames", ()):
      assert item.get_closest_marker("slow"), f"{item.nodeid}: a learning test is marked slow"
      item.add_marker(pytest.mark.learning)
  slow = [i for i in items if i.get_closest_marker("slow") is not None]
  fast = [i for i in items if i.get_closest_marker("slow") is None]
  heads = ([i for i in slow if worker(i) == 0], [i for i in slow if worker(i) == 1])
  rest = [i for i in slow if worker(i) is None]
  heads[1].extend(rest[0::2])
  heads[0].extend(rest[1::2])
  cut = max(0, len(items) // 2 - len(heads[0]))
  items[:] = heads[0] + fast[:cut] + heads[1] + fast[cut:]


def assert_model_flops_per_token(row, cfg, seq_len: int, forwards: int, *, lm_head=True):
  """A trainer's logged perf/tflops and perf/tokens_per_s share their clock, so their ratio is
  the model FLOPs per token the step spent (jaxrl.models.flops): `forwards` forward passes'
  worth (3 for a forward and backward), between their matrix products alone and those plus
  attention over a whole row of seq_len."""
  from jaxrl.models.flops import forward_flops
  per_token = row["perf/tflops"] * 1e12 / row["perf/tokens_per_s"]
  low = forwards * forward_flops(cfg, tokens=1, pairs=0, lm_head=lm_head)
  high = forwards * forward_flops(cfg, tokens=1, pairs=seq_len, lm_head=lm_head)
  assert low < per_token < high, (row["step"], per_token)


def pytest_unconfigure(config):
  if _OWN_CACHE and not hasattr(config, "workerinput"):  # the controller, once workers are done
    import shutil
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
