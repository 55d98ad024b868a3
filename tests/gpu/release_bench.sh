#!/usr/bin/env bash
# release_run.py (the plan in force under `vllm serve`, every server alone, one after another) on one
# vLLM release, in device calls of at most 10 minutes, from the repository root of the GPU machine.
#   bash tests/gpu/release_bench.sh stage BUNDLE          # keep the bundle's pieces carried in this call
#   bash tests/gpu/release_bench.sh BUNDLE WAIT_SECONDS [--together]   # run (first call) or go on waiting
# --together (releases before 0.29.0, whose memory profiling captures no graphs) passes release_run.py's
# --together: every server at once with a fixed KV cache, about 150 s a release instead of about 470 s.
# `stage` copies whichever of BUNDLE/part1 (or part1a, part1b) and BUNDLE/part2/whl this call carried to
# /tmp/vstage-NAME (NAME: the bundle folder's name); it touches nothing else, so it can ride on a call
# that waits for another release's run (the pieces of one bundle with the checkout exceed one call's
# 64 MiB). A run call with part2 carried (its wheels may be staged instead; .carry/src.tgz on a fresh
# machine):
# - where /tmp/vsite holds no bundle or another one (/tmp/vsite/.bundle) and no run is going on, it
#   empties /tmp/vsite and unpacks the staged part1 there (what device_setup.sh part1a + part1b do),
#   so that two releases' files are never mixed; device_env.sh then unpacks part2 and installs capplan
#   from .carry/src.tgz (`git archive` of the commit under test, its hash in COMMIT);
# - it starts `release_run.py /tmp/rr-RELEASE /tmp/rr-RELEASE/release_run.json` in the background
#   (setsid nohup), once: a run that is going on or has ended is never started again;
# - every call waits up to WAIT_SECONDS (counted from the call's start) for the run to end, then
#   brings back what exists: release_run.json (once written), bench.out, env.txt (the command, the
#   commit, GPU and host CPU) and files.tgz (every server's log, report and trace, the specs and plans).
# Later calls need no carried files: the run goes on as long as the machine is held (the next call
# within the 30 s it stays warm). release_run.py runs from /tmp/capplan-src (the commit under test);
# this script itself runs from the working tree.
set -euo pipefail
# keep whichever pieces of bundle $1 this call carried: part1a, part1b, part2's wheels, device_setup.sh,
# and FlashAttention-2's pieces (part4a, part4b, ...: releases whose FlashAttention-3 would not load)
stage() {
  local f
  mkdir -p "$P/whl"
  # part1 whole and part1 in pieces never both stay staged: the one carried now replaces the other
  if [ -f "$1/part1/vllm_C.tar.xz" ]; then rm -f "$P/vllm_C.tar.xz.00" "$P/vllm_C.tar.xz.01"; fi
  if [ -f "$1/part1a/vllm_C.tar.xz.00" ] || [ -f "$1/part1b/vllm_C.tar.xz.01" ]; then rm -f "$P/vllm_C.tar.xz"; fi
  for f in "$1"/part1/vllm_C.tar.xz "$1"/part1a/vllm_C.tar.xz.00 "$1"/part1b/vllm_C.tar.xz.01 "$1"/part*/device_setup.sh \
    "$1"/part4?/vllm_fa2.tar.xz.?? "$1"/part4a/pieces; do
    if [ -f "$f" ]; then cp "$f" "$P/" && echo "staged $f"; fi
  done
  if ls "$1"/part2/whl/*.whl >/dev/null 2>&1; then cp "$1"/part2/whl/*.whl "$P/whl/" && echo "staged $1/part2/whl"; fi
}
if [ "${1:-}" = stage ]; then
  B=${2:?bundle folder}; B=${B%/}; P=/tmp/vstage-$(basename "$B")
  stage "$B"
  ls -la "$P" && echo "$(ls "$P/whl" | wc -l) wheels staged"
  exit 0
fi
B=${1:?bundle folder}; B=${B%/}; WAIT=${2:?seconds}; MODE=${3:-}
case "$WAIT" in '' | *[!0-9]*) echo "release_bench.sh: WAIT_SECONDS must be a whole number of seconds, not '$WAIT'" >&2; exit 2 ;; esac
case "$MODE" in '' | --together) ;; *) echo "release_bench.sh: the third argument can only be --together, not '$MODE'" >&2; exit 2 ;; esac
NAME=$(basename "$B"); P=/tmp/vstage-$NAME
running() { [ -f "$1/job.pid" ] && kill -0 "$(cat "$1/job.pid")" 2>/dev/null; }
REPO=$PWD
busy=""
for d in /tmp/rr-*/; do
  if [ -d "$d" ] && running "${d%/}"; then busy=${d%/}; fi
done
if [ -n "$busy" ] && [ "$(cat "$busy/bundle")" != "$B" ]; then
  echo "another release's run is going on ($busy, bundle $(cat "$busy/bundle")): wait for it first" >&2
  exit 3
fi
if [ -z "$busy" ] && [ "$(cat /tmp/vsite/.bundle 2>/dev/null)" != "$B" ]; then
  stage "$B"
  [ -f "$P/vllm_C.tar.xz" ] || { [ -f "$P/vllm_C.tar.xz.00" ] && [ -f "$P/vllm_C.tar.xz.01" ]; } ||
    { echo "NEED part1 (or part1a and part1b) of $B staged ($P)" >&2; exit 3; }
  for d in /tmp/vlm-*/; do # a multimodal run (vlm_bench.sh) loads vLLM from /tmp/vsite too
    if [ -d "$d" ] && running "${d%/}"; then echo "a multimodal run is going on (${d%/}): wait for it first" >&2; exit 3; fi
  done
  echo "switching /tmp/vsite to $B (was: $(cat /tmp/vsite/.bundle 2>/dev/null || echo none))"
  if [ -f "$B/part2/vllm_py.tar.xz" ] && [ ! -f "$B/part2/vllm_fa3.tar.xz" ] && [ ! -f "$P/pieces" ]; then
    echo "NEED $B's FlashAttention-2 (part4a, part4b, ...) staged ($P): its part2 has no FlashAttention-3" >&2
    exit 3
  fi
  if [ -f "$P/pieces" ] && [ "$(ls "$P"/vllm_fa2.tar.xz.?? | wc -l)" != "$(cat "$P/pieces")" ]; then
    echo "NEED all $(cat "$P/pieces") pieces of $B's FlashAttention-2 (part4a, part4b, ...) staged ($P)" >&2
    exit 3
  fi
  rm -rf /tmp/vsite && mkdir -p /tmp/vsite
  if [ -f "$P/vllm_C.tar.xz" ]; then xz -dc "$P/vllm_C.tar.xz" | tar -xf - -C /tmp/vsite
  else cat "$P/vllm_C.tar.xz.00" "$P/vllm_C.tar.xz.01" | xz -dc | tar -xf - -C /tmp/vsite; fi
  if [ -f "$P/pieces" ]; then cat "$P"/vllm_fa2.tar.xz.?? | xz -dc | tar -xf - -C /tmp/vsite; fi
fi
# part2 may come in pieces: its wheels staged by an earlier call, the archives carried now
if [ -f "$B/part2/vllm_py.tar.xz" ] && ! ls "$B"/part2/whl/*.whl >/dev/null 2>&1 && ls "$P"/whl/*.whl >/dev/null 2>&1; then
  mkdir -p "$B/part2/whl" && cp "$P"/whl/*.whl "$B/part2/whl/"
fi
if [ -f "$B/part2/vllm_py.tar.xz" ] && [ ! -f "$B/part2/device_setup.sh" ] && [ -f "$P/device_setup.sh" ]; then
  cp "$P/device_setup.sh" "$B/part2/"
fi
source tests/gpu/device_env.sh          # part2 if not there yet, capplan from src.tgz; cd /tmp/capplan-src
REL=$(basename /tmp/vsite/vllm-*.dist-info .dist-info); REL=${REL#vllm-}
if [ -n "$MODE" ] && printf '%s\n' 0.29.0 "$REL" | sort -V -C; then
  echo "release_bench.sh: --together is for releases before 0.29.0; vLLM $REL's memory profiling captures graphs, so its servers run alone" >&2
  exit 2
fi
W=/tmp/rr-$REL
mkdir -p "$W"
if [ ! -f "$W/job.pid" ]; then
  echo "$B" >"$W/bundle"
  CMD="python3 tests/gpu/release_run.py $W $W/release_run.json${MODE:+ $MODE}"
  {
    echo "command: $CMD   (cwd /tmp/capplan-src, started by tests/gpu/release_bench.sh $B $WAIT${MODE:+ $MODE})"
    echo "started: $(date -u +%FT%TZ)"
    echo "capplan commit: $CAPPLAN_COMMIT (/tmp/capplan-src from .carry/src.tgz)"
    echo "vllm: $REL ($B; /tmp/vsite/.bundle: $(cat /tmp/vsite/.bundle))"
    echo "VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-unset}"
    echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo '?')"
    echo "host cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores visible"
    echo "release_bench.sh sha256: $(sha256sum "$REPO/tests/gpu/release_bench.sh" | cut -c1-64) (working tree)"
  } >"$W/env.txt"
  setsid nohup $CMD >>"$W/bench.out" 2>&1 </dev/null &
  echo $! >"$W/job.pid"
elif ! running "$W" && [ ! -f "$W/release_run.json" ]; then
  echo "the run in $W ended without release_run.json: not started again (see bench.out)"
fi
while running "$W" && [ "$SECONDS" -lt "$WAIT" ]; do sleep 5; done
tail -n 40 "$W/bench.out" || true
cp "$W/env.txt" "$W/bench.out" "$OUT/" 2>/dev/null || true
cp "$W/release_run.json" "$OUT/" 2>/dev/null || true
(cd "$W" && tar -czf "$OUT/files.tgz" --ignore-failed-read *.log *.report.json *.trace.jsonl *.yaml 2>/dev/null) || true
ls -la "$W"
running "$W" && echo "release run $REL still running ($SECONDS s into this call)" || echo "release run $REL not running"
ls -la "$OUT"
