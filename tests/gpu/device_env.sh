# Sourced by the device-call scripts (production_run.sh, start_bench.sh, probe_bench.sh, release_bench.sh), from the repository root
# of the GPU machine, with B the bundle folder: part2 of the vLLM bundle unpacked by tests/gpu/bundle/device_setup.sh (after part1, or
# part1a and part1b; part2 whole, or part2b after part2a), capplan installed from .carry/src.tgz (`git archive` of the commit under
# test, its hash in COMMIT) so that every record names the code that produced it, and the
# environment every run uses. Leaves the shell in /tmp/capplan-src.
# /tmp/vsite holds one release: the bundle whose part2 was unpacked there is named in /tmp/vsite/.bundle.
# Another bundle's files there (part1a/part1b of a second release unpacked over the first, which
# device_setup.sh does not wipe) stop the call: empty /tmp/vsite and unpack $B's part1 first
# (tests/gpu/release_bench.sh does both when it switches releases).
if [ -f /tmp/vsite/vllm/entrypoints/openai/api_server.py ]; then
  if [ -f /tmp/vsite/.bundle ] && [ "$(cat /tmp/vsite/.bundle)" != "$B" ]; then
    echo "/tmp/vsite holds bundle $(cat /tmp/vsite/.bundle), not $B: empty it and unpack $B's part1 first" >&2
    exit 3
  fi
else  # part2 carried whole, or its second piece (part2b) after part2a was kept by an earlier call
  if [ -d "$B/part2b" ] && [ ! -f "$B/part2/vllm_py.tar.xz" ]; then
    bash tests/gpu/bundle/device_setup.sh part2b "$B" >/dev/null
  else
    bash tests/gpu/bundle/device_setup.sh part2 "$B" >/dev/null
  fi
  echo "$B" >/tmp/vsite/.bundle
fi
if [ "$(ls -d /tmp/vsite/vllm-*.dist-info | wc -l)" != 1 ]; then
  echo "/tmp/vsite holds more than one vLLM release: $(ls -d /tmp/vsite/vllm-*.dist-info | tr '\n' ' ')" >&2
  exit 3
fi
if [ ! -f /tmp/capplan-src/COMMIT ]; then
  rm -rf /tmp/capplan-src && mkdir -p /tmp/capplan-src
  tar -xzf .carry/src.tgz -C /tmp/capplan-src
  python3 -m pip install -q --no-deps --no-build-isolation -e /tmp/capplan-src
fi
export PYTHONPATH=/tmp/vsite PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
unset VLLM_ENABLE_V1_MULTIPROCESSING
CAPPLAN_COMMIT=$(cat /tmp/capplan-src/COMMIT)
export CAPPLAN_COMMIT
echo "capplan $CAPPLAN_COMMIT; MP=${VLLM_ENABLE_V1_MULTIPROCESSING:-unset}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
cd /tmp/capplan-src
