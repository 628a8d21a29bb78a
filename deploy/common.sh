# Sourced by the per-node scripts: defaults every script shares, overridable by environment.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${KVCLUSTER_PYTHON:-$REPO/.venv/bin/python}"
LOG_DIR="${KVCLUSTER_LOG_DIR:-$REPO/run/deploy}"       # every script logs here
HOST="${KVCLUSTER_HOST:-127.0.0.1}"                      # address this node binds
ETCD="${KVCLUSTER_ETCD:-127.0.0.1:2379}"                 # etcd client endpoint
POOL_MASTER="${KVCLUSTER_POOL_MASTER:-127.0.0.1:50051}"  # mooncake_master RPC
POOL_METADATA="${KVCLUSTER_POOL_METADATA:-http://127.0.0.1:8080/metadata}"
MODEL="${KVCLUSTER_MODEL:-}"                             # local HF model directory
mkdir -p "$LOG_DIR"
[ -x "$PY" ] || { echo "no $PY: run 'make install' in $REPO first" >&2; exit 1; }
if [ -z "$MODEL" ]; then MODEL="$("$PY" -m tinymodel | tail -n 1)"; fi

# Start "$@" in the background unless a process with the same pid file is alive (safe to re-run).
start_once() {
  local name="$1"; shift
  local pidfile="$LOG_DIR/$name.pid"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "$name already running (pid $(cat "$pidfile")), log: $LOG_DIR/$name.log"; return 0
  fi
  nohup "$@" >>"$LOG_DIR/$name.log" 2>&1 &
  echo $! >"$pidfile"
  echo "$name started (pid $!), log: $LOG_DIR/$name.log"
}
