#!/usr/bin/env bash
# Runs main.py on every worker of a TPU pod at once (multi-controller JAX: one process per host).
#   TPU_NAME=my-pod ZONE=us-east5-b bash tpu_scripts/run.sh --config=configs/default.py \
#       --workdir=/tmp/arealjax --config.model_path=/mnt/ckpt/Qwen3-1.7B
# Every process must see the same config; --config.distributed=True makes each call jax.distributed.initialize().
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
PROJECT_FLAG=${PROJECT:+--project=$PROJECT}
ARGS=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" $PROJECT_FLAG --worker=all --command="
  cd arealjax && python3 main.py $ARGS --config.distributed=True --config.cpu_devices=0 2>&1 | tee -a ~/arealjax.log
"
