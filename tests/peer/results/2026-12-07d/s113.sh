#!/usr/bin/env bash
# Forty-fourth session, call B: gemm_nvfp4_grouped_96 (the grouped NVFP4 GEMM in 96-row tiles, 4
# warps of 48 x 64; moe_sort's three tile-offset prefixes). k44 = its kernel tests: the NVFP4 tests
# (every height bit for bit against the 64-row tiles, 1,024 to 8,192 tokens timed in each
# height), moe_sort / moe_route_sort / moe_prefill / gemm_. n44 = its NVFP4A16 model binaries
# (grouped_tile_rows: 96-row tiles at a 2,048-token chunk): shallow NVFP4A16 checks, then the full
# preset's 2K and 32K prefill against c43's (fa3d67e, 64-row tiles at 2K), alternating, two each.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds c43
unpack_as N n44
unpack_as K k44
exec > >(tee "$OUT/summary.txt") 2>&1
kernel_tests k44a "$K/kernels" nvfp4 | grep -v "gemv\|moe_gemv" | tail -22
kernel_tests k44b "$K/kernels" moe_sort moe_route_sort moe_prefill gemm_ | tail -4
echo "at ${SECONDS}s"
shallow_checks "$N/test_shallow_nvfp4" nvfp4 | tail -6
echo "at ${SECONDS}s"
if synth_full_nvfp4; then
  for i in 1 2; do
    [ $SECONDS -lt 470 ] || break
    BENCH_TIMEOUT=100 bench "old_$i" "$G/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
    BENCH_TIMEOUT=100 bench "new_$i" "$N/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
  done
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
