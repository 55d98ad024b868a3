#!/usr/bin/env bash
# vlm_lora.py (tower/connector LoRA of a tiny Qwen2-VL; by default with MRV2's encoder CUDA graphs on,
# the engines started together) on the vLLM release in /tmp/vsite, in device calls of at most 10
# minutes, from the repository root of the GPU machine:
#   bash tests/gpu/vlm_bench.sh WAIT_SECONDS [vlm_lora.py options]   # default: --encoder-graphs --parallel --no-hf
# Needs what release_bench.sh left: a release unpacked in /tmp/vsite (named in /tmp/vsite/.bundle) and
# the commit under test installed from /tmp/capplan-src; nothing carried. The first call copies
# vlm_lora.py, make_vlm.py and run_identity.py from the working tree to /tmp/vlm-RELEASE/scripts (the run uses those
# copies; env.txt has their sha256) and starts the run there in the background (setsid nohup), once: a
# run going on or ended is never started again, and later calls only wait. Every call waits up to
# WAIT_SECONDS (counted from the call's start), then brings back what exists: gpu_vlm.json (the
# result, rewritten after every stage), bench.out, env.txt and files.tgz (every engine's log, with
# its engine core's, the engines' JSON and probe files, the capplan report, the spec and plan; never
# the model or the compile caches). It can run beside release_bench.sh's run of the same release: its
# own work folder, compile and Triton caches, no fixed port (offline engines), each engine 10% of
# the GPU with a fixed KV cache (no memory profiling).
set -euo pipefail
WAIT=${1:-}
if ! [[ $WAIT =~ ^[0-9]+$ ]]; then
  echo "vlm_bench.sh: WAIT_SECONDS must be a whole number of seconds, got '${WAIT}' (usage: bash tests/gpu/vlm_bench.sh WAIT_SECONDS [vlm_lora.py options])" >&2
  exit 2
fi
shift
ARGS=("$@")
if [ ${#ARGS[@]} -eq 0 ]; then ARGS=(--encoder-graphs --parallel --no-hf); fi
: "${OUT:?vlm_bench.sh: OUT (the folder whose files come back) is not set}"
if [ ! -f /tmp/vsite/.bundle ] || [ ! -f /tmp/vsite/vllm/entrypoints/openai/api_server.py ]; then
  echo "vlm_bench.sh: no vLLM release unpacked in /tmp/vsite: run tests/gpu/release_bench.sh BUNDLE first" >&2
  exit 3
fi
if [ ! -f /tmp/capplan-src/COMMIT ]; then
  echo "vlm_bench.sh: no commit under test in /tmp/capplan-src: run tests/gpu/release_bench.sh BUNDLE first" >&2
  exit 3
fi
REPO=$PWD
B=$(cat /tmp/vsite/.bundle)  # the bundle in /tmp/vsite; device_env.sh checks that one release lies there
# shellcheck source=tests/gpu/device_env.sh
source tests/gpu/device_env.sh  # nothing to unpack or install here; its environment; cd /tmp/capplan-src
REL=$(basename /tmp/vsite/vllm-*.dist-info .dist-info); REL=${REL#vllm-}
W=/tmp/vlm-$REL
running() { [ -f "$W/job.pid" ] && kill -0 "$(cat "$W/job.pid")" 2>/dev/null; }
mkdir -p "$W"
if [ ! -f "$W/job.pid" ]; then
  mkdir -p "$W/scripts"
  cp "$REPO/tests/gpu/vlm_lora.py" "$REPO/tests/gpu/make_vlm.py" "$REPO/tests/gpu/run_identity.py" "$W/scripts/"
  CMD=(python3 "$W/scripts/vlm_lora.py" "$W" "${ARGS[@]}")
  {
    echo "command: ${CMD[*]}   (cwd /tmp/capplan-src, CAPPLAN_GPU_OUT=$W, started by tests/gpu/vlm_bench.sh $WAIT $*)"
    echo "started: $(date -u +%FT%TZ)"
    echo "capplan commit: $CAPPLAN_COMMIT (/tmp/capplan-src)"
    echo "vllm: $REL ($B)"
    echo "torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null || echo '?')"
    echo "VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-unset}"
    echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo '?')"
    echo "gpu processes at start: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | tr '\n' ';')"
    echo "host cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores visible"
    (cd "$W/scripts" && sha256sum vlm_lora.py make_vlm.py run_identity.py | sed 's/^/script sha256: /')
    echo "vlm_bench.sh sha256: $(sha256sum "$REPO/tests/gpu/vlm_bench.sh" | cut -c1-64) (working tree)"
  } >"$W/env.txt"
  CAPPLAN_GPU_OUT=$W setsid nohup "${CMD[@]}" >>"$W/bench.out" 2>&1 </dev/null &
  echo $! >"$W/job.pid"
  echo "vlm run $REL started in $W (pid $(cat "$W/job.pid"))"
elif ! running; then
  echo "the run in $W has ended: not started again (see bench.out and gpu_vlm.json; a new run needs an empty $W)"
else
  echo "vlm run $REL already started ($(sed -n 's/^command: //p' "$W/env.txt" | cut -d' ' -f1-40)); waiting"
fi
while running && [ "$SECONDS" -lt "$WAIT" ]; do sleep 5; done
tail -n 40 "$W/bench.out" || true
cp "$W/env.txt" "$W/bench.out" "$OUT/" 2>/dev/null || true
cp "$W/gpu_vlm.json" "$OUT/" 2>/dev/null || true
# the run's own files: top-level logs, JSON, probes, reports, spec and plan, and the scripts it ran
(cd "$W" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.json' -o -name '*.probe' -o -name '*.yaml' \
  -o -name '*.jsonl' -o -name '*.txt' -o -name '*.out' \) -print0 | tar --null -T - -czf "$OUT/files.tgz" scripts) || true
ls -la "$W"
if running; then echo "vlm run $REL still running ($SECONDS s into this call)"; else echo "vlm run $REL not running"; fi
ls -la "$OUT"
