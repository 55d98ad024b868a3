#!/usr/bin/env bash
# GPU-machine side of the vLLM bundle that make_bundle.sh (beside this file) builds; every part of a
# bundle holds a copy. It unpacks the part carried in this call into the site folder /tmp/vsite,
# outside the checkout. From the repository root of the GPU machine, B the bundle folder:
#   bash B/part1/device_setup.sh part1 B      vLLM's compiled extension
#   bash B/part1a/device_setup.sh part1a B    or, split in two (0.27.0 on): keeps the first piece,
#   bash B/part1b/device_setup.sh part1b B    then joins it to the second and unpacks both
#   bash B/part2/device_setup.sh part2 B      the Python files, FlashAttention-3 and the wheels
#   bash B/part2a/device_setup.sh part2a B    or, where the checkout leaves no room for part2:
#   bash B/part2b/device_setup.sh part2b B    keeps the two archives, then unpacks them with the wheels
#   bash B/part3/device_setup.sh part3 B      the MoE extension (MOE=1 bundles; split: part3a, part3b)
#   bash B/part4a/device_setup.sh part4a B    FlashAttention-2, where FlashAttention-3 would not load
#   bash B/part4b/device_setup.sh part4b B    (0.27.x): N pieces, one call each, in order; the last
#   ...                                       one joins them and unpacks the extension
# One call each, in that order, on one machine: part2 needs what part1 unpacked, and the pieces of a
# split part wait in /tmp/vpart1, /tmp/vpart2 or /tmp/vpart3, which go when the machine goes back.
# Then run with PYTHONPATH=/tmp/vsite HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 (flashinfer is
# not in the bundle; without that variable the MRV2 sampler stops on "No module named 'flashinfer'").
# VSITE and VPARTS (default /tmp) move the site folder and the pieces elsewhere, for a test on any
# machine; PYTHON names the interpreter whose pip installs the wheels (default python3, 3.12 there).
set -euo pipefail
shopt -s nullglob
usage="usage: device_setup.sh part1|part1a|part1b|part2|part2a|part2b|part3|part3a|part3b|part4a..part4h BUNDLE_DIR"
PART=${1:?$usage}
B=${2:?$usage}
B=${B%/}
S=${VSITE:-/tmp/vsite}
W=${VPARTS:-/tmp}
PY=${PYTHON:-python3}

die() {
  echo "device_setup.sh $PART: $*" >&2
  exit 3
}
# need FILE MESSAGE: stop with MESSAGE unless FILE is there
need() { [ -f "$1" ] || die "$2"; }
# carried FILE: FILE must have come with this call's part
carried() { need "$B/$PART/$1" "$B/$PART/$1 missing: carry $B/$PART in this call"; }
unpack() { xz -dc "$1" | tar -xf - -C "$S"; }

# keep N FILE...: the carried files of part N's first piece wait in $W/vpartN for a later call,
# with the bundle they belong to (pieces of two bundles must never be joined)
keep() {
  local n=$1 f
  shift
  for f in "$@"; do carried "$f"; done
  rm -rf "$W/vpart$n" && mkdir -p "$W/vpart$n"
  for f in "$@"; do cp "$B/$PART/$f" "$W/vpart$n/"; done
  echo "$B" >"$W/vpart$n/bundle"
  echo "kept $* in $W/vpart$n"
}

# kept N FILE...: part N's first piece must have been kept by an earlier call, from this bundle
kept() {
  local n=$1 f
  shift
  for f in "$@"; do
    need "$W/vpart$n/$f" "NEED PART${n}A first: $W/vpart$n/$f missing (part${n}a not run, or the machine was given back)"
  done
  if [ -f "$W/vpart$n/bundle" ] && [ "$(cat "$W/vpart$n/bundle")" != "$B" ]; then
    die "the part${n}a kept in $W/vpart$n is from $(cat "$W/vpart$n/bundle"), not $B: run $B's part${n}a first"
  fi
}

# join N ARCHIVE: part N's second piece, carried now, after its first, kept by an earlier call: unpacked
join() {
  kept "$1" "$2.00"
  carried "$2.01"
  cat "$W/vpart$1/$2.00" "$B/$PART/$2.01" | xz -dc | tar -xf - -C "$S"
}

# part2's contents: the two archives from ARCHIVES, the wheels from WHEELS. The wheels go in with
# pip from the files alone (no index, no dependencies resolved: the bundle holds what is needed).
install_part2() {
  local archives=$1 wheels=("$2"/*.whl)
  need "$S/vllm/_C_stable_libtorch.abi3.so" \
    "NEED PART1 first: $S/vllm/_C_stable_libtorch.abi3.so missing (part1 not unpacked, or the machine was given back)"
  [ ${#wheels[@]} -gt 0 ] || die "no wheels in $2: carry them in this call"
  unpack "$archives/vllm_py.tar.xz"
  [ ! -f "$archives/vllm_fa3.tar.xz" ] || unpack "$archives/vllm_fa3.tar.xz" # else part4 brings FlashAttention-2
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$S" "${wheels[@]}"
}

# piece4: the carried piece of part4 (FlashAttention-2) waits in $W/vpart4 with the pieces before
# it; the last of `pieces` joins them all and unpacks the extension
piece4() {
  local letters=abcdefgh i n
  i=${letters%%"${PART#part4}"*}
  i=${#i}
  carried pieces
  n=$(cat "$B/$PART/pieces")
  carried "vllm_fa2.tar.xz.$(printf %02d "$i")"
  if [ "$i" = 0 ]; then
    rm -rf "$W/vpart4" && mkdir -p "$W/vpart4" && echo "$B" >"$W/vpart4/bundle"
  else
    local prev="part4${letters:i-1:1}"
    need "$W/vpart4/vllm_fa2.tar.xz.$(printf %02d $((i - 1)))" \
      "NEED ${prev^^} first: the piece before this one is not kept in $W/vpart4 ($prev not run, or the machine was given back)"
    [ "$(cat "$W/vpart4/bundle")" = "$B" ] || die "the pieces kept in $W/vpart4 are from $(cat "$W/vpart4/bundle"), not $B: run $B's part4a first"
  fi
  cp "$B/$PART/vllm_fa2.tar.xz.$(printf %02d "$i")" "$W/vpart4/"
  if [ $((i + 1)) -lt "$n" ]; then
    echo "kept piece $((i + 1)) of $n in $W/vpart4"
    return
  fi
  cat "$W"/vpart4/vllm_fa2.tar.xz.* | xz -dc | tar -xf - -C "$S"
  rm -rf "$W/vpart4"
}

mkdir -p "$S"
case $PART in
  part1)
    carried vllm_C.tar.xz
    unpack "$B/part1/vllm_C.tar.xz"
    ;;
  part1a) keep 1 vllm_C.tar.xz.00 ;;
  part1b) join 1 vllm_C.tar.xz ;;
  part2)
    carried vllm_py.tar.xz # vllm_fa3.tar.xz too, but where part4 brings FlashAttention-2
    install_part2 "$B/part2" "$B/part2/whl"
    ;;
  part2a) keep 2 vllm_py.tar.xz $(cd "$B/part2a" && ls vllm_fa3.tar.xz 2>/dev/null) ;;
  part2b)
    kept 2 vllm_py.tar.xz
    install_part2 "$W/vpart2" "$B/part2b/whl"
    ;;
  part3)
    carried vllm_moe.tar.xz
    unpack "$B/part3/vllm_moe.tar.xz"
    ;;
  part3a) keep 3 vllm_moe.tar.xz.00 ;;
  part3b) join 3 vllm_moe.tar.xz ;;
  part4[a-h]) piece4 ;;
  *) die "unknown part ($usage)" ;;
esac
# what the site folder holds now
du -sh "$S"
find "$S" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort | sed -n 1,50p | tr '\n' ' '
echo
