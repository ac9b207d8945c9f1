#!/usr/bin/env bash
# Forty-third session, call F (kernel tests only). k_f6 = 8fee657 with one stage consumer and one
# epilogue (bf16_stage_64x64, store_64x64) shared by gemm_bf16_body and gemm_nvfp4_body, whose SASS
# then differs slightly from 8fee657's (epilogue PRMTs, register names); k_f0 = fa3d67e's kernels.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds k_f0
K0=$G
unpack_as K6 k_f6
exec > >(tee "$OUT/summary.txt") 2>&1
T="gemm_bf16_matches_reference gemm_nvfp4_matches_reference"
kernel_tests f0 "$K0/kernels" $T
kernel_tests f6 "$K6/kernels" $T
same_bits f0 f6
kernel_tests f0b "$K0/kernels" $T > /dev/null
kernel_tests f6b "$K6/kernels" $T
grep PERF "$OUT/kernels_f0b.log" | sed 's/.*PERF/f0b PERF/' | cut -c1-120
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
