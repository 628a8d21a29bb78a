#!/bin/sh
# usage: run.sh REPS "ARM ARM ..." -- alternate the arms REPS times, each run 10 lone cold
# prompts (cold.py); print each run's medians. Run dirs, step logs and output under $OUT.
OUT=${OUT:-/tmp/lone-cold}
cd "$(dirname "$0")/../../../.." && mkdir -p "$OUT" || exit 1
for r in $(seq 1 "$1"); do for A in $2; do
  T=${A}_$r; rm -rf "$OUT/rd_$T" "$OUT/steps_$T"; mkdir -p "$OUT/steps_$T"
  KVCLUSTER_STEP_LOG="$OUT/steps_$T" timeout 900 .venv/bin/python \
    docs/e2e/ab/2026-11-28-lone-cold/cold.py "$A" "$OUT/rd_$T" 10 > "$OUT/$T.log" 2>&1
  .venv/bin/python - "$OUT" "$T" <<'PY'
import statistics, sys
from worker.step_log import read
out, T = sys.argv[1], sys.argv[2]
steps = read(f"{out}/steps_{T}")
big = [s.ms for s in steps if s.tokens == 2048]
tail = [s.ms for s in steps if s.tokens == 202]
ttft = [float(x.split()[2]) for x in open(f"{out}/{T}.log") if x.startswith("cold ")]
print(T, "2048-step med %.0f [%.0f-%.0f] n=%d" % (statistics.median(big), min(big), max(big), len(big)),
      "| 202-step med %.0f" % statistics.median(tail),
      "| ttft med %.0f [%.0f-%.0f]" % (statistics.median(ttft), min(ttft), max(ttft)), flush=True)
PY
done; done
