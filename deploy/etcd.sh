#!/usr/bin/env bash
# etcd for membership. KVCLUSTER_ETCD_PORT (2379), KVCLUSTER_ETCD_DATA ($LOG_DIR/etcd-data).
source "$(dirname "$0")/common.sh"
PORT="${KVCLUSTER_ETCD_PORT:-2379}"
start_once etcd "$PY" -m cluster.etcd_server --port "$PORT" \
  --data-dir "${KVCLUSTER_ETCD_DATA:-$LOG_DIR/etcd-data}"
