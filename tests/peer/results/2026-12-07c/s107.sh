#!/usr/bin/env bash
# Forty-third session, call C (kernel tests only). k_f0 = HEAD's kernels (fa3d67e); k_f3 / k_f4 =
# gemm_nvfp4_body with the raw stage laid out part by part (codes of groups 0-1, of groups 2-3,
# scale words, table word: consecutive rows in consecutive words, no bank conflicts; the second
# scale copy only where the bytes straddle a word), gemm_nvfp4 and gemm_nvfp4_grouped_128
# dequantising after the mma; gemm_nvfp4_grouped between the row tiles' mma (k_f3) or after (k_f4).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds k_f0
K0=$G
unpack_as K3 k_f3
unpack_as K4 k_f4
exec > >(tee "$OUT/summary.txt") 2>&1
kernel_tests f0 "$K0/kernels" gemm_nvfp4_matches_reference
kernel_tests f3 "$K3/kernels" gemm_nvfp4_matches_reference
kernel_tests f4 "$K4/kernels" gemm_nvfp4_matches_reference
same_bits f0 f3
same_bits f0 f4
kernel_tests f3n "$K3/kernels" nvfp4 --skip gemm_nvfp4_matches_reference | tail -3
echo "at ${SECONDS}s"
T=cuda::nvfp4_tests::gemm_nvfp4_matches_reference
NCU_TAG=f3 NCU_TIMEOUT=100 bash tests/gpu/profile_kernels.sh k_f3 "$T,gemm_nvfp4_grouped,0" | grep -v "^commit\|^NVIDIA"
NCU_TAG=f4 NCU_TIMEOUT=100 bash tests/gpu/profile_kernels.sh k_f4 "$T,gemm_nvfp4_grouped,0" | grep -v "^commit\|^NVIDIA"
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
