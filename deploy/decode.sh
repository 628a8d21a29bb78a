#!/usr/bin/env bash
# A decode worker (one vLLM engine). Run from any directory; safe to re-run (one per instance id).
#
#   KVCLUSTER_INSTANCE_ID     instance id, unique in the cluster; also names the pid and log
#                             files, so set it to run several on one node   ($(hostname)-decode)
#   KVCLUSTER_WORKER_PORT     gRPC port (0: any free port)                  (0)
#   KVCLUSTER_KV_CACHE_BYTES  the engine's KV cache                         (536870912, 512 MiB)
#   KVCLUSTER_HOST            address the worker binds; a reachable one (or 0.0.0.0) when the
#                             conductor runs on another node                (127.0.0.1)
#   KVCLUSTER_ADVERTISE_HOST  address registered for the conductor to dial  (see common.sh)
#                             The engine's Mooncake transfer engine (0.3.13) listens on all of
#                             the node's addresses whatever this says (its handshake and TCP
#                             data ports, logged as "listening on" / "listen on port"): keep
#                             the pool's network private (docs/reliability.md).
#   KVCLUSTER_ETCD, KVCLUSTER_POOL_MASTER, KVCLUSTER_POOL_METADATA: node A's services
#   KVCLUSTER_MODEL           model directory, the same on every node
#   KVCLUSTER_SECRET_FILE     the cluster secret, a copy of the conductor node's (common.sh)
#   KVCLUSTER_WORKER_TLS_DIR  the worker plane's TLS files, a copy of the conductor node's:
#                             the worker then serves mutual TLS only (common.sh)
# Other worker settings pass through as KVCLUSTER_WORKER_<FIELD> (see
# `python -m decode_worker --help`), e.g. KVCLUSTER_WORKER_DEVICE=cuda. VLLM_* pass to vLLM
# (VLLM_CPU_OMP_THREADS_BIND defaults to nobind, as in `make run`).
# Shared settings: deploy/common.sh.
source "$(dirname "$0")/common.sh"
need_model
need_secret
export KVCLUSTER_WORKER_SECRET_FILE="$SECRET_FILE"
etcd_access KVCLUSTER_WORKER_ETCD_ACCESS_FILE
worker_tls KVCLUSTER_WORKER_TLS_DIR
ID="${KVCLUSTER_INSTANCE_ID:-$(hostname)-decode}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
start_once "$ID" "$PY" -m decode_worker --model "$MODEL" --etcd "$ETCD" \
  --pool-master "$POOL_MASTER" --pool-metadata "$POOL_METADATA" \
  --host "$HOST" --advertise-host "$ADVERTISE_HOST" --port "${KVCLUSTER_WORKER_PORT:-0}" \
  --instance-id "$ID" --kv-cache-bytes "${KVCLUSTER_KV_CACHE_BYTES:-536870912}"
