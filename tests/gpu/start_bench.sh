#!/usr/bin/env bash
# One device call of the start-up benchmark (start_bench.py), from the repository root of the GPU
# machine, after part1a and part1b of a vLLM bundle were unpacked there (tests/gpu/README.md).
# capplan runs from .carry/src.tgz (`git archive` of the commit under test, its hash in COMMIT),
# so that every record names the code that produced it.
#   bash tests/gpu/start_bench.sh BUNDLE UNTIL_SECONDS [PAIRS] [TRIPLES]
# Resumable: starts already in /tmp/sb are kept; results and compressed logs go to $OUT.
set -euo pipefail
B=${1:?bundle folder}; UNTIL=${2:?seconds}; PAIRS=${3:-5}; TRIPLES=${4:-2}
source tests/gpu/device_env.sh
python3 tests/gpu/start_bench.py /tmp/sb "$OUT/start_bench.json" starts --pairs "$PAIRS" --triples "$TRIPLES" \
  --until "$UNTIL" || true
# few files come back from a device call: the record, the summary and one archive of the logs and reports
cp /tmp/sb/starts.jsonl "$OUT/" 2>/dev/null || true
(cd /tmp/sb && tar -czf "$OUT/logs.tgz" start*.log start*.report.json *.yaml 2>/dev/null) || true
ls -la "$OUT"
