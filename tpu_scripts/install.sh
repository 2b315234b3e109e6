#!/usr/bin/env bash
# Copies this checkout (its committed HEAD, as `git archive` packs it) to every worker, then installs it there in
# a virtual environment with jax[tpu], and prints each worker's process index and device counts.
#   TPU_NAME=my-pod ZONE=us-east5-b bash tpu_scripts/install.sh [--dry-run]
# REMOTE_DIR (default arealjax, under the home directory) is where it goes on the workers.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
((${#ARGS[@]} == 0)) || die "unexpected arguments: ${ARGS[*]}"
repo=$(cd "$(dirname "$0")/.." && pwd)
tarball=${TMPDIR:-/tmp}/arealjax-$TPU_NAME.tar.gz
mapfile -t loc < <(location)
run git -C "$repo" archive --format=tar.gz -o "$tarball" HEAD
run gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:arealjax.tar.gz" "${loc[@]}" "--worker=$WORKER"
on_workers "set -e; mkdir -p $REMOTE_DIR && tar -xzf arealjax.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR \
&& python3 -m venv .venv && .venv/bin/pip install -q -U pip \
&& .venv/bin/pip install -q -r requirements.txt 'jax[tpu]' \
&& .venv/bin/python -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.device_count())'"
