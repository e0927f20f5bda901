#!/usr/bin/env bash
# Creates a Cloud TPU VM (a single host or a pod slice), directly or as a queued resource.
#
#   tpu/create.sh --name my-tpu --zone us-west4-a --accelerator-type v5litepod-8 --spot
#   tpu/create.sh --name my-pod --zone us-central2-b --accelerator-type v4-32 --queued --dry-run
#
# --version defaults to the runtime Google documents for the generation (v2-alpha-tpuv6e,
# v2-alpha-tpuv5-lite, v2-alpha-tpuv5, tpu-ubuntu2204-base). A queued resource waits for
# capacity: the script polls until it is ACTIVE. --dry-run prints the gcloud commands only.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

TYPE="" VERSION="" SPOT=0 PREEMPTIBLE=0 QUEUED=0 POLL=30
while [ $# -gt 0 ]; do
  case $1 in
    --accelerator-type) TYPE=${2-}; shift 2 ;;
    --version) VERSION=${2-}; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --preemptible) PREEMPTIBLE=1; shift ;;
    --queued) QUEUED=1; shift ;;
    --poll) POLL=${2-}; shift 2 ;;
    *) common_flag "$@"; shift "$SHIFTED" ;;
  esac
done
require_target
need "$TYPE" --accelerator-type
WORKERS=$(workers_for "$TYPE")
VERSION=${VERSION:-$(default_version "$TYPE")}
[ $((SPOT + PREEMPTIBLE)) -le 1 ] || die "--spot and --preemptible exclude each other: pick one"

note "$TYPE: $WORKERS worker(s), runtime $VERSION"
if [ "$QUEUED" = 1 ]; then
  [ "$PREEMPTIBLE" = 0 ] || die "queued resources take --spot, not --preemptible"
  flags=()
  [ "$SPOT" = 0 ] || flags+=(--spot)
  run gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" "${SCOPE[@]}" \
    --accelerator-type="$TYPE" --runtime-version="$VERSION" "${flags[@]}"
  note "waiting for the queued resource to become ACTIVE (polled every ${POLL}s)"
  if [ "$DRY_RUN" = 1 ]; then
    run gcloud compute tpus queued-resources describe "$NAME" "${SCOPE[@]}" --format='value(state.state)'
    exit 0
  fi
  while true; do
    state=$(run gcloud compute tpus queued-resources describe "$NAME" "${SCOPE[@]}" --format='value(state.state)')
    case $state in
      ACTIVE) break ;;
      FAILED | SUSPENDED) die "queued resource $NAME is $state" ;;
    esac
    sleep "$POLL"
  done
else
  flags=()
  [ "$SPOT" = 0 ] || flags+=(--spot)
  [ "$PREEMPTIBLE" = 0 ] || flags+=(--preemptible)
  run gcloud compute tpus tpu-vm create "$NAME" "${SCOPE[@]}" --accelerator-type="$TYPE" \
    --version="$VERSION" "${flags[@]}"
fi
