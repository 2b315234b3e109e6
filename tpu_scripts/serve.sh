#!/usr/bin/env bash
# Starts a generation server on every worker of a generation slice, each serving the trainer at TRAINER (its
# host's internal address and generator.servers.address's port), in the background, output in ~/arealjax-server.log.
#   python -m arealjax.generation.server --new-keys=keys      # once per run, where the trainer runs
#   TPU_NAME=my-gen-slice ZONE=us-east5-b bash tpu_scripts/serve.sh [--dry-run] --trainer=10.128.0.7:5555 --keys=keys
# The trainer runs elsewhere (a trainer slice: launch.sh with --config.generator.backend=remote
# --config.generator.servers.address=0.0.0.0:5555 --config.generator.servers.keys_dir=keys) and gives each server
# the config and the current weights; a server started late or again joins with the weights of the moment. Each
# worker is one server on its own chips. --keys=DIR: the run's keys folder; its trainer.key and server.key_secret
# are copied to each worker (~/arealjax-keys, readable by its user alone) and the wire is CURVE (docs/servers.md,
# "Security"); without it the trainer must run with generator.servers.auth=none, and anyone who reaches the port
# may join. stop.sh stops the servers too (it stops every arealjax process of the slice).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
trainer="" keys=""
for a in "${ARGS[@]}"; do
  case $a in
    --trainer=*) trainer=${a#--trainer=} ;;
    --keys=*) keys=${a#--keys=} ;;
    *) die "unexpected argument: $a (expected --trainer=HOST:PORT [--keys=DIR])" ;;
  esac
done
[[ $trainer =~ ^[A-Za-z0-9_.-]+:[0-9]+$ ]] || die "--trainer=${trainer}: expected HOST:PORT, the trainer's address"
args=$(quote -m arealjax.generation.server "--trainer=$trainer")
if [[ -n $keys ]]; then
  for f in trainer.key server.key_secret; do
    [[ -f $keys/$f ]] || die "--keys=$keys: no $f (make the folder with: python -m arealjax.generation.server --new-keys=DIR)"
  done
  mapfile -t loc < <(location)
  on_workers "mkdir -p -m 700 ~/arealjax-keys"
  run gcloud compute tpus tpu-vm scp "$keys/trainer.key" "$keys/server.key_secret" "$TPU_NAME:arealjax-keys/" \
    "${loc[@]}" "--worker=$WORKER"
  args="$args --keys=\$HOME/arealjax-keys"
fi
on_workers "cd $REMOTE_DIR && nohup .venv/bin/python $args > ~/arealjax-server.log 2>&1 < /dev/null &"
