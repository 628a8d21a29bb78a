#!/usr/bin/env bash
# mooncake_master with its HTTP metadata server. KVCLUSTER_STORE_RPC_PORT (50051),
# KVCLUSTER_STORE_METADATA_PORT (8080).
source "$(dirname "$0")/common.sh"
start_once store_master "$PY" -m store.master --host "$HOST" \
  --rpc-port "${KVCLUSTER_STORE_RPC_PORT:-50051}" \
  --http-port "${KVCLUSTER_STORE_METADATA_PORT:-8080}"
