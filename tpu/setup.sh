#!/usr/bin/env bash
# Copies this checkout to every worker of a TPU VM and installs it there in a venv with jax[tpu].
#
#   tpu/setup.sh --name my-tpu --zone us-west4-a
#   tpu/setup.sh --name my-pod --zone us-central2-b --bucket my-bucket --dry-run
#
# The tracked and untracked-but-not-ignored files are packed (your uncommitted edits travel),
# copied to ~/jaxrl on every worker and installed into ~/jaxrl/.venv (tpu/worker.sh setup).
# --bucket mounts gs://BUCKET at /gcs/BUCKET on every worker, so `--workdir gs://BUCKET/...`
# is one directory shared by all workers and survives the VM. Re-running updates the code.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }

BUCKET="" PYTHON=3.12
while [ $# -gt 0 ]; do
  case $1 in
    --bucket) BUCKET=${2#gs://}; BUCKET=${BUCKET%%/*}; shift 2 ;;
    --python) PYTHON=${2-}; shift 2 ;;
    *) common_flag "$@"; shift "$SHIFTED" ;;
  esac
done
require_target
TARBALL=/tmp/jaxrl-src-$NAME.tar.gz

pack() {
  if git -C "$REPO_ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$REPO_ROOT" && git ls-files -z --cached --others --exclude-standard |
      tar --null -czf "$TARBALL" -T -)
  else
    tar -czf "$TARBALL" -C "$REPO_ROOT" --exclude=.venv --exclude=runs --exclude=.git .
  fi
}

note "pack the checkout ($REPO_ROOT) into $TARBALL"
[ "$DRY_RUN" = 1 ] || pack
worker_args=(setup --python "$PYTHON")
[ -z "$BUCKET" ] || worker_args+=(--bucket "$BUCKET")
run gcloud compute tpus tpu-vm scp "$TARBALL" "$NAME:jaxrl-src.tar.gz" "${SCOPE[@]}" --worker=all
run gcloud compute tpus tpu-vm ssh "$NAME" "${SCOPE[@]}" --worker=all \
  --command="mkdir -p ~/jaxrl && tar -xzf ~/jaxrl-src.tar.gz -C ~/jaxrl && bash ~/jaxrl/tpu/worker.sh $(quote_all "${worker_args[@]}")"
