# Sourced by the per-node scripts: defaults every script shares, overridable by environment.
#
#   KVCLUSTER_PYTHON         the venv's python                ($REPO/.venv/bin/python)
#   KVCLUSTER_LOG_DIR        every script logs here            ($REPO/run/deploy)
#   KVCLUSTER_STATE_DIR      pid files, etcd data, admin token ($REPO/run/deploy)
#   KVCLUSTER_HOST           address this node's services bind (127.0.0.1; 0.0.0.0: all)
#   KVCLUSTER_ADVERTISE_HOST address other nodes reach this node at (KVCLUSTER_HOST, or the
#                            hostname when that is 0.0.0.0)
#   KVCLUSTER_ETCD           etcd client endpoint host:port    (127.0.0.1:2379)
#   KVCLUSTER_POOL_MASTER    mooncake_master RPC host:port     (127.0.0.1:50051)
#   KVCLUSTER_POOL_METADATA  Mooncake metadata server URL      (http://127.0.0.1:8080/metadata)
#   KVCLUSTER_MODEL          local HF model directory, the same path on every node
#                            (default: the tiny model, built on first use)
#   KVCLUSTER_SECRET_FILE    the cluster secret the conductor and the workers prove to each
#                            other, the same file on every node; made (mode 600) when missing
#                            on the conductor's node or a loopback-only one, else copy it
#                            there from the conductor's node ($KVCLUSTER_STATE_DIR/cluster.secret)
#   KVCLUSTER_ETCD_ACCESS    etcd's TLS material and user (`cluster/etcd_access.py`), used when
#                            the file exists; deploy/etcd.sh writes it (with
#                            KVCLUSTER_ETCD_SECURE=1): copy its directory to every other node
#                            ($KVCLUSTER_STATE_DIR/etcd-access/access.toml)
#   KVCLUSTER_WORKER_TLS     1: the conductor's calls to the workers over mutual TLS; the
#                            conductor's node makes the certificates when missing (0)
#   KVCLUSTER_WORKER_TLS_DIR the worker plane's TLS files (`cluster/plane_tls.py`), used when
#                            the directory exists: copy it to every worker node
#                            ($KVCLUSTER_STATE_DIR/worker-tls)
#
# Every script is safe to re-run: a service whose pid file names a live process is left alone
# (exit 0); a stale pid file is removed and the service started again. deploy/stop.sh stops
# services, deploy/status.sh lists them.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${KVCLUSTER_PYTHON:-$REPO/.venv/bin/python}"
LOG_DIR="${KVCLUSTER_LOG_DIR:-$REPO/run/deploy}"
STATE_DIR="${KVCLUSTER_STATE_DIR:-$REPO/run/deploy}"
HOST="${KVCLUSTER_HOST:-127.0.0.1}"
if [ -n "${KVCLUSTER_ADVERTISE_HOST:-}" ]; then
  ADVERTISE_HOST="$KVCLUSTER_ADVERTISE_HOST"
elif [ "$HOST" = "0.0.0.0" ] || [ "$HOST" = "::" ]; then
  ADVERTISE_HOST="$(hostname)"
else
  ADVERTISE_HOST="$HOST"
fi
ETCD="${KVCLUSTER_ETCD:-127.0.0.1:2379}"
POOL_MASTER="${KVCLUSTER_POOL_MASTER:-127.0.0.1:50051}"
POOL_METADATA="${KVCLUSTER_POOL_METADATA:-http://127.0.0.1:8080/metadata}"
MODEL="${KVCLUSTER_MODEL:-}"
SECRET_FILE="${KVCLUSTER_SECRET_FILE:-$STATE_DIR/cluster.secret}"
ETCD_ACCESS="${KVCLUSTER_ETCD_ACCESS:-$STATE_DIR/etcd-access/access.toml}"
WORKER_TLS_DIR="${KVCLUSTER_WORKER_TLS_DIR:-$STATE_DIR/worker-tls}"
mkdir -p "$LOG_DIR" "$STATE_DIR"

# The cluster secret (`cluster/secret.py`), never on a command line. $1 = "make": create it
# when missing (the conductor's node); otherwise only a loopback-only node may create it.
need_secret() {
  if [ ! -s "$SECRET_FILE" ]; then
    case "${1:-}:$HOST" in
      make:*|*:127.0.0.1|*:localhost|*:::1) ;;
      *) echo "no cluster secret at $SECRET_FILE: copy it from the conductor's node" \
           "(KVCLUSTER_SECRET_FILE)" >&2; exit 1 ;;
    esac
    mkdir -p "$(dirname "$SECRET_FILE")"
    (umask 077 && "$PY" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$SECRET_FILE")
    echo "cluster secret generated in $SECRET_FILE"
  fi
  chmod 600 "$SECRET_FILE" 2>/dev/null || echo "warning: cannot chmod 600 $SECRET_FILE" >&2
}

# Export the etcd access file as the setting $1 (e.g. KVCLUSTER_WORKER_ETCD_ACCESS_FILE) when
# there is one; an explicitly named file that is missing is an error.
etcd_access() {
  if [ -f "$ETCD_ACCESS" ]; then
    export "$1=$ETCD_ACCESS"
  elif [ -n "${KVCLUSTER_ETCD_ACCESS:-}" ]; then
    echo "KVCLUSTER_ETCD_ACCESS names no file: $ETCD_ACCESS" >&2; exit 1
  fi
}

# Export the worker plane's TLS directory as the setting $1 (e.g. KVCLUSTER_WORKER_TLS_DIR)
# when there is one. $2 = "make": create it when missing and KVCLUSTER_WORKER_TLS=1 (the
# conductor's node); elsewhere KVCLUSTER_WORKER_TLS=1 without it is an error.
worker_tls() {
  if [ ! -f "$WORKER_TLS_DIR/ca.pem" ] && [ "${KVCLUSTER_WORKER_TLS:-0}" = 1 ]; then
    if [ "${2:-}" != make ]; then
      echo "no worker-plane TLS at $WORKER_TLS_DIR: copy it from the conductor's node" \
           "(KVCLUSTER_WORKER_TLS_DIR)" >&2; exit 1
    fi
    "$PY" -m cluster.certs --out "$WORKER_TLS_DIR" --host kvcluster-worker \
      --name kvcluster-worker
  fi
  if [ -f "$WORKER_TLS_DIR/ca.pem" ]; then export "$1=$WORKER_TLS_DIR"; fi
}

# Check the venv and resolve MODEL (building the tiny model when none is given).
need_python() {
  [ -x "$PY" ] || { echo "no $PY: run 'make install' in $REPO first" >&2; exit 1; }
}
need_model() {
  need_python
  if [ -z "$MODEL" ]; then MODEL="$("$PY" -m tinymodel | tail -n 1)"; fi
  [ -d "$MODEL" ] || { echo "KVCLUSTER_MODEL is not a directory: $MODEL" >&2; exit 1; }
}

# The pid in $STATE_DIR/$1.pid when that process is alive and still runs the command the pid
# file was written for (its first word, saved on the second line); else remove a stale file.
running_pid() {
  local pidfile="$STATE_DIR/$1.pid" pid cmd args
  [ -f "$pidfile" ] || return 1
  pid="$(sed -n 1p "$pidfile")"; cmd="$(sed -n 2p "$pidfile")"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    args="$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null || true)"
    if [ -z "$cmd" ] || [ -z "$args" ] || grep -qxF -- "$cmd" <<<"$args"; then
      echo "$pid"; return 0
    fi
  fi
  echo "$1: removing stale pid file $pidfile (pid ${pid:-?} is gone)" >&2
  rm -f "$pidfile"
  return 1
}

# Start "$@" in the background as service $1 unless it is already running (safe to re-run);
# fail, with the end of its log, when it exits within KVCLUSTER_START_CHECK_S (2) seconds.
start_once() {
  local name="$1"; shift
  local pidfile="$STATE_DIR/$name.pid" log="$LOG_DIR/$name.log" pid
  if pid="$(running_pid "$name")"; then
    echo "$name already running (pid $pid), log: $log"; return 0
  fi
  echo "--- $(date -u +%FT%TZ) starting: $*" >>"$log"
  nohup "$@" >>"$log" 2>&1 </dev/null &
  pid=$!
  printf '%s\n%s\n' "$pid" "$1" >"$pidfile"
  sleep "${KVCLUSTER_START_CHECK_S:-2}"
  if ! kill -0 "$pid" 2>/dev/null; then
    rm -f "$pidfile"
    echo "$name exited at start; the end of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  echo "$name started (pid $pid), log: $log"
}
