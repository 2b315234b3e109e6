#!/usr/bin/env bash
# Profiles a TPU VM end to end in one command: creates it (create.sh), installs this checkout (install.sh), runs
# `benchmarks/accelerator.py --profile` on worker 0, copies its results back, then deletes the VM whatever happened.
#   TPU_NAME=my-tpu ZONE=us-east5-b PROJECT=my-proj ACCELERATOR_TYPE=v5litepod-8 \
#       RUNTIME_VERSION=v2-alpha-tpuv5-lite bash tpu_scripts/profile.sh [--spot | --reserved] [--dry-run] [-- ARGS]
# A single-host slice: the profile runs on worker 0 alone. ARGS go to accelerator.py as they are, after the stages
# (PROFILE_STAGES, default every stage that applies on a TPU: environment,decode,train,trace,decode_full,long_tail,
# train_attention; a --stages= among ARGS wins). The results land in benchmarks/results/profile-tpu-$TPU_NAME/ (LOCAL_OUT; added to what is
# there). The VM is deleted (delete.sh) after the last step, after a failed one, and on Ctrl-C (on a SIGTERM to this
# script alone, once the step running ends); then the exit status is non-zero and the failed step is named. A failed
# profile (a stage that failed: exit 1) still copies back what it wrote.
set -euo pipefail
here=$(dirname "$0")
# shellcheck source=common.sh
source "$here/common.sh"
extra=()  # after --: accelerator.py's
for i in $(seq 1 $#); do
  if [[ ${!i} == -- ]]; then
    extra=("${@:i+1}")
    set -- "${@:1:i-1}"
    break
  fi
done
parse_common "$@"
# create.sh checks these too, but a failure of a step means a delete: refused here, before any command
: "${ACCELERATOR_TYPE:?set ACCELERATOR_TYPE (e.g. v5litepod-8, v4-8, v6e-8)}"
: "${RUNTIME_VERSION:?set RUNTIME_VERSION (e.g. v2-alpha-tpuv5-lite, tpu-ubuntu2204-base)}"
[[ $WORKER == all ]] || die "--worker=$WORKER: profile.sh installs on every worker and profiles on worker 0"
tier=()
for a in "${ARGS[@]}"; do
  case $a in
    --spot | --reserved) tier+=("$a") ;;
    *) die "unknown argument $a (expected --spot, --reserved, --dry-run; accelerator.py's go after --)" ;;
  esac
done
stages=${PROFILE_STAGES:-environment,decode,train,trace,decode_full,long_tail,train_attention}
local_out=${LOCAL_OUT:-$(cd "$here/.." && pwd)/benchmarks/results/profile-tpu-$TPU_NAME}
remote_out=profile-tpu  # under REMOTE_DIR on worker 0
dry=()
if ((DRY_RUN)); then dry=(--dry-run); fi
mapfile -t loc < <(location)

failed="" status=0 current=""  # the first step that failed, its exit status; the step running
# step NAME CMD...: runs CMD unless a step failed before it (but copy runs after a failed profile: what it wrote
# holds the errors); the first failure is the one reported.
step() {
  [[ -z $failed || $1/$failed == copy/profile ]] || return 0
  current=$1
  echo "== $1" >&2
  "${@:2}" || { local rc=$? && [[ -n $failed ]] || status=$rc failed=$1; }
}

# finish: deletes the VM on every way out (a queued resource still waiting would be provisioned later), then names
# the failed step.
finish() {
  local rc=$?
  trap - EXIT
  trap : INT TERM  # Ctrl-C now interrupts the delete alone, which then says so below
  [[ -n $failed ]] || ((rc == 0)) || status=$rc failed=profile.sh  # an error of this script's own
  echo "== delete" >&2
  local deleted="the VM was deleted"
  rc=0 && bash "$here/delete.sh" "${dry[@]}" || rc=$?
  if ((rc)); then
    deleted="the VM was NOT deleted"
    echo "error: DELETING $TPU_NAME FAILED: it may still exist (and cost money); delete it by hand with" >&2
    bash "$here/delete.sh" --dry-run >&2
    [[ $failed != create ]] || echo "(unless step 'create' failed before its queued resource existed)" >&2
    [[ -n $failed ]] || status=$rc failed=delete
  fi
  if [[ -n $failed ]]; then
    echo "error: step '$failed' failed (exit $status); $deleted" >&2
  else
    echo "profile: $local_out" >&2
  fi
  exit "$status"
}
trap finish EXIT
trap '[[ -n $failed ]] || status=130 failed=$current; exit' INT  # Ctrl-C
trap '[[ -n $failed ]] || status=143 failed=$current; exit' TERM  # once the step running ends

copy() {
  run mkdir -p "$local_out" &&
    run gcloud compute tpus tpu-vm scp --recurse "$TPU_NAME:$REMOTE_DIR/$remote_out/*" "$local_out/" "${loc[@]}" \
      --worker=0
}

step create bash "$here/create.sh" "${tier[@]}" "${dry[@]}"
step install bash "$here/install.sh" "${dry[@]}"
WORKER=0
args=$(quote "--out=$remote_out" "--stages=$stages" "${extra[@]}")
step profile on_workers "cd $REMOTE_DIR && .venv/bin/python benchmarks/accelerator.py --profile $args"
step copy copy
