#!/usr/bin/env bash
# Deletes the queued resource and its TPU VM / pod slice (checkpoints on GCS stay).
#   TPU_NAME=my-pod ZONE=us-east5-b bash tpu_scripts/delete.sh [--dry-run]
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
((${#ARGS[@]} == 0)) || die "unexpected arguments: ${ARGS[*]}"
mapfile -t loc < <(location)
run gcloud compute tpus queued-resources delete "$QUEUED_RESOURCE" "${loc[@]}" --force --quiet
