#!/usr/bin/env bash
# Forty-third session, call A. k_f0 = HEAD's kernels (fa3d67e) with the NVFP4 GEMM test printing
# its outputs' digests; k_f1 = the NVFP4 GEMMs rebuilt on four warps of 64 x 64 / 64 x 32 with the
# raw weight stage through shared memory (gemm_nvfp4_body). Then a33ec89's (c42b) shallow FP8 model
# checks, which the forty-second session could not run.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds c42b
unpack_as K0 k_f0
unpack_as K1 k_f1
exec > >(tee "$OUT/summary.txt") 2>&1
kernel_tests f0 "$K0/kernels" gemm_nvfp4_matches_reference
kernel_tests f1 "$K1/kernels" gemm_nvfp4_matches_reference
same_bits f0 f1
kernel_tests f1n "$K1/kernels" nvfp4 --skip gemm_nvfp4_matches_reference | tail -3
echo "at ${SECONDS}s"
shallow_checks "$G/test_shallow"
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
