#!/usr/bin/env bash
# Forty-second session, call 1 (s99.sh of the forty-first, which never ran, with the RoPE step
# dropped — measured there — and the full budget's time guards). k_p2 / c41p2 = HEAD's kernels +
# BF16 (and NVFP4A16) prefill GEMM fragments promoted every second 64-element stage
# (s99_bf16_promote2.patch); k_baseb / b40base = HEAD's kernels.
#  1. Nsight Compute on HEAD's gemm_bf16, gemm_fp8 and gemm_fp8_grouped PERF launches: what bounds
#     the prefill GEMMs (45% of a 32K prefill) — issue, a stall, shared memory, L2;
#  2. the GEMM kernel tests of both builds (PERF, error figures); every gemm / moe test of k_p2;
#  3. full FP8 preset: bench base / p2 / base / p2 at 2K and 32K prompts;  4. shallow checks (p2).
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c41p2
unpack_as GB b40base
exec > >(tee "$L/summary.txt") 2>&1
unpack_as KB k_baseb; unpack_as KP k_p2
# 1. launches passed over: gemm_bf16 3 per checked shape (5 shapes), gemm_fp8 3 per shape (7),
# gemm_fp8_grouped 2 per moe_prefill call (3 checked cases + 3 warm-ups at 2K): the first timed
# 2K call's gate-up and down launches
bash tests/gpu/profile_kernels.sh k_baseb cuda::prefill_tests::gemm_bf16_matches_reference,gemm_bf16,15 \
    cuda::prefill_tests::gemm_fp8_matches_reference,gemm_fp8,21 \
    cuda::prefill_tests::moe_prefill_matches_reference,gemm_fp8_grouped,12,2
echo "at ${SECONDS}s"
T="gemm_fp8_matches_reference moe_prefill_matches_reference gemm_bf16_matches_reference"
for v in p2 base; do
  bin=$KB/kernels; [ $v = p2 ] && bin=$KP/kernels
  # shellcheck disable=SC2086
  kernel_tests $v "$bin" $T
  sed 's/^test [^ ]* \.\.\. //' "$OUT/kernels_${v}.log" | grep -oE "^(gemm_bf16|moe_prefill) [^:]*: max [^,]*, rel L2 [^,]*"
done
kernel_tests p2_gemm_moe "$KP/kernels" gemm moe --skip gemm_fp8_matches_reference --skip moe_prefill_matches_reference \
    --skip gemm_bf16_matches_reference
echo "at ${SECONDS}s"
if [ $SECONDS -lt 260 ] && synth_full; then
  t0=$SECONDS
  for i in 1 2; do
    BENCH_TIMEOUT=60 bench base_$i "$GB/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
    BENCH_TIMEOUT=60 bench p2_$i "$G/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
    [ $SECONDS -gt 420 ] && break
  done
  grep -h -E "^ +(gemm_bf16|gemm_fp8|gdn_chunk_scan) " "$OUT"/bench_base_1.err "$OUT"/bench_p2_1.err | cut -c1-100
  rm -rf "$C/full"
fi
echo "at ${SECONDS}s"
[ $SECONDS -lt 470 ] && shallow_checks "$G/test_shallow"
echo "total ${SECONDS}s"
# back: summary.txt, the three ncu details pages, everything else in logs.tar.xz (8 files at most)
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt ! -name 'ncuk_?.txt' -delete)
