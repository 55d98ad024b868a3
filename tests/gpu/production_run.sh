#!/usr/bin/env bash
# The production-size serve-first run (production_serve.py) in device calls of at most 10 minutes,
# from the repository root of the GPU machine, after part1a and part1b of a vLLM bundle were
# unpacked there (tests/gpu/README.md). capplan runs from .carry/src.tgz (`git archive` of the
# commit under test, its hash in COMMIT), not from the working tree, so that the result names the
# code that produced it.
#   bash tests/gpu/production_run.sh BUNDLE WAIT_SECONDS [PAIRS | KIND,KIND,...]
# (an explicit order of starts where device time is short: fault, tiers, full, or null, a full start
# that runs only the check)
# The run goes on in the background (/tmp/prod), started once; every call waits up to WAIT_SECONDS,
# then brings back what exists: bench.out, starts.jsonl.gz (every record so far), summary.json once
# written, each start's log (compressed) and report, the specs and plans.
set -euo pipefail
B=${1:?bundle folder}; WAIT=${2:?seconds}; PAIRS=${3:-3}
source tests/gpu/device_env.sh
mkdir -p /tmp/prod
running() { [ -f /tmp/prod/bench.pid ] && kill -0 "$(cat /tmp/prod/bench.pid)" 2>/dev/null; }
if ! running && [ ! -f /tmp/prod/started ]; then
  touch /tmp/prod/started
  setsid nohup python3 tests/gpu/production_serve.py /tmp/prod /tmp/prod/summary.json starts $(case $PAIRS in *[a-z]*) echo --order "$PAIRS" ;; *) echo --pairs "$PAIRS" ;; esac) \
    --until 100000 >>/tmp/prod/bench.out 2>&1 </dev/null &
  echo $! >/tmp/prod/bench.pid
fi
end=$((SECONDS + WAIT))
while running && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
tail -n 25 /tmp/prod/bench.out || true
cp /tmp/prod/bench.out /tmp/prod/summary.json /tmp/prod/*.plan.yaml /tmp/prod/*.yaml /tmp/prod/*.report.json "$OUT/" 2>/dev/null || true
[ -f /tmp/prod/starts.jsonl ] && gzip -c /tmp/prod/starts.jsonl > "$OUT/starts.jsonl.gz"
for f in /tmp/prod/start*.log; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
{ echo "command: bash tests/gpu/production_run.sh $*"; echo "capplan $CAPPLAN_COMMIT";
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader;
  grep -m1 "model name" /proc/cpuinfo; nproc; } > "$OUT/env.txt" 2>/dev/null || true
running && echo "benchmark still running" || echo "benchmark not running"
ls -la "$OUT"
