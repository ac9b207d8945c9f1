#!/usr/bin/env bash
# Forty-third session, call B (kernel tests only). k_f0 = HEAD's kernels (fa3d67e) with the NVFP4
# GEMM test printing its outputs' digests (grouped: rows sorted inside each expert's group, as
# moe_sort's atomics order them freely); k_f1 = gemm_nvfp4_body dequantising after the mma (s105);
# k_f2 = the same with the next stage's dequantisation between the row tiles' mma for gemm_nvfp4
# and gemm_nvfp4_grouped (gemm_nvfp4_grouped_128 after the mma). Then ncu of the grouped 64-row
# GEMM (2,048 tokens) in k_f0 and k_f2.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds k_f0
K0=$G
unpack_as K1 k_f1
unpack_as K2 k_f2
exec > >(tee "$OUT/summary.txt") 2>&1
kernel_tests f0 "$K0/kernels" gemm_nvfp4_matches_reference
kernel_tests f1 "$K1/kernels" gemm_nvfp4_matches_reference
kernel_tests f2 "$K2/kernels" gemm_nvfp4_matches_reference
same_bits f0 f2
kernel_tests f2n "$K2/kernels" nvfp4 --skip gemm_nvfp4_matches_reference | tail -3
echo "at ${SECONDS}s"
T=cuda::nvfp4_tests::gemm_nvfp4_matches_reference
NCU_TAG=f0 NCU_TIMEOUT=100 bash tests/gpu/profile_kernels.sh k_f0 "$T,gemm_nvfp4_grouped,0" | grep -v "^commit\|^NVIDIA"
NCU_TAG=f2 NCU_TIMEOUT=100 bash tests/gpu/profile_kernels.sh k_f2 "$T,gemm_nvfp4_grouped,0" | grep -v "^commit\|^NVIDIA"
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
