#!/usr/bin/env bash
# Starts main.py on every worker at once (multi-controller JAX: one process per host, each calling
# jax.distributed.initialize()), in the background, its output in ~/arealjax.log (LOG) on each worker.
#   TPU_NAME=my-pod ZONE=us-east5-b bash tpu_scripts/launch.sh [--dry-run] -- \
#       --config=configs/math.py:model=qwen3-1.7b --workdir=/mnt/shared/runs/qwen3-1.7b \
#       --config.checkpoint.dir=gs://my-bucket/qwen3-1.7b/checkpoints
# Everything after -- goes to main.py unchanged; every worker gets the same arguments. The workdir must be on a
# filesystem every worker mounts (README "Running on a TPU pod"); checkpoints may go straight to a GCS bucket.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
main_args=()
for i in $(seq 1 $#); do
  if [[ ${!i} == -- ]]; then
    main_args=("${@:i+1}")
    set -- "${@:1:i-1}"
    break
  fi
done
parse_common "$@"
((${#ARGS[@]} == 0)) || die "unexpected arguments before --: ${ARGS[*]} (main.py's arguments go after --)"
((${#main_args[@]})) || die "no main.py arguments: pass them after --, e.g. -- --config=configs/default.py"
args=$(quote "${main_args[@]}" --config.distributed=True --config.cpu_devices=0)
on_workers "cd $REMOTE_DIR && nohup .venv/bin/python main.py $args > ~/$LOG 2>&1 < /dev/null &"
