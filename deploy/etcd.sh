#!/usr/bin/env bash
# etcd for membership (node A). Run from any directory; safe to re-run.
#
#   KVCLUSTER_ETCD_PORT       client port                         (2379)
#   KVCLUSTER_ETCD_PEER_PORT  peer port                           (2380)
#   KVCLUSTER_ETCD_DATA       data directory, kept across restarts ($KVCLUSTER_STATE_DIR/etcd-data)
#   KVCLUSTER_HOST            address etcd listens on; set it to node A's address (or 0.0.0.0)
#                             when workers on other nodes register here (127.0.0.1)
#   KVCLUSTER_ETCD_SECURE     1: TLS with client certificates and etcd auth (0). The first
#                             start makes a CA and certificates for KVCLUSTER_ADVERTISE_HOST
#                             ($KVCLUSTER_STATE_DIR/etcd-tls; bring your own files there
#                             instead), turns auth on and writes the access directory
#                             (KVCLUSTER_ETCD_ACCESS's): copy that directory to every node.
#                             The root password is in $KVCLUSTER_STATE_DIR/etcd-root.pw.
# Other nodes then use KVCLUSTER_ETCD=<node A>:2379. Shared settings: deploy/common.sh.
# History is compacted hourly: the conductors rewrite their fitted models every
# KVCLUSTER_CONDUCTOR_CONTROL_MODELS_S (30 s), which would otherwise fill etcd's quota.
source "$(dirname "$0")/common.sh"
need_python
PORT="${KVCLUSTER_ETCD_PORT:-2379}"
PEER_PORT="${KVCLUSTER_ETCD_PEER_PORT:-2380}"
DATA="${KVCLUSTER_ETCD_DATA:-$STATE_DIR/etcd-data}"
SECURE="${KVCLUSTER_ETCD_SECURE:-0}"
BIN="$("$PY" -c 'from cluster.etcd_server import etcd_binary; print(etcd_binary())')"
mkdir -p "$DATA" && chmod 700 "$DATA"   # etcd 3.5 refuses a data dir with looser permissions
# etcd reads ETCD_* variables as flags; a stray one would change or break this server.
for v in $(compgen -e | grep '^ETCD_' || true); do unset "$v"; done

SCHEME=http
PEER_SCHEME=http
TLS_ARGS=()
if [ "$SECURE" = 1 ]; then
  TLS="$STATE_DIR/etcd-tls"
  HOSTS=(--host "$ADVERTISE_HOST")
  [ "$ADVERTISE_HOST" = 127.0.0.1 ] || HOSTS+=(--host 127.0.0.1)
  "$PY" -m cluster.certs --out "$TLS" "${HOSTS[@]}"
  SCHEME=https
  PEER_SCHEME=https
  TLS_ARGS=(--cert-file "$TLS/server.pem" --key-file "$TLS/server-key.pem"
            --trusted-ca-file "$TLS/ca.pem" --client-cert-auth
            --peer-cert-file "$TLS/server.pem" --peer-key-file "$TLS/server-key.pem"
            --peer-trusted-ca-file "$TLS/ca.pem" --peer-client-cert-auth)
fi
start_once etcd "$BIN" --name kvcluster-etcd --data-dir "$DATA" \
  --listen-client-urls "$SCHEME://$HOST:$PORT" \
  --advertise-client-urls "$SCHEME://$ADVERTISE_HOST:$PORT" \
  --listen-peer-urls "$PEER_SCHEME://$HOST:$PEER_PORT" \
  --initial-advertise-peer-urls "$PEER_SCHEME://$ADVERTISE_HOST:$PEER_PORT" \
  --initial-cluster "kvcluster-etcd=$PEER_SCHEME://$ADVERTISE_HOST:$PEER_PORT" \
  --initial-cluster-state new "${TLS_ARGS[@]}" \
  --auto-compaction-mode periodic --auto-compaction-retention 1h
if [ "$SECURE" = 1 ] && [ ! -f "$ETCD_ACCESS" ]; then
  "$PY" -m cluster.etcd_auth --endpoint "$ADVERTISE_HOST:$PORT" --tls-dir "$TLS" \
    --out "$(dirname "$ETCD_ACCESS")"
fi
echo "etcd endpoint: $ADVERTISE_HOST:$PORT (KVCLUSTER_ETCD on the other nodes)"
