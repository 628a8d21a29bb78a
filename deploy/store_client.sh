#!/usr/bin/env bash
# Optional, one per node: a standalone mooncake_client owning this node's share of the pool, so
# the node's workers exchange KV by memcpy in its shared memory instead of over TCP (see
# README, --pool shm). Run from any directory; safe to re-run.
#
#   KVCLUSTER_STORE_CLIENT_PORT     its control port, what workers dial          (50052)
#   KVCLUSTER_STORE_CLIENT_TE_PORT  its transfer-engine port; with the advertised host it
#                                   names its segment, where the workers' saves go (50053)
#   KVCLUSTER_STORE_CLIENT_SEGMENT  the memory it contributes to the pool          (4GB)
#   KVCLUSTER_POOL_MASTER, KVCLUSTER_POOL_METADATA: node A's services
# Then start this node's workers with
#   KVCLUSTER_WORKER_POOL_STORE_CLIENT=127.0.0.1:$KVCLUSTER_STORE_CLIENT_PORT
#   KVCLUSTER_WORKER_POOL_STORE_CLIENT_SEGMENT=$KVCLUSTER_ADVERTISE_HOST:$KVCLUSTER_STORE_CLIENT_TE_PORT
# (printed below). Shared settings: deploy/common.sh.
source "$(dirname "$0")/common.sh"
need_python
PORT="${KVCLUSTER_STORE_CLIENT_PORT:-50052}"
TE_PORT="${KVCLUSTER_STORE_CLIENT_TE_PORT:-50053}"
BIN="$("$PY" -c 'import mooncake, os; print(os.path.join(os.path.dirname(mooncake.__file__), "mooncake_client"))')"
start_once store_client "$BIN" --host="$ADVERTISE_HOST:$TE_PORT" --port="$PORT" \
  --global_segment_size="${KVCLUSTER_STORE_CLIENT_SEGMENT:-4GB}" --protocol=tcp \
  --master_server_address="$POOL_MASTER" --metadata_server="$POOL_METADATA" --logtostderr=true
echo "workers on this node: KVCLUSTER_WORKER_POOL_STORE_CLIENT=127.0.0.1:$PORT" \
  "KVCLUSTER_WORKER_POOL_STORE_CLIENT_SEGMENT=$ADVERTISE_HOST:$TE_PORT"
