#!/usr/bin/env bash
# NOTE: never ran — the device budget ran out after six refused starts (forty-first session); step 1b (ncu) and
# lib.sh's kernel_tests for its test runs came after.
# Forty-first session, call 2. k_p2 / c41p2 = HEAD + BF16 (and NVFP4A16) prefill GEMM fragments
# promoted every second 64-element stage instead of every stage (GB_BF16_PROMOTE 2); k_baseb / b40base = HEAD.
# In priority order, with time guards (little device time left):
#  1. the GEMM kernel tests of both (PERF, error figures);  2. every gemm / moe GPU kernel test of k_p2;
#  3. full FP8 preset: bench base / p2 at 2K and 32K prompts;  4. shallow FP8 model checks (p2);
#  5. RoPE tables against torch, full output.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c41p2
unpack_as GB b40base
exec > >(tee "$L/summary.txt") 2>&1
unpack_as KB k_baseb; unpack_as KP k_p2
T="gemm_fp8_matches_reference moe_prefill_matches_reference gemm_bf16_matches_reference"
for v in p2 base; do
  bin=$KB/kernels; [ $v = p2 ] && bin=$KP/kernels
  # shellcheck disable=SC2086
  kernel_tests $v "$bin" $T
  grep -oE "(gemm_bf16|moe_prefill) [^:]*: max [^,]*, rel L2 [^,]*" "$OUT/kernels_${v}.log"  # the error figures
done
# 1b. Nsight Compute on HEAD's gemm_bf16 and gemm_fp8 kernel tests, the first PERF launch of each
# (2048x2048 -> 8192, after 3 launches per checked shape: 5 shapes for gemm_bf16, 7 for gemm_fp8):
# what bounds the loop — issue, a stall, shared memory or L2
bash tests/gpu/profile_kernels.sh k_baseb cuda::prefill_tests::gemm_bf16_matches_reference,gemm_bf16,15 \
    cuda::prefill_tests::gemm_fp8_matches_reference,gemm_fp8,21
kernel_tests p2_gemm_moe "$KP/kernels" gemm moe --skip gemm_fp8_matches_reference --skip moe_prefill_matches_reference \
    --skip gemm_bf16_matches_reference
if [ $SECONDS -lt 110 ] && synth_full; then
  t0=$SECONDS
  BENCH_TIMEOUT=60 bench base_1 "$GB/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
  BENCH_TIMEOUT=60 bench p2_1 "$G/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
  grep -h -E "^ +(gemm_bf16|gdn_chunk_scan) " "$OUT"/bench_base_1.err "$OUT"/bench_p2_1.err | cut -c1-100
  rm -rf "$C/full"
fi
echo "at ${SECONDS}s"
[ $SECONDS -lt 140 ] && shallow_checks "$G/test_shallow"
[ $SECONDS -lt 175 ] && { ( nvcc -O3 -arch=sm_90 -o /tmp/rope_bin tests/peer/results/h100-2026-12-07/rope.cu && timeout 60 python3 tests/peer/results/h100-2026-12-07/rope.py 262144 ) > "$OUT/rope.txt" 2>&1; head -8 "$OUT/rope.txt"; }
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null; (cd "$OUT" && tar cJf logs.tar.xz *.log *.err *.txt 2>/dev/null; rm -f *.log *.err)
