#!/usr/bin/env bash
# A prefill worker. KVCLUSTER_WORKER_PORT (0: any free port), KVCLUSTER_INSTANCE_ID (hostname-prefill),
# KVCLUSTER_KV_CACHE_BYTES (512 MiB). VLLM_CPU_OMP_THREADS_BIND etc. pass through to vLLM.
source "$(dirname "$0")/common.sh"
ID="${KVCLUSTER_INSTANCE_ID:-$(hostname)-prefill}"
start_once "$ID" "$PY" -m prefill_worker --model "$MODEL" --etcd "$ETCD" \
  --pool-master "$POOL_MASTER" --pool-metadata "$POOL_METADATA" \
  --host "$HOST" --port "${KVCLUSTER_WORKER_PORT:-0}" --instance-id "$ID" \
  --kv-cache-bytes "${KVCLUSTER_KV_CACHE_BYTES:-536870912}"
