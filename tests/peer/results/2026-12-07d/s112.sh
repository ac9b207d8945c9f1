#!/usr/bin/env bash
# Forty-fourth session, call A (s111 and s109 in one call): k43's NVFP4 / GEMM / MoE-prefill kernel
# tests (the 128-row grouped NVFP4 GEMM's zero-filled second scale word, never yet run), then
# issue 16's ratios on this call's card (FP8 = c42b's bench_full, NVFP4A16 = c43's; full preset,
# 2K and 32K prompts in 8,192-token steps, 1 and 32 sequences), then, time permitting, Nsight
# Compute SourceCounters of the 64-row and 128-row grouped NVFP4 GEMMs at 2,048 tokens.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds c42b
unpack_as N c43
exec > >(tee "$OUT/summary.txt") 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
unpack_as K k43
kernel_tests k43 "$K/kernels" nvfp4 gemm_ moe_prefill | tail -4
echo "at ${SECONDS}s"
if synth_full; then
  for i in 1 2; do BENCH_TIMEOUT=70 bench "fp8_$i" "$G/bench_full" "$C/full" --prompts 2048,32768 --batch 32 --max-batch-tokens 8192; done
  rm -rf "$C/full"
fi
echo "at ${SECONDS}s"
if synth_full_nvfp4; then
  for i in 1 2; do
    [ $SECONDS -lt 420 ] || break
    BENCH_TIMEOUT=70 bench "nvfp4_$i" "$N/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --batch 32 --max-batch-tokens 8192
  done
  rm -rf "$C/full-nvfp4"
fi
echo "at ${SECONDS}s"
T=cuda::nvfp4_tests::gemm_nvfp4_matches_reference
if [ $SECONDS -lt 430 ]; then
  NCU_SOURCE=1 NCU_TAG=g64 NCU_TIMEOUT=70 bash tests/gpu/profile_kernels.sh k43 "$T,gemm_nvfp4_grouped,0"
fi
if [ $SECONDS -lt 510 ]; then
  NCU_SOURCE=1 NCU_TAG=g128 NCU_TIMEOUT=70 bash tests/gpu/profile_kernels.sh k43 "$T,gemm_nvfp4_grouped_128,0"
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
