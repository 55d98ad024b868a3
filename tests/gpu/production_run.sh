#!/usr/bin/env bash
# One device call of the production-size serve-first run (production_serve.py), from the repository
# root of the GPU machine, after part1 (or part1a and part1b) of a vLLM bundle was unpacked there
# (../shared/tools/vllm-gpu/README.md). capplan runs from .carry/src.tgz (`git archive` of the
# commit under test, its hash in COMMIT), not from the working tree, so that the result names the
# code that produced it.
#   bash tests/gpu/production_run.sh BUNDLE UNTIL_SECONDS [PAIRS]
# Resumable: starts already in /tmp/prod are kept; results and compressed logs go to $OUT.
set -euo pipefail
B=${1:?bundle folder}; UNTIL=${2:?seconds}; PAIRS=${3:-5}
source tests/gpu/device_env.sh
python3 tests/gpu/production_serve.py /tmp/prod "$OUT/production_8b.json" starts --pairs "$PAIRS" --until "$UNTIL" || true
cp /tmp/prod/starts.jsonl /tmp/prod/*.plan.yaml /tmp/prod/*.yaml "$OUT/" 2>/dev/null || true
for f in /tmp/prod/start*.log; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
ls -la "$OUT"
