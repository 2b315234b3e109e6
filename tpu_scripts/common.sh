# Shared by the tpu_scripts: settings from the environment, common flags, and `run`, which prints each gcloud
# command (shell-quoted, one per line) under --dry-run instead of running it. Sourced, not run.
# shellcheck shell=bash
set -euo pipefail

DRY_RUN=0
WORKER=all
ARGS=()  # what the script's own parsing gets: everything but the common flags

# The settings every script needs; PROJECT is optional (gcloud's default project otherwise).
: "${TPU_NAME:=}" "${ZONE:=}" "${PROJECT:=}"
QUEUED_RESOURCE=${QUEUED_RESOURCE:-${TPU_NAME}-qr}
REMOTE_DIR=${REMOTE_DIR:-arealjax}  # on each worker, relative to the home directory
LOG=${LOG:-arealjax.log}            # main.py's output on each worker, in the home directory

die() {
  echo "error: $*" >&2
  exit 2
}

# parse_common "$@": takes --dry-run, --worker=N|all and --help; the rest goes to ARGS.
parse_common() {
  while (($#)); do
    case $1 in
      --dry-run) DRY_RUN=1 ;;
      --worker=*) WORKER=${1#--worker=} ;;
      -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
  [[ -n $TPU_NAME ]] || die "set TPU_NAME (the TPU VM / pod slice name)"
  [[ -n $ZONE ]] || die "set ZONE (e.g. us-east5-b)"
  [[ $WORKER == all || $WORKER =~ ^[0-9]+$ ]] || die "--worker=$WORKER: expected all or a worker number"
}

# location: the --zone / --project flags every gcloud call takes.
location() {
  printf '%s\n' "--zone=$ZONE"
  [[ -z $PROJECT ]] || printf '%s\n' "--project=$PROJECT"
}

# quote ARG...: the arguments as one line a shell reads back as the same words (single quotes where needed).
quote() {
  local a sq="'" esc="'\\''" out=()
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
      out+=("$a")
    else
      out+=("'${a//$sq/$esc}'")
    fi
  done
  echo "${out[*]}"
}

# run CMD...: runs it, or prints it (quoted) under --dry-run.
run() {
  if ((DRY_RUN)); then
    quote "$@"
  else
    "$@"
  fi
}

# on_workers COMMAND: runs a shell command on the chosen workers (--worker) over gcloud ssh.
on_workers() {
  local loc
  mapfile -t loc < <(location)
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${loc[@]}" "--worker=$WORKER" "--command=$1"
}
