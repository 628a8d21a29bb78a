#!/usr/bin/env bash
# The conductor's HTTP endpoint. KVCLUSTER_PORT (8000).
source "$(dirname "$0")/common.sh"
start_once conductor "$PY" -m conductor --model "$MODEL" --etcd "$ETCD" \
  --host "$HOST" --port "${KVCLUSTER_PORT:-8000}"
