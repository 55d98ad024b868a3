#!/usr/bin/env bash
# One device call of the start-up benchmark (start_bench.py), from the repository root of the GPU
# machine, after part1a and part1b of a vLLM bundle were unpacked there (tests/gpu/README.md).
# capplan runs from .carry/src.tgz (`git archive` of the commit under test, its hash in COMMIT),
# so that every record names the code that produced it.
#   bash tests/gpu/start_bench.sh BUNDLE WAIT_SECONDS [PAIRS] [TRIPLES] [TIERS]
# The benchmark runs in the background, so that no start is cut by a call's end: the first call
# starts it, every call (the first included) waits up to WAIT_SECONDS for it to finish, then brings
# back what has run so far (starts already in /tmp/sb are kept; a benchmark that is no longer
# running is started again and goes on where it stopped).
set -euo pipefail
B=${1:?bundle folder}; WAIT=${2:?seconds}; PAIRS=${3:-5}; TRIPLES=${4:-2}; TIERS=${5:-0}
source tests/gpu/device_env.sh
mkdir -p /tmp/sb
running() { [ -f /tmp/sb/bench.pid ] && kill -0 "$(cat /tmp/sb/bench.pid)" 2>/dev/null; }
if ! running && [ ! -f /tmp/sb/summary.json ]; then
  setsid nohup python3 tests/gpu/start_bench.py /tmp/sb /tmp/sb/summary.json starts --pairs "$PAIRS" \
    --triples "$TRIPLES" --tiers "$TIERS" --until 100000 >>/tmp/sb/bench.out 2>&1 </dev/null &
  echo $! >/tmp/sb/bench.pid
fi
end=$((SECONDS + WAIT))
while running && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
tail -n 25 /tmp/sb/bench.out || true
# few files come back from a device call: the record, the summary and one archive of the logs and reports
cp /tmp/sb/starts.jsonl /tmp/sb/bench.out "$OUT/" 2>/dev/null || true
cp /tmp/sb/summary.json "$OUT/" 2>/dev/null || true
(cd /tmp/sb && tar -czf "$OUT/logs.tgz" start*.log start*.report.json *.yaml 2>/dev/null) || true
running && echo "benchmark still running" || echo "benchmark not running"
ls -la "$OUT"
