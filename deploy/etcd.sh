#!/usr/bin/env bash
# etcd for membership (node A). Run from any directory; safe to re-run.
#
#   KVCLUSTER_ETCD_PORT       client port                         (2379)
#   KVCLUSTER_ETCD_PEER_PORT  peer port                           (2380)
#   KVCLUSTER_ETCD_DATA       data directory, kept across restarts ($KVCLUSTER_STATE_DIR/etcd-data)
#   KVCLUSTER_HOST            address etcd listens on; set it to node A's address (or 0.0.0.0)
#                             when workers on other nodes register here (127.0.0.1)
# Other nodes then use KVCLUSTER_ETCD=<node A>:2379. Shared settings: deploy/common.sh.
source "$(dirname "$0")/common.sh"
need_python
PORT="${KVCLUSTER_ETCD_PORT:-2379}"
PEER_PORT="${KVCLUSTER_ETCD_PEER_PORT:-2380}"
DATA="${KVCLUSTER_ETCD_DATA:-$STATE_DIR/etcd-data}"
BIN="$("$PY" -c 'from cluster.etcd_server import etcd_binary; print(etcd_binary())')"
mkdir -p "$DATA" && chmod 700 "$DATA"   # etcd 3.5 refuses a data dir with looser permissions
# etcd reads ETCD_* variables as flags; a stray one would change or break this server.
for v in $(compgen -e | grep '^ETCD_' || true); do unset "$v"; done
start_once etcd "$BIN" --name kvcluster-etcd --data-dir "$DATA" \
  --listen-client-urls "http://$HOST:$PORT" \
  --advertise-client-urls "http://$ADVERTISE_HOST:$PORT" \
  --listen-peer-urls "http://$HOST:$PEER_PORT" \
  --initial-advertise-peer-urls "http://$ADVERTISE_HOST:$PEER_PORT" \
  --initial-cluster "kvcluster-etcd=http://$ADVERTISE_HOST:$PEER_PORT" \
  --initial-cluster-state new
echo "etcd endpoint: $ADVERTISE_HOST:$PORT (KVCLUSTER_ETCD on the other nodes)"
