#!/usr/bin/env bash
# Forty-third session, call D. k_f5 / c43 = gemm_nvfp4_grouped_128 in four warps of 64 x 64 with
# the raw weight stage through shared memory (gemm_nvfp4_body), the other GEMMs as HEAD (fa3d67e).
#  1. kernel tests: the NVFP4 GEMM test in k_f0 (HEAD's kernels) and k_f5, digests compared; the
#     other NVFP4 and GEMM kernel tests in k_f5;
#  2. the shallow NVFP4A16 model checks with c43's test_shallow_nvfp4;
#  3. the full NVFP4A16 preset: bench at 2K / 32K (8,192-token steps: the 128-row form) with
#     c42b's bench (HEAD's NVFP4 kernels) and c43's, alternating.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds c42b
unpack_as K0 k_f0
unpack_as K5 k_f5
unpack_as N c43
exec > >(tee "$OUT/summary.txt") 2>&1
kernel_tests f0 "$K0/kernels" gemm_nvfp4_matches_reference
kernel_tests f5 "$K5/kernels" gemm_nvfp4_matches_reference
same_bits f0 f5
kernel_tests f5n "$K5/kernels" nvfp4 gemm_ moe_prefill --skip gemm_nvfp4_matches_reference | tail -3
echo "at ${SECONDS}s"
shallow_checks "$N/test_shallow_nvfp4" nvfp4
echo "at ${SECONDS}s"
if synth_full_nvfp4; then
  t0=$SECONDS
  for v in old new old new; do
    b=$G/bench_full_nvfp4; [ $v = new ] && b=$N/bench_full_nvfp4
    [ $SECONDS -lt 520 ] || break
    BENCH_TIMEOUT=60 bench "nvfp4_$v" "$b" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
  done
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
