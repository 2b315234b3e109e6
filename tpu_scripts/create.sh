#!/usr/bin/env bash
# Creates a TPU VM or pod slice through a queued resource and waits until it is ACTIVE.
#   TPU_NAME=my-pod ZONE=us-east5-b PROJECT=my-proj ACCELERATOR_TYPE=v5litepod-16 \
#       RUNTIME_VERSION=v2-alpha-tpuv5-lite bash tpu_scripts/create.sh [--spot | --reserved] [--dry-run]
# WAIT_MINUTES (default 60) bounds the wait; the queued resource is named $TPU_NAME-qr (QUEUED_RESOURCE).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
: "${ACCELERATOR_TYPE:?set ACCELERATOR_TYPE (e.g. v5litepod-16, v4-32, v6e-8)}"
: "${RUNTIME_VERSION:?set RUNTIME_VERSION (e.g. v2-alpha-tpuv5-lite, tpu-ubuntu2204-base)}"
tier=()
for a in "${ARGS[@]}"; do
  case $a in
    --spot | --reserved) tier+=("$a") ;;
    *) die "unknown argument $a (expected --spot, --reserved, --dry-run)" ;;
  esac
done
mapfile -t loc < <(location)
run gcloud compute tpus queued-resources create "$QUEUED_RESOURCE" "--node-id=$TPU_NAME" "${loc[@]}" \
  "--accelerator-type=$ACCELERATOR_TYPE" "--runtime-version=$RUNTIME_VERSION" "${tier[@]}"
describe=(gcloud compute tpus queued-resources describe "$QUEUED_RESOURCE" "${loc[@]}" "--format=value(state.state)")
if ((DRY_RUN)); then
  run "${describe[@]}"
  exit 0
fi
deadline=$((SECONDS + 60 * ${WAIT_MINUTES:-60}))
while state=$("${describe[@]}"); [[ $state != ACTIVE ]]; do
  case $state in FAILED | SUSPENDED) die "queued resource $QUEUED_RESOURCE is $state" ;; esac
  ((SECONDS < deadline)) || die "queued resource $QUEUED_RESOURCE still $state after ${WAIT_MINUTES:-60} minutes"
  echo "queued resource $QUEUED_RESOURCE: $state" >&2
  sleep 30
done
echo "$TPU_NAME is ACTIVE" >&2
