#!/usr/bin/env bash
# Prepared for the next session's full budget (not run). c42b = a33ec89 (both new GEMM forms):
#  1. shallow FP8 model checks (the grouped FP8 GEMM's first run inside the model);
#  2. full preset, FP8 then NVFP4A16: bench at 2K / 32K (issue 16's prefill ratio with the new
#     kernels), then Nsight Compute on the batch-1 2K prefill's GEMMs — the NVFP4 ones (what bounds
#     them: the dequantisation or the mma loop) and the new gemm_fp8_grouped.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c42b
exec > >(tee "$L/summary.txt") 2>&1
shallow_checks "$G/test_shallow"
echo "at ${SECONDS}s"
if synth_full; then
  t0=$SECONDS
  BENCH_TIMEOUT=60 bench fp8 "$G/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
  NCU_TIMEOUT=120 bash tests/gpu/profile.sh c42b '1:^gemm_fp8_grouped$:2' | grep -v "^commit\|^NVIDIA\|^synth"
  mkdir -p "$OUT/fp8" && mv "$OUT"/ncu_* "$OUT/fp8/" 2>/dev/null
  rm -rf "$C/full"
fi
echo "at ${SECONDS}s"
if synth_full_nvfp4; then
  t0=$SECONDS
  BENCH_TIMEOUT=60 bench nvfp4 "$G/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
  EXPORT=nvfp4 bash tests/gpu/profile.sh c42b '1:^gemm_nvfp4_grouped$:2' '1:^gemm_nvfp4$:2' | grep -v "^commit\|^NVIDIA\|^synth"
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
