#!/usr/bin/env bash
# Runs one jaxrl command on every worker of a TPU VM at once; collects each worker's log.
#
#   tpu/run.sh --name my-tpu --zone us-west4-a --accelerator-type v5litepod-8 \
#       -- sft --config configs/sft_tiny.py --workdir gs://my-bucket/runs/sft
#   tpu/run.sh --name my-pod --zone us-central2-b --workers 4 --run-name sft1 --dry-run -- sft ...
#
# Everything after -- is the jaxrl command line (without `jaxrl`), with paths relative to the
# checkout. On a slice of more than one worker, jaxrl joins the workers with
# jax.distributed.initialize(). Each worker appends its output to ~/jaxrl-logs/RUN.log; after
# the command the logs come back as LOG_DIR/RUN/worker-<i>.log (and the combined stream as
# all.log). The exit status is the command's. A gs:// workdir needs setup.sh --bucket.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }

WORKERS="" TYPE="" LOG_DIR=runs/tpu-logs RUN_NAME=""
TAKES_COMMAND=1
while [ $# -gt 0 ]; do
  case $1 in
    --workers) WORKERS=${2-}; shift 2 ;;
    --accelerator-type) TYPE=${2-}; shift 2 ;;
    --log-dir) LOG_DIR=${2-}; shift 2 ;;
    --run-name) RUN_NAME=${2-}; shift 2 ;;
    --) shift; break ;;
    *) common_flag "$@"; shift "$SHIFTED" ;;
  esac
done
require_target
[ $# -gt 0 ] || die "no jaxrl command: add it after --, e.g. -- sft --config configs/sft_tiny.py --workdir gs://B/run"
RUN_NAME=${RUN_NAME:-jaxrl-$(date -u +%Y%m%d-%H%M%S)}
[[ $RUN_NAME =~ ^[A-Za-z0-9._=-]+$ ]] || die "--run-name '$RUN_NAME' may hold only letters, digits and . _ = -"

if [ -z "$WORKERS" ] && [ -n "$TYPE" ]; then
  WORKERS=$(workers_for "$TYPE")
elif [ -z "$WORKERS" ]; then
  [ "$DRY_RUN" = 0 ] || die "--dry-run needs --workers N or --accelerator-type T (it asks gcloud nothing)"
  TYPE=$(run gcloud compute tpus tpu-vm describe "$NAME" "${SCOPE[@]}" --format='value(acceleratorType)')
  WORKERS=$(workers_for "${TYPE##*/}")
fi
[[ $WORKERS =~ ^[1-9][0-9]*$ ]] || die "--workers '$WORKERS' is not a positive number"

multihost=""
[ "$WORKERS" = 1 ] || multihost=" --multihost"
prev=""
for a in "$@"; do
  w=""
  [ "$prev" != --workdir ] || w=$a
  [[ $a != --workdir=* ]] || w=${a#--workdir=}
  if [ -n "$w" ] && [ "$WORKERS" != 1 ] && [[ $w != gs://* ]]; then
    note "warning: workdir $w is on each worker's own disk; the workers of a slice write one checkpoint together and need a shared directory: use --workdir gs://BUCKET/... (setup.sh --bucket BUCKET)"
  fi
  prev=$a
done
# ~ reaches the worker unquoted, so the worker's shell expands it.
remote="cd ~/jaxrl && bash tpu/worker.sh run --log ~/jaxrl-logs/$RUN_NAME.log$multihost -- $(quote_all "$@")"
out=$LOG_DIR/$RUN_NAME
note "run $RUN_NAME on $WORKERS worker(s); logs in $out/"
set +e
if [ "$DRY_RUN" = 1 ]; then
  run gcloud compute tpus tpu-vm ssh "$NAME" "${SCOPE[@]}" --worker=all --command="$remote"
  rc=0
else
  mkdir -p "$out"
  run gcloud compute tpus tpu-vm ssh "$NAME" "${SCOPE[@]}" --worker=all --command="$remote" 2>&1 |
    tee "$out/all.log"
  rc=${PIPESTATUS[0]}
fi
for ((i = 0; i < WORKERS; i++)); do
  run gcloud compute tpus tpu-vm scp "$NAME:jaxrl-logs/$RUN_NAME.log" "$out/worker-$i.log" \
    "${SCOPE[@]}" --worker="$i" || note "worker $i: its log could not be copied"
done
[ "$DRY_RUN" = 1 ] || note "exit status $rc"
exit "$rc"
