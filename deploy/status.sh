#!/usr/bin/env bash
# The services the deploy scripts started on this node, from the pid files in
# $KVCLUSTER_STATE_DIR: name, pid and running/stale, with each log's path. Exit 1 if any is
# down (its pid file is then removed, as the start scripts would).
source "$(dirname "$0")/common.sh"
rc=0 found=0
for f in "$STATE_DIR"/*.pid; do
  [ -e "$f" ] || continue
  found=1
  n="$(basename "$f" .pid)"
  if pid="$(running_pid "$n" 2>/dev/null)"; then
    printf '%-24s running  pid %-8s %s\n' "$n" "$pid" "$LOG_DIR/$n.log"
  else
    printf '%-24s DOWN     %-12s %s\n' "$n" "" "$LOG_DIR/$n.log"; rc=1
  fi
done
[ "$found" = 1 ] || echo "no services (no pid files in $STATE_DIR)"
exit "$rc"
