#!/usr/bin/env bash
# Prepared for the next session (not run). First the NVFP4 and GEMM kernel tests of k43 (the
# 128-row grouped NVFP4 GEMM's zero-filled second scale word, committed after the last device call),
# then what bounds the 64-row grouped NVFP4 GEMM (issue 16's 2K prefill), instruction by
# instruction. k43 = the forty-third session's last kernels (.gpu/k43, built by that session;
# rebuild with tests/gpu/build.sh MODEL_TESTS=0 if absent). Nsight
# Compute with SourceCounters on the first launch of gemm_nvfp4_grouped (2,048 tokens, 64-row
# tiles) and of gemm_nvfp4_grouped_128 (the same launch in 128-row tiles), summarised by opcode
# (ncu_sass_summary.py): how the stall samples split between the dequantisation (LDG of the table,
# PRMT / LOP3 of fp4_word, STS) and the mma loop (LDSM, HMMA, FADD).
set -uo pipefail
. tests/gpu/lib.sh
exec > >(tee "$OUT/summary.txt") 2>&1
unpack_builds k43
kernel_tests k43 "$G/kernels" nvfp4 gemm_ moe_prefill | tail -4
T=cuda::nvfp4_tests::gemm_nvfp4_matches_reference
NCU_SOURCE=1 NCU_TAG=g64 NCU_TIMEOUT=150 bash tests/gpu/profile_kernels.sh k43 "$T,gemm_nvfp4_grouped,0"
NCU_SOURCE=1 NCU_TAG=g128 NCU_TIMEOUT=150 bash tests/gpu/profile_kernels.sh k43 "$T,gemm_nvfp4_grouped_128,0"
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
