#!/usr/bin/env bash
# Prepare the vLLM test oracle's environment (idempotent).
#
#   setup_oracle.sh CACHE_DIR
#
# Creates, each step skipped when its marker file says it is already done:
#   CACHE_DIR/venv            python3.11 venv with requirements-vllm.txt (--no-deps)
#   CACHE_DIR/src/<release>   vllm/*.py unzipped from the vllm==<release> wheel, for each
#                             release in CAPPLAN_ORACLE_RELEASES (default: 0.25.0 0.33.0;
#                             .ci/run names one release of each group), compiled to
#                             __pycache__ once (Python checks each .pyc against its source's
#                             time and size on import; without them every process that
#                             imports vLLM compiles its 3000 files again, a quarter of the
#                             import, when PYTHONDONTWRITEBYTECODE is set)
# Wheels are downloaded into CACHE_DIR/wheels and deleted once unzipped.
#
# Then run the oracle with one version's sources on PYTHONPATH:
#   PYTHONPATH=CACHE_DIR/src/0.33.0 CACHE_DIR/venv/bin/python \
#       tests/conformance/oracle/vllm_oracle.py --input IN.json --output OUT.json
#
# `--no-deps` matters: resolving vLLM's own dependencies pulls several GB of
# CUDA wheels. The venv marker records a hash of the requirements file, so
# editing requirements-vllm.txt rebuilds the venv on the next run.
set -euo pipefail

# Releases to prepare: CAPPLAN_ORACLE_RELEASES (comma or space separated), else the oldest and newest.
read -r -a VERSIONS <<< "$(echo "${CAPPLAN_ORACLE_RELEASES:-0.25.0 0.33.0}" | tr ',' ' ')"
PYTHON=${PYTHON:-python3.11}

if [[ $# -ne 1 || -z "${1:-}" ]]; then
    echo "usage: $0 CACHE_DIR" >&2
    exit 2
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REQS="$HERE/requirements-vllm.txt"
mkdir -p "$1"
CACHE=$(cd "$1" && pwd)

log() { echo "[setup_oracle] $*"; }
die() { echo "[setup_oracle] ERROR: $*" >&2; exit 1; }

[[ -f "$REQS" ]] || die "missing $REQS"
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found"
command -v unzip >/dev/null 2>&1 || die "unzip not found (apt-get install unzip)"

req_hash() { sha256sum "$REQS" | cut -d' ' -f1; }

# ---------------------------------------------------------------- venv
VENV="$CACHE/venv"
VENV_MARK="$VENV/.oracle-venv-ok"
want_hash=$(req_hash)
if [[ -f "$VENV_MARK" && "$(cat "$VENV_MARK")" == "$want_hash" && -x "$VENV/bin/python" ]]; then
    log "venv: up to date ($VENV)"
else
    log "venv: creating $VENV"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV" || die "venv creation failed"
    log "venv: pip install --no-deps -r $(basename "$REQS") (torch is large; ~1-2 min)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        --no-deps -r "$REQS" 2> >(grep -v "is ignored: it is neither" >&2) \
        || die "pip install failed"
    echo "$want_hash" > "$VENV_MARK"
    log "venv: done"
fi

# ---------------------------------------------------------------- vLLM sources
WHEELS="$CACHE/wheels"
compile_sources() {  # $1: a release's source folder
    if [[ ! -f "$1/.oracle-pyc-ok" ]]; then
        log "vllm $(basename "$1"): compiling to __pycache__"
        "$VENV/bin/python" -m compileall -q -j 0 "$1/vllm" >/dev/null \
            || log "vllm $(basename "$1"): some files did not compile (Python compiles them on import)"
        touch "$1/.oracle-pyc-ok"
    fi
}
for v in "${VERSIONS[@]}"; do
    SRC="$CACHE/src/$v"
    MARK="$SRC/.oracle-src-ok"
    if [[ -f "$MARK" && -f "$SRC/vllm/__init__.py" ]]; then
        log "vllm $v: sources present ($SRC)"
        compile_sources "$SRC"
        continue
    fi
    mkdir -p "$WHEELS"
    whl=$(ls "$WHEELS"/vllm-"$v"-*.whl 2>/dev/null | head -n1 || true)
    if [[ -z "$whl" ]]; then
        log "vllm $v: downloading wheel (several hundred MB)"
        "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check \
            --no-deps "vllm==$v" -d "$WHEELS" 2> >(grep -v "is ignored: it is neither" >&2) \
            || die "download of vllm==$v failed"
        whl=$(ls "$WHEELS"/vllm-"$v"-*.whl 2>/dev/null | head -n1 || true)
        [[ -n "$whl" ]] || die "no vllm-$v wheel in $WHEELS after download"
    else
        log "vllm $v: reusing $(basename "$whl")"
    fi
    log "vllm $v: unzipping vllm/*.py"
    rm -rf "$SRC"
    mkdir -p "$SRC"
    unzip -q -o "$whl" 'vllm/*.py' -d "$SRC" || die "unzip of $whl failed"
    [[ -f "$SRC/vllm/__init__.py" ]] || die "unzip produced no vllm/__init__.py"
    touch "$MARK"
    rm -f "$whl"
    compile_sources "$SRC"
    log "vllm $v: done (wheel deleted)"
done
rmdir "$WHEELS" 2>/dev/null || true

# ---------------------------------------------------------------- smoke check
# Once per release and oracle venv (a marker in the release's folder), so that preparing another
# set of releases (the matrix, CI's one of each group) never repeats a check that passed.
for v in "${VERSIONS[@]}"; do
    CHECK_MARK="$CACHE/src/$v/.oracle-import-ok"
    if [[ -f "$CHECK_MARK" && "$(cat "$CHECK_MARK")" == "$want_hash" ]]; then
        log "import check: vllm $v already passed"
        continue
    fi
    log "import check: vllm $v"
    out=$(VLLM_LOGGING_LEVEL=ERROR PYTHONPATH="$CACHE/src/$v" "$VENV/bin/python" -c '
import vllm
import vllm.config, vllm.v1.worker.gpu.cudagraph_utils, vllm.v1.worker.gpu.lora_utils
import vllm.v1.worker.gpu.input_batch, vllm.v1.worker.lora_model_runner_mixin
print("ORACLE-IMPORT-OK", vllm.__version__)
' 2>&1) || { echo "$out" | tail -n 20 >&2; die "importing vllm $v's planning modules failed"; }
    got=$(echo "$out" | sed -n 's/^ORACLE-IMPORT-OK //p')
    [[ "$got" == "$v" ]] || die "vllm in $CACHE/src/$v reports version '$got', expected $v"
    echo "$want_hash" > "$CHECK_MARK"
    log "import check: vllm $got OK"
done

log "ready: PYTHONPATH=$CACHE/src/<version> $VENV/bin/python $HERE/vllm_oracle.py --input IN.json --output OUT.json"
