#!/usr/bin/env bash
# Starts a generation server on every worker of a generation slice, each serving the trainer at TRAINER (its
# host's internal address and generator.servers.address's port), in the background, output in ~/arealjax-server.log.
#   TPU_NAME=my-gen-slice ZONE=us-east5-b bash tpu_scripts/serve.sh [--dry-run] --trainer=10.128.0.7:5555
# The trainer runs elsewhere (a trainer slice: launch.sh with --config.generator.backend=remote
# --config.generator.servers.address=0.0.0.0:5555) and gives each server the config and the current weights; a
# server started late or again joins with the weights of the moment. Each worker is one server on its own chips.
# stop.sh stops them too (it stops every arealjax process of the slice).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
parse_common "$@"
trainer=""
for a in "${ARGS[@]}"; do
  case $a in
    --trainer=*) trainer=${a#--trainer=} ;;
    *) die "unexpected argument: $a (expected --trainer=HOST:PORT)" ;;
  esac
done
[[ $trainer =~ ^[A-Za-z0-9_.-]+:[0-9]+$ ]] || die "--trainer=${trainer}: expected HOST:PORT, the trainer's address"
args=$(quote -m arealjax.generation.server "--trainer=$trainer")
on_workers "cd $REMOTE_DIR && nohup .venv/bin/python $args > ~/arealjax-server.log 2>&1 < /dev/null &"
