#!/usr/bin/env bash
# Forty-fourth session, call C (s113's model half; s113 lacked an xtask, now carried in .gpu/c43):
# n44 = the NVFP4A16 model binaries with gemm_nvfp4_grouped_96 and grouped_tile_rows' measured
# rule (96-row tiles at a 2,048-token chunk and at 8,192-token steps): shallow NVFP4A16 checks, then
# the full preset's 2K and 32K (8,192-token steps) prefill against c43's (fa3d67e: 64-row tiles at
# 2K, 128-row at 8K), alternating, two each.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds c43
unpack_as N n44
exec > >(tee "$OUT/summary.txt") 2>&1
shallow_checks "$N/test_shallow_nvfp4" nvfp4 | tail -6
echo "at ${SECONDS}s"
if synth_full_nvfp4; then
  t0=$SECONDS
  for i in 1 2; do
    [ $SECONDS -lt 430 ] || break
    BENCH_TIMEOUT=100 bench "old_$i" "$G/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
    BENCH_TIMEOUT=100 bench "new_$i" "$N/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
  done
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
