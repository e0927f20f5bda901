#!/usr/bin/env bash
# Runs a jaxrl command on a spot (or preemptible, or queued) TPU VM until it finishes: when the
# VM is preempted, it is deleted, created again, set up, and the same command re-run, which
# resumes from the latest checkpoint in the workdir.
#
#   tpu/watch.sh --name my-tpu --zone us-west4-a --accelerator-type v5litepod-8 --spot \
#       -- sft --config configs/sft_tiny.py --workdir gs://my-bucket/runs/sft
#
# Takes create.sh's flags (--version, --spot, --preemptible, --queued, --project) and
# --max-restarts N (default 20), --log-dir DIR, --run-name NAME (attempt k logs to
# LOG_DIR/NAME-try<k>/), --delete-when-done. The workdir must outlive the VM: use
# gs://BUCKET/... (mounted on every worker by setup.sh). A command that fails on a healthy VM
# is a real failure: watch stops with its exit status.
# --dry-run prints the gcloud commands of a run that is preempted once, then finishes.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

TYPE="" RUN_NAME="" QUEUED=0 MAX_RESTARTS=20 DELETE_WHEN_DONE=0 POLL=30
create_args=() run_args=()
TAKES_COMMAND=1
while [ $# -gt 0 ]; do
  case $1 in
    --accelerator-type) TYPE=${2-}; shift 2 ;;
    --version) create_args+=(--version "${2-}"); shift 2 ;;
    --spot | --preemptible) create_args+=("$1"); shift ;;
    --queued) QUEUED=1; shift ;;
    --max-restarts) MAX_RESTARTS=${2-}; shift 2 ;;
    --log-dir) run_args+=("$1" "${2-}"); shift 2 ;;
    --run-name) RUN_NAME=${2-}; shift 2 ;;
    --delete-when-done) DELETE_WHEN_DONE=1; shift ;;
    --poll) POLL=${2-}; shift 2 ;;
    --) shift; break ;;
    *) common_flag "$@"; shift "$SHIFTED" ;;
  esac
done
require_target
need "$TYPE" --accelerator-type
[ $# -gt 0 ] || die "no jaxrl command: add it after --, e.g. -- sft --config configs/sft_tiny.py --workdir gs://B/run"
RUN_NAME=${RUN_NAME:-jaxrl-$(date -u +%Y%m%d-%H%M%S)}  # each attempt's logs: RUN_NAME-try<k>

workdir="" prev=""
for a in "$@"; do
  [ "$prev" != --workdir ] || workdir=$a
  [[ $a != --workdir=* ]] || workdir=${a#--workdir=}
  prev=$a
done
need "$workdir" "--workdir (in the jaxrl command)"
bucket=""
if [[ $workdir == gs://* ]]; then
  bucket=${workdir#gs://}
  bucket=${bucket%%/*}
else
  note "warning: workdir $workdir is on the VM's disk, which a recreated VM does not have: the run restarts from scratch after a preemption; use --workdir gs://BUCKET/..."
fi

common=(--name "$NAME" --zone "$ZONE")
[ -z "$PROJECT" ] || common+=(--project "$PROJECT")
delete_args=()
[ "$QUEUED" = 0 ] || { create_args+=(--queued); delete_args+=(--queued); }
dry=()
[ "$DRY_RUN" = 0 ] || dry=(--dry-run)
setup_args=()
[ -z "$bucket" ] || setup_args+=(--bucket "$bucket")

# Sets STATE: READY/ACTIVE when the VM can run, NOT_FOUND when it does not exist. --dry-run
# asks nothing and plays a preemption: missing at first, PREEMPTED after the first run.
probes=0
vm_state() {
  local kind=tpu-vm fmt='value(state)'
  [ "$QUEUED" = 0 ] || { kind=queued-resources; fmt='value(state.state)'; }
  if [ "$DRY_RUN" = 1 ]; then
    run gcloud compute tpus "$kind" describe "$NAME" "${SCOPE[@]}" --format="$fmt"
    probes=$((probes + 1))
    if [ "$probes" = 1 ]; then STATE=NOT_FOUND; else STATE=PREEMPTED; fi
  else
    STATE=$(gcloud compute tpus "$kind" describe "$NAME" "${SCOPE[@]}" --format="$fmt" 2>/dev/null) ||
      STATE=NOT_FOUND
    STATE=${STATE:-NOT_FOUND}
  fi
}
healthy() { [ "$1" = READY ] || [ "$1" = ACTIVE ]; }

restarts=0 runs=0
while true; do
  vm_state
  note "$NAME is $STATE"
  if ! healthy "$STATE"; then
    if [ "$STATE" != NOT_FOUND ]; then
      bash "$TPU_DIR/delete.sh" "${common[@]}" "${delete_args[@]}" "${dry[@]}"
    fi
    bash "$TPU_DIR/create.sh" "${common[@]}" --accelerator-type "$TYPE" "${create_args[@]}" "${dry[@]}"
  fi
  bash "$TPU_DIR/setup.sh" "${common[@]}" "${setup_args[@]}" "${dry[@]}"
  runs=$((runs + 1))
  set +e
  bash "$TPU_DIR/run.sh" "${common[@]}" --accelerator-type "$TYPE" "${run_args[@]}" --run-name "$RUN_NAME-try$runs" \
    "${dry[@]}" -- "$@"
  rc=$?
  set -e
  if [ "$DRY_RUN" = 1 ] && [ "$runs" = 1 ]; then
    note "(dry run: suppose the VM is preempted during this run)"
    rc=255
  fi
  if [ "$rc" = 0 ]; then
    note "the command finished (run $runs, $restarts restart(s))"
    break
  fi
  # Was it a preemption? The state can lag the lost ssh session: look a few times.
  preempted=0
  for ((k = 0; k < 4; k++)); do
    vm_state
    if ! healthy "$STATE"; then preempted=1; break; fi
    [ "$DRY_RUN" = 1 ] || sleep "$POLL"
  done
  if [ "$preempted" = 0 ]; then
    note "the command failed with exit status $rc on a healthy VM: not a preemption, stopping"
    exit "$rc"
  fi
  restarts=$((restarts + 1))
  [ "$restarts" -le "$MAX_RESTARTS" ] || die "preempted $restarts times (limit --max-restarts $MAX_RESTARTS)"
  note "preempted ($STATE): recreating $NAME and resuming from $workdir (restart $restarts)"
done
[ "$DELETE_WHEN_DONE" = 0 ] || bash "$TPU_DIR/delete.sh" "${common[@]}" "${delete_args[@]}" "${dry[@]}"
