"""`make chaos`: kill parts of a running cluster under traffic and classify every answer.

An embedded cluster (2 prefill + 2 decode workers, real vLLM engines, a real Mooncake master
and etcd) serves a fixed, deterministic set of greedy completions (token-id prompts, some
sharing long prefixes, half streamed) while a fault schedule runs, one fault at a time:

  decode   kill -9 a decode worker with streams in flight on it, start a new one
  prefill  kill -9 a prefill worker (one with prefills queued, when there is one), start one
  store    kill -9 the Mooncake master, restart it on the same ports a few seconds later
  etcd     stop etcd, start it again after 2x the lease TTL
  stall_decode  SIGSTOP a decode worker with streams on it for 15 s (past the inter-token
           deadline: its streams move on), then SIGCONT
  stall_engine  SIGSTOP a decode worker's engine core alone (its front end answers) until
           the conductor shows it stalled by the worker's watchdog, then SIGCONT
  stall_store   SIGSTOP the Mooncake master for 8 s (past the pool's timeout), then SIGCONT

Then a tenant flood (`benchmarks.chaos.tenants`): one tenant far over its limit beside
another's paced interactive requests, against that tenant's run alone.

Two requests in every five share their client request id (`request_id`): each must still get
its own, right answer.

Every answer is compared with a single-engine greedy reference (tests/reference_engine.py,
computed before the cluster starts and cached in the run dir) and classified as ok,
clean_error, wrong, hung or lost (docs/reliability.md). The last line printed is

  chaos total=<n> ok=<n> clean_errors=<n> hung=<n> lost=<n> wrong=<n> migrated=<n>
  fallbacks=<n> stalled=<n> tenant_isolation=<ratio> stalled_before_first=<n>

(one line; `stalled`: calls the conductor moved on from because their worker went silent,
at their inter-token deadline or when its health checks went unanswered: `decode_stalled`
and `instance_lost_calls_cancelled` in its log; `tenant_isolation`: the interactive tenant's
goodput beside the flood over its goodput alone; `stalled_before_first`: requests retried off
the stopped engine core's instance, that is moved before their first token.)
"""
