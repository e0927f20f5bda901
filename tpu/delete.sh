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

QUEUED=0
while [ $# -gt 0 ]; do
  case $1 in
    --queued) QUEUED=1; shift ;;
    *) common_flag "$@"; shift "$SHIFTED" ;;
  esac
done
require_target

if [ "$QUEUED" = 1 ]; then
  run gcloud compute tpus queued-resources delete "$NAME" "${SCOPE[@]}" --force --quiet
else
  run gcloud compute tpus tpu-vm delete "$NAME" "${SCOPE[@]}" --quiet
fi
