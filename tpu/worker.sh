#!/usr/bin/env bash
# Runs ON each TPU VM worker: setup.sh and run.sh call it over ssh. Not for your machine.
#
#   bash tpu/worker.sh setup [--bucket BUCKET] [--python 3.12]
#   bash tpu/worker.sh run --log FILE [--multihost] -- <jaxrl args>
#
# setup: a venv (.venv in the checkout) with Python >= 3.12 (uv fetches one; the TPU images ship
# 3.10), jaxrl pinned by requirements.lock and jax[tpu]; with --bucket, the bucket is mounted
# with Cloud Storage FUSE at /gcs/BUCKET so that every worker sees one shared run directory.
# run: `jaxrl <args>` with gs://BUCKET/... arguments read as /gcs/BUCKET/..., its output
# appended to FILE; --multihost makes jaxrl call jax.distributed.initialize().
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "tpu/worker.sh ($(hostname)): error: $*" >&2; exit 2; }

mount_bucket() {
  local bucket=$1 dir=/gcs/$1
  if ! command -v gcsfuse >/dev/null 2>&1; then
    # Cloud Storage FUSE from Google's apt repository (the TPU images do not ship it).
    local repo
    repo="gcsfuse-$(lsb_release -c -s)"
    curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg |
      sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
    echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt $repo main" |
      sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
    sudo apt-get update -q && sudo apt-get install -y -q gcsfuse
  fi
  sudo mkdir -p "$dir" && sudo chown "$(id -u):$(id -g)" "$dir"
  mountpoint -q "$dir" || gcsfuse --implicit-dirs "$bucket" "$dir"
  echo "worker $(hostname): gs://$bucket mounted at $dir"
}

setup() {
  local bucket="" python=3.12
  while [ $# -gt 0 ]; do
    case $1 in
      --bucket) bucket=${2-}; shift 2 ;;
      --python) python=${2-}; shift 2 ;;
      *) die "setup: unknown argument '$1'" ;;
    esac
  done
  local uv
  uv=$(command -v uv || echo "$HOME/.local/bin/uv")
  [ -x "$uv" ] || python3 -m pip install --user -q uv
  [ -x .venv/bin/python ] || "$uv" venv -q --python "$python" .venv
  "$uv" pip install -q --python .venv/bin/python -c requirements.lock -e . "jax[tpu]"
  [ -z "$bucket" ] || mount_bucket "$bucket"
  # TCMalloc, which the jaxrl command preloads for its host-side allocations
  # (jaxrl/backends/cpu/allocator.py).
  ls /usr/lib/*-linux-gnu/libtcmalloc*.so* >/dev/null 2>&1 ||
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 >/dev/null ||
    echo "worker $(hostname): libtcmalloc-minimal4 not installed; jaxrl runs on glibc malloc"
  echo "worker $(hostname): $(.venv/bin/python --version), jax $(.venv/bin/python -c \
    'from importlib.metadata import version; print(version("jax"))'), jaxrl installed in $PWD/.venv"
}

run() {
  local log="" multihost=0
  while [ $# -gt 0 ]; do
    case $1 in
      --log) log=${2-}; shift 2 ;;
      --multihost) multihost=1; shift ;;
      --) shift; break ;;
      *) die "run: unknown argument '$1'" ;;
    esac
  done
  [ -n "$log" ] || die "run: --log FILE is required"
  [ $# -gt 0 ] || die "run: no jaxrl command after --"
  local args=() a bucket
  for a in "$@"; do
    if [[ $a == *gs://* ]]; then
      bucket=${a#*gs://}
      bucket=${bucket%%/*}
      mountpoint -q "/gcs/$bucket" ||
        die "gs://$bucket is not mounted on this worker: run tpu/setup.sh with --bucket $bucket"
      a=${a//gs:\/\//\/gcs\/}
    fi
    args+=("$a")
  done
  [ "$multihost" = 0 ] || export JAXRL_DISTRIBUTED=auto
  mkdir -p "$(dirname "$log")"
  echo "=== $(date -u +%FT%TZ) worker $(hostname): jaxrl ${args[*]}" >>"$log"
  set +e
  .venv/bin/jaxrl "${args[@]}" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $(date -u +%FT%TZ) worker $(hostname): exit status $rc" >>"$log"
  exit "$rc"
}

case ${1-} in
  setup) shift; setup "$@" ;;
  run) shift; run "$@" ;;
  *) die "usage: tpu/worker.sh setup [--bucket B] | run --log FILE [--multihost] -- <jaxrl args>" ;;
esac
