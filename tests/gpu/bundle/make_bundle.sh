#!/usr/bin/env bash
# Builds the vLLM bundle of the project's GPU runs: a published vLLM release, stripped to what the
# runs load, for the offline GPU machine (x86-64, Python 3.12, torch 2.11.0+cu130 installed, no vLLM,
# no network). vLLM's compiled extensions use only libtorch's stable ABI, so the releases that pin a
# later torch run on 2.11 too. Nothing of vLLM is edited. Run on a machine with PyPI:
#   tests/gpu/bundle/make_bundle.sh .carry/vllm033                        # vLLM 0.33.0
#   VLLM_VERSION=0.26.0 tests/gpu/bundle/make_bundle.sh .carry/vllm026    # another release
#   MOE=1 tests/gpu/bundle/make_bundle.sh .carry/vllm033                  # with part3 (MoE models)
# OUTDIR inside the checkout must be git-ignored (.carry/ is), or every device call would carry it.
# Each part is a folder carried to the GPU machine in a call of its own, and holds a copy of
# device_setup.sh, which unpacks it into /tmp/vsite there:
#   part1/vllm_C.tar.xz     vllm/_C_stable_libtorch.abi3.so (vLLM's CUDA platform imports it). Over
#                           50,000,000 bytes (0.27.0 on) it is written in two pieces instead,
#                           part1a/vllm_C.tar.xz.00 and part1b/vllm_C.tar.xz.01.
#   part2/vllm_py.tar.xz    every other file of the wheel, less what is left out below
#   part2/vllm_fa3.tar.xz   vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so: vllm.vllm_flash_attn does not
#                           import unless FlashAttention-2 or -3 loads, and vLLM's Llama imports it
#   part2/whl/*.whl         the wheels the image lacks (wheels.txt; wheels-from-0.27.txt from 0.27.0)
#   part3/vllm_moe.tar.xz   vllm/_moe_C_stable_libtorch.abi3.so, with MOE=1 (data parallel runs need
#                           a MoE model: vLLM refuses offline data parallel for dense ones)
#   part4/vllm_fa2.tar.xz   vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so, in place of vllm_fa3.tar.xz,
#                           where the FlashAttention-3 extension links torch's unstable C++ ABI (its
#                           undefined symbols name at::, c10:: or torch:: functions; 0.27.x): it
#                           would not load on the machine's torch. About 85 MB, so always written
#                           in pieces, part4a, part4b, ... (vllm_fa2.tar.xz.00, .01, ...), one call each.
# Left out of the wheel: the FlashAttention-2 extension (the runs use the TRITON_ATTN backend), the
# MoE extension but in part3, the vllm-rs binary, DeepGEMM's extension, C++ and CUDA headers and
# sources. flashinfer is not carried: the runs set VLLM_USE_FLASHINFER_SAMPLER=0.
# A device call carries the checkout (its tracked files and the untracked ones git does not ignore)
# and the part, 64 MiB in all. A part that would leave less than 4 MiB of that free is also written
# in pieces that fit, one call each: part2 as part2a (the two archives) and part2b (the wheels),
# part1 and part3 cut in two as part1a/part1b and part3a/part3b. The script ends with the calls to
# make, in order, and exits 1 if a piece is still too large.
set -euo pipefail
shopt -s nullglob
usage="usage: [VLLM_VERSION=0.33.0] [MOE=1] tests/gpu/bundle/make_bundle.sh OUTDIR"
OUT=${1:?$usage}
VER=${VLLM_VERSION:-0.33.0}
HERE=$(cd "$(dirname "$0")" && pwd -P)
ROOT=$(git -C "$HERE" rev-parse --show-toplevel)
OUT=$(realpath -m "$OUT") # absolute: the wheel is stripped from another folder
case "$OUT/" in
  "$ROOT"/*)
    REL=${OUT#"$ROOT"}
    REL=${REL#/}
    if [ -z "$REL" ] || ! git -C "$ROOT" check-ignore -q "$REL"; then
      echo "make_bundle.sh: $OUT is in the checkout and not git-ignored: every device call would carry it" >&2
      exit 2
    fi
    ;;
  *) REL=$OUT ;; # outside the checkout: to be carried, it must be moved under a git-ignored folder of it
esac
CACHE=${TMPDIR:-/tmp}/capplan-vllm-bundle-$VER
mkdir -p "$OUT" "$CACHE/wheel"

# pip picks wheels for the GPU machine, not for this one: CPython 3.12 on x86-64 Linux, binaries
# only, and never a dependency on its own (the lists name each wheel the image lacks).
DOWNLOAD=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
  --implementation cp --platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for glibc in 17 24 26 27 28 31 34 35 39; do DOWNLOAD+=(--platform "manylinux_2_${glibc}_x86_64"); done

# 1. The published wheel, downloaded once per release.
wheel=("$CACHE"/wheel/vllm-"$VER"-*.whl)
if [ ${#wheel[@]} = 0 ]; then
  "${DOWNLOAD[@]}" -d "$CACHE/wheel" "vllm==$VER"
  wheel=("$CACHE"/wheel/vllm-"$VER"-*.whl)
fi
[ ${#wheel[@]} = 1 ] || { echo "make_bundle.sh: expected one vllm $VER wheel in $CACHE/wheel" >&2; exit 2; }

# 2. A fresh set of parts: what an earlier build left in OUTDIR goes first.
for p in "$OUT"/part*/; do rm -rf "${p%/}"; done # the entry itself, never a linked folder's contents
mkdir -p "$OUT/part1" "$OUT/part2/whl"

# 3. The dependency wheels; releases from 0.27.0 import more packages in the engine core.
"${DOWNLOAD[@]}" -d "$OUT/part2/whl" -r "$HERE/wheels.txt"
if printf '%s\n' 0.27 "$VER" | sort -V -C; then
  "${DOWNLOAD[@]}" -d "$OUT/part2/whl" -r "$HERE/wheels-from-0.27.txt"
fi

# 4. The wheel unpacked, and the list of its files that go in the Python archive: all of vllm and
#    its dist-info but what the runs never load and the extensions that travel in archives of their own.
X=$CACHE/unpacked
rm -rf "$X" && mkdir -p "$X"
python3 -m zipfile -e "${wheel[0]}" "$X"
cd "$X"
for f in vllm/_C_stable_libtorch.abi3.so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so; do
  [ -f "$f" ] || { echo "make_bundle.sh: vllm $VER's wheel has no $f" >&2; exit 2; }
done
# links_unstable_abi SO: the extension calls torch's C++ functions (mangled at::, c10::, torch::
# names), whose ABI changes between torch releases, so it loads only on the torch it was built for.
# (nm's whole output is read first: `grep -q` ending a pipeline early would fail it under pipefail)
command -v nm >/dev/null || { echo "make_bundle.sh: needs nm (binutils) to read the extensions' symbols" >&2; exit 2; }
links_unstable_abi() {
  local syms
  syms=$(nm -D --undefined-only "$1") || { echo "make_bundle.sh: nm could not read $1" >&2; exit 2; }
  grep -qE '_ZNK?(2at|3c10|5torch)' <<<"$syms"
}
# An extension built for the machine's own torch loads whatever ABI it links: the releases that pin
# torch 2.11.0 (0.25.0 to 0.26.0) keep FlashAttention-3.
MACHINE_TORCH=2.11.0
PIN=$(sed -n 's/^Requires-Dist: torch *==\([0-9.]*\).*/\1/p' vllm-"$VER".dist-info/METADATA | head -n 1)
[ -n "$PIN" ] || { echo "make_bundle.sh: vllm $VER's METADATA pins no torch version" >&2; exit 2; }
FA=vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
if [ "$PIN" != "$MACHINE_TORCH" ] && links_unstable_abi "$FA"; then
  FA=vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
  if [ ! -f "$FA" ] || links_unstable_abi "$FA"; then
    echo "make_bundle.sh: vllm $VER's FlashAttention extensions link torch's unstable C++ ABI: none would load on torch $MACHINE_TORCH (it pins $PIN)" >&2
    exit 2
  fi
  echo "vllm $VER: FlashAttention-3 links torch's unstable C++ ABI; FlashAttention-2 goes instead (part4)"
fi
LEAVE_OUT=(
  -name '*.h' -o -name '*.hpp' -o -name '*.cuh' -o -name '*.inl' -o -name '*.cu' # headers, CUDA sources
  -o -path vllm/vllm-rs                                 # a binary the Python runs never start
  -o -name _vllm_fa2_C.abi3.so                          # FlashAttention-2: the runs use TRITON_ATTN
  -o -path 'vllm/third_party/deep_gemm/_C.*.so'         # DeepGEMM's extension
  -o -name _C_stable_libtorch.abi3.so                   # part1
  -o -name _vllm_fa3_C.abi3.so                          # vllm_fa3.tar.xz
  -o -name _moe_C_stable_libtorch.abi3.so               # part3, with MOE=1
)
find vllm vllm-*.dist-info -type f ! \( "${LEAVE_OUT[@]}" \) | LC_ALL=C sort >"$CACHE/py.list"

# 5. The archives: xz at its strongest where the gain is worth the time, on every core.
tar -cf - -T "$CACHE/py.list" | xz -9e -T0 >"$OUT/part2/vllm_py.tar.xz"
if [ "$FA" = vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ]; then
  tar -cf - "$FA" | xz -9 -T0 >"$OUT/part2/vllm_fa3.tar.xz"
else
  mkdir -p "$OUT/part4"
  tar -cf - "$FA" | xz -9e -T0 >"$OUT/part4/vllm_fa2.tar.xz"
fi
tar -cf - vllm/_C_stable_libtorch.abi3.so | xz -9e -T0 >"$OUT/part1/vllm_C.tar.xz"
if [ "${MOE:-0}" = 1 ]; then
  mkdir -p "$OUT/part3"
  tar -cf - vllm/_moe_C_stable_libtorch.abi3.so | xz -6 -T0 >"$OUT/part3/vllm_moe.tar.xz"
fi
for p in "$OUT"/part*/; do cp "$HERE/device_setup.sh" "$p"; done

# 6. What fits one device call: 64 MiB, less the checkout, less 4 MiB to spare.
TREE=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1) || true
[ -n "$TREE" ] || { echo "make_bundle.sh: could not measure the checkout" >&2; exit 2; }
ROOM=$((67108864 - 4194304 - TREE))
bytes() { du -sb "$1" | cut -f1; }
fits() { [ "$(bytes "$OUT/$1")" -le "$ROOM" ]; }

# halve PART FILE: PART's archive cut in two equal pieces, PARTa/FILE.00 and PARTb/FILE.01
halve() {
  mkdir -p "$OUT/$1a" "$OUT/$1b"
  split -n 2 -d "$OUT/$1/$2" "$OUT/$1a/$2."
  mv "$OUT/$1a/$2.01" "$OUT/$1b/"
  cp "$HERE/device_setup.sh" "$OUT/$1a/"
  cp "$HERE/device_setup.sh" "$OUT/$1b/"
}

plan=()
if [ "$(bytes "$OUT/part1/vllm_C.tar.xz")" -gt 50000000 ]; then
  halve part1 vllm_C.tar.xz # never carried whole: only the pieces are kept
  rm -rf "$OUT/part1"
  plan+=(part1a part1b)
elif fits part1; then
  plan+=(part1)
else
  halve part1 vllm_C.tar.xz
  plan+=(part1a part1b)
fi
if fits part2; then
  plan+=(part2)
else
  mkdir -p "$OUT/part2a" "$OUT/part2b"
  cp "$OUT"/part2/vllm_*.tar.xz "$HERE/device_setup.sh" "$OUT/part2a/"
  cp -r "$OUT/part2/whl" "$HERE/device_setup.sh" "$OUT/part2b/"
  plan+=(part2a part2b)
fi
if [ -d "$OUT/part3" ]; then
  if fits part3; then
    plan+=(part3)
  else
    halve part3 vllm_moe.tar.xz
    plan+=(part3a part3b)
  fi
fi

if [ -d "$OUT/part4" ]; then # in as many pieces as it takes, each with the count in `pieces`
  room=$((ROOM - 65536)) # beside each piece: device_setup.sh, `pieces` and the folder itself
  n=$(( ($(bytes "$OUT/part4/vllm_fa2.tar.xz") + room - 1) / room ))
  [ "$n" -ge 2 ] || n=2
  if [ "$n" -gt 8 ]; then
    echo "make_bundle.sh: FlashAttention-2 would take $n pieces, more than part4a..part4h: make room in the checkout" >&2
    exit 2
  fi
  split -n "$n" -d "$OUT/part4/vllm_fa2.tar.xz" "$OUT/part4/vllm_fa2.tar.xz."
  i=0
  for letter in a b c d e f g h; do
    [ "$i" -lt "$n" ] || break
    mkdir -p "$OUT/part4$letter"
    mv "$OUT/part4/vllm_fa2.tar.xz.$(printf %02d "$i")" "$OUT/part4$letter/"
    echo "$n" >"$OUT/part4$letter/pieces"
    cp "$HERE/device_setup.sh" "$OUT/part4$letter/"
    plan+=("part4$letter")
    i=$((i + 1))
  done
  rm -rf "$OUT/part4"
fi

# 7. The calls to make.
echo "vLLM $VER bundle in $OUT: $(bytes "$OUT") bytes"
echo "the checkout: $TREE bytes, so a part may take $ROOM (64 MiB less the checkout, less 4 MiB)"
echo "carry one part per device call, in this order, on one machine:"
status=0
for p in "${plan[@]}"; do
  note=""
  if ! fits "$p"; then
    note="   DOES NOT FIT: make room in the checkout"
    status=1
  fi
  printf '  %-8s %9s bytes   bash %s/%s/device_setup.sh %s %s%s\n' "$p" "$(bytes "$OUT/$p")" "$REL" "$p" "$p" "$REL" "$note"
done
[ "$REL" != "$OUT" ] || echo "(to carry it, move $OUT under a git-ignored folder of the checkout, e.g. .carry/)"
exit $status
