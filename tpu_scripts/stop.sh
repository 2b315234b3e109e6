#!/usr/bin/env bash
# Stops the run on every worker: SIGTERM first (the job saves a checkpoint and exits, so --config.resume=True
# continues it), SIGKILL to whatever is still running after STOP_TIMEOUT seconds (default 300).
#   TPU_NAME=my-pod ZONE=us-east5-b bash tpu_scripts/stop.sh [--dry-run]
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
((${#ARGS[@]} == 0)) || die "unexpected arguments: ${ARGS[*]}"
timeout=${STOP_TIMEOUT:-300}
[[ $timeout =~ ^[0-9]+$ ]] || die "STOP_TIMEOUT=$timeout: expected seconds"
# main.py, and generation servers (serve.sh), which stop by themselves once their trainer is gone
pattern='[p]ython (main.py|-m arealjax.generation.server)'
on_workers "pkill -TERM -f '$pattern' || true; \
for _ in \$(seq $timeout); do pgrep -f '$pattern' > /dev/null || exit 0; sleep 1; done; \
pkill -KILL -f '$pattern' || true"
