#!/usr/bin/env bash
# Installs arealjax on every worker of a Cloud TPU VM slice (v4/v5e/v5p/v6e pods).
#   TPU_NAME=my-pod ZONE=us-east5-b PROJECT=my-proj REPO=https://github.com/<you>/arealjax bash tpu_scripts/setup.sh
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${REPO:?set REPO (git URL of this repository)}"
PROJECT_FLAG=${PROJECT:+--project=$PROJECT}
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" $PROJECT_FLAG --worker=all --command="
  set -e
  [ -d arealjax ] || git clone $REPO arealjax
  cd arealjax && git pull --ff-only
  python3 -m pip install -q -U pip
  python3 -m pip install -q -r requirements.txt 'jax[tpu]' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
  python3 -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())'
"
