#!/usr/bin/env bash
# mooncake_master with its HTTP metadata server (node A). Run from any directory; safe to re-run.
#
#   KVCLUSTER_STORE_RPC_PORT       master RPC port                        (50051)
#   KVCLUSTER_STORE_METADATA_PORT  HTTP metadata server port              (8080)
#   KVCLUSTER_STORE_METRICS_PORT   metrics/health port                    (any free port)
#   KVCLUSTER_HOST                 address the RPC server binds; node A's address (or 0.0.0.0)
#                                  for a multi-node pool (127.0.0.1). The metadata server
#                                  binds 0.0.0.0 whatever it is told (mooncake_master 0.3.13).
# Other nodes then use KVCLUSTER_POOL_MASTER=<node A>:50051 and
# KVCLUSTER_POOL_METADATA=http://<node A>:8080/metadata. Shared settings: deploy/common.sh.
source "$(dirname "$0")/common.sh"
need_python
RPC_PORT="${KVCLUSTER_STORE_RPC_PORT:-50051}"
METADATA_PORT="${KVCLUSTER_STORE_METADATA_PORT:-8080}"
start_once store_master "$PY" -m store.master --host "$HOST" \
  --rpc-port "$RPC_PORT" --http-port "$METADATA_PORT" \
  ${KVCLUSTER_STORE_METRICS_PORT:+--metrics-port "$KVCLUSTER_STORE_METRICS_PORT"} \
  --log "$LOG_DIR/mooncake_master.log"
echo "pool: KVCLUSTER_POOL_MASTER=$ADVERTISE_HOST:$RPC_PORT" \
  "KVCLUSTER_POOL_METADATA=http://$ADVERTISE_HOST:$METADATA_PORT/metadata"
