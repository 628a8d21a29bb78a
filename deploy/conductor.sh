#!/usr/bin/env bash
# The conductor (node A): the OpenAI-compatible HTTP endpoint and the gRPC admin API that
# `conductorctl` talks to. Run from any directory; safe to re-run.
#
#   KVCLUSTER_PORT             HTTP port, bound on KVCLUSTER_HOST                    (8000)
#   KVCLUSTER_ADMIN_HOST       admin API address; keep loopback unless operators
#                              connect from other hosts                              (127.0.0.1)
#   KVCLUSTER_ADMIN_PORT       admin API port (0: admin API off)                     (8001)
#   KVCLUSTER_ADMIN_TOKEN_FILE the admin token; generated (mode 600) when missing
#                              ($KVCLUSTER_STATE_DIR/admin.token)
#   KVCLUSTER_ETCD             etcd endpoint the workers register in (127.0.0.1:2379)
#   KVCLUSTER_MODEL            the tokenizer's model directory, as on the workers
#   KVCLUSTER_SECRET_FILE      the cluster secret, made when missing; copy it to every
#                              worker node                    ($KVCLUSTER_STATE_DIR/cluster.secret)
#   KVCLUSTER_WORKER_TLS       1: call the workers over mutual TLS; makes the plane's CA and
#                              certificates when missing: copy that directory to every
#                              worker node                   ($KVCLUSTER_STATE_DIR/worker-tls)
#   KVCLUSTER_REPLICA          another conductor of a cluster that has one (any number serve
#                              one etcd): its service is conductor-$KVCLUSTER_REPLICA (pid file,
#                              log), and it never makes the secret or the TLS files: copy
#                              them from the first conductor's node                    (unset)
# Any other conductor setting passes through as KVCLUSTER_CONDUCTOR_<FIELD> (see
# `python -m conductor --help`), e.g. KVCLUSTER_CONDUCTOR_POLICY, KVCLUSTER_CONDUCTOR_API_KEY.
# Shared settings: deploy/common.sh.
source "$(dirname "$0")/common.sh"
need_model
PORT="${KVCLUSTER_PORT:-8000}"
NAME="conductor${KVCLUSTER_REPLICA:+-$KVCLUSTER_REPLICA}"
MAKE="$([ -z "${KVCLUSTER_REPLICA:-}" ] && echo make || true)"
ADMIN_HOST="${KVCLUSTER_ADMIN_HOST:-127.0.0.1}"
ADMIN_PORT="${KVCLUSTER_ADMIN_PORT:-8001}"
TOKEN_FILE="${KVCLUSTER_ADMIN_TOKEN_FILE:-$STATE_DIR/admin.token}"

# The admin token: always configured, never on a command line (it would show in `ps`).
if [ ! -s "$TOKEN_FILE" ]; then
  mkdir -p "$(dirname "$TOKEN_FILE")"
  (umask 077 && "$PY" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$TOKEN_FILE")
  echo "admin token generated in $TOKEN_FILE"
fi
chmod 600 "$TOKEN_FILE" 2>/dev/null || echo "warning: cannot chmod 600 $TOKEN_FILE" >&2
export KVCLUSTER_CONDUCTOR_ADMIN_TOKEN_FILE="$TOKEN_FILE"
need_secret "$MAKE"
export KVCLUSTER_CONDUCTOR_SECRET_FILE="$SECRET_FILE"
etcd_access KVCLUSTER_CONDUCTOR_ETCD_ACCESS_FILE
worker_tls KVCLUSTER_CONDUCTOR_TLS_DIR "$MAKE"
export KVCLUSTER_CONDUCTOR_ADMIN_HOST="$ADMIN_HOST"
export KVCLUSTER_CONDUCTOR_ADMIN_PORT="$ADMIN_PORT"

start_once "$NAME" "$PY" -m conductor --model "$MODEL" --etcd "$ETCD" \
  --host "$HOST" --port "$PORT"
echo "endpoint: http://$ADVERTISE_HOST:$PORT/v1"
if [ "$ADMIN_PORT" != 0 ]; then
  echo "admin: KVCLUSTER_ADMIN_ADDR=$ADMIN_HOST:$ADMIN_PORT" \
    "KVCLUSTER_ADMIN_TOKEN_FILE=$TOKEN_FILE $REPO/.venv/bin/conductorctl instances"
fi
