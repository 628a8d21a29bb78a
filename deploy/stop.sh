#!/usr/bin/env bash
# Stop services started by the deploy scripts on this node: deploy/stop.sh [NAME ...]
# NAME is a pid file's name in $KVCLUSTER_STATE_DIR (etcd, store_master, conductor, or a
# worker's instance id); none: all of them, workers first, etcd last. SIGTERM (workers drain
# and deregister), then SIGKILL after KVCLUSTER_STOP_TIMEOUT_S (30) seconds. Safe to re-run.
source "$(dirname "$0")/common.sh"
TIMEOUT="${KVCLUSTER_STOP_TIMEOUT_S:-30}"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  last=(conductor store_master etcd)
  for f in "$STATE_DIR"/*.pid; do
    [ -e "$f" ] || continue
    n="$(basename "$f" .pid)"
    case " ${last[*]} " in *" $n "*) ;; *) names+=("$n") ;; esac
  done
  for n in "${last[@]}"; do [ -e "$STATE_DIR/$n.pid" ] && names+=("$n"); done
fi
[ ${#names[@]} -gt 0 ] || { echo "nothing to stop (no pid files in $STATE_DIR)"; exit 0; }
for n in "${names[@]}"; do
  if ! pid="$(running_pid "$n")"; then echo "$n not running"; continue; fi
  kill -TERM "$pid"
  for _ in $(seq "$((TIMEOUT * 10))"); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "$n (pid $pid) still running after ${TIMEOUT}s: SIGKILL"; kill -KILL "$pid" || true
  fi
  rm -f "$STATE_DIR/$n.pid"
  echo "$n stopped (pid $pid)"
done
