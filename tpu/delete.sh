#!/usr/bin/env bash
# Deletes a TPU VM, or a queued resource together with its VM (--queued).
#
#   tpu/delete.sh --name my-tpu --zone us-west4-a
#   tpu/delete.sh --name my-pod --zone us-central2-b --queued --dry-run
#
# Deleting does not ask for confirmation (--quiet): a TPU bills while it exists.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"

usage() { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; }

NAME="" ZONE="" PROJECT="" QUEUED=0
while [ $# -gt 0 ]; do
  case $1 in
    --name) NAME=${2-}; shift 2 ;;
    --zone) ZONE=${2-}; shift 2 ;;
    --project) PROJECT=${2-}; shift 2 ;;
    --queued) QUEUED=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see $SCRIPT --help)" ;;
  esac
done
need "$NAME" --name
need "$ZONE" --zone
mapfile -t SCOPE < <(scope_flags "$ZONE" "$PROJECT")

if [ "$QUEUED" = 1 ]; then
  run gcloud compute tpus queued-resources delete "$NAME" "${SCOPE[@]}" --force --quiet
else
  run gcloud compute tpus tpu-vm delete "$NAME" "${SCOPE[@]}" --quiet
fi
