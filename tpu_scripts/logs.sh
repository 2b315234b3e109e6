#!/usr/bin/env bash
# Follows main.py's log on a worker (default 0; process 0 writes the progress bar and the metrics).
#   TPU_NAME=my-pod ZONE=us-east5-b bash tpu_scripts/logs.sh [--worker=N|all] [--lines=100] [--dry-run]
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
WORKER=0  # process 0's log unless --worker says otherwise
parse_common "$@"
lines=100
for a in "${ARGS[@]}"; do
  case $a in
    --lines=*) lines=${a#--lines=} ;;
    *) die "unknown argument $a (expected --worker=N|all, --lines=N, --dry-run)" ;;
  esac
done
[[ $lines =~ ^[0-9]+$ ]] || die "--lines=$lines: expected a number"
on_workers "tail -n $lines -F ~/$LOG"
