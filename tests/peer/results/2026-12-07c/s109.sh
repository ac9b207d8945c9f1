#!/usr/bin/env bash
# Forty-third session, call E: issue 16's ratios with the landed kernels, one call. FP8 = c42b's
# bench (a33ec89: FP8 kernels as now), NVFP4A16 = c43's (gemm_nvfp4_grouped_128 in 64 x 64 warp
# tiles); full preset, 2K and 32K prompts (8,192-token steps), 1 and 32 sequences, two runs each.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds c42b
unpack_as N c43
exec > >(tee "$OUT/summary.txt") 2>&1
if synth_full; then
  t0=$SECONDS
  for i in 1 2; do BENCH_TIMEOUT=70 bench "fp8_$i" "$G/bench_full" "$C/full" --prompts 2048,32768 --batch 32 --max-batch-tokens 8192; done
  rm -rf "$C/full"
fi
echo "at ${SECONDS}s"
if synth_full_nvfp4; then
  t0=$SECONDS
  for i in 1 2; do
    [ $SECONDS -lt 500 ] || break
    BENCH_TIMEOUT=70 bench "nvfp4_$i" "$N/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --batch 32 --max-batch-tokens 8192
  done
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
