#!/usr/bin/env bash
# One device call of the probe benchmark (probe_bench.py), from the repository root of the GPU
# machine, after part1a and part1b of a vLLM bundle were unpacked there (tests/gpu/README.md).
#   bash tests/gpu/probe_bench.sh BUNDLE WAIT_SECONDS [ROUND]   (ROUND: pairs, the default, inside or heldout)
# The benchmark runs in the background (/tmp/pb), so that no job is cut by a call's end; every call
# waits up to WAIT_SECONDS, then brings back what has run so far.
set -euo pipefail
B=${1:?bundle folder}; WAIT=${2:?seconds}; ROUND=${3:-pairs}
source tests/gpu/device_env.sh
mkdir -p /tmp/pb
running() { [ -f /tmp/pb/bench.pid ] && kill -0 "$(cat /tmp/pb/bench.pid)" 2>/dev/null; }
if ! running; then
  setsid nohup python3 tests/gpu/probe_bench.py /tmp/pb /tmp/pb/out.json run --round "$ROUND" >>/tmp/pb/bench.out 2>&1 </dev/null &
  echo $! >/tmp/pb/bench.pid
fi
end=$((SECONDS + WAIT))
while running && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
tail -n 30 /tmp/pb/bench.out || true
cp /tmp/pb/jobs.jsonl /tmp/pb/bench.out "$OUT/" 2>/dev/null || true
(cd /tmp/pb && tar -czf "$OUT/files.tgz" *.calibration.yaml *.report.json *.log plan*.yaml 2>/dev/null) || true
running && echo "benchmark still running" || echo "benchmark not running"
ls -la "$OUT"
