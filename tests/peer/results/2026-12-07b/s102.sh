#!/usr/bin/env bash
# Forty-second session, call 2. c42 = 28f7f4b (gemm_bf16 in 64 x 64 warp tiles, landed): its model
# checks, kernel tests, bench and the batch file. k_g4 / bg4 = 28f7f4b + s102_fp8_grouped_g4.patch
# (gemm_fp8_grouped in 64 x 32 warp tiles, 4 warps, a stage consumed fragment by fragment with the
# B fragments unpacked once: 1.5 E4M3 unpacks per HMMA instead of 2; HEAD's bits by construction).
#  1. kernel tests: gemm/moe of k_baseb (41ec81d), c42, k_g4: c42 and g4 bits = base; g4's other gemm/moe tests
#  2. shallow FP8 model checks of c42 (graph = eager, CUDA vs CPU, batch invariance)
#  3. full FP8 preset: bench c42 / g4 at 2K and 32K, two rounds; the 256-request batch file (c42)
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c42
exec > >(tee "$L/summary.txt") 2>&1
unpack_as KB k_baseb; unpack_as KG k_g4; unpack_as BG bg4
T="gemm_fp8_matches_reference moe_prefill_matches_reference gemm_bf16_matches_reference"
# shellcheck disable=SC2086
kernel_tests base "$KB/kernels" $T
# shellcheck disable=SC2086
kernel_tests c42 "$G/kernels" $T; same_bits base c42
# shellcheck disable=SC2086
kernel_tests g4 "$KG/kernels" $T; same_bits base g4
kernel_tests g4_all "$KG/kernels" gemm moe --skip gemm_fp8_matches_reference --skip moe_prefill_matches_reference \
    --skip gemm_bf16_matches_reference | grep -E "rc=|test result"
echo "at ${SECONDS}s"
shallow_checks "$G/test_shallow"
echo "at ${SECONDS}s"
if [ $SECONDS -lt 260 ] && synth_full; then
  t0=$SECONDS
  for i in 1 2; do
    BENCH_TIMEOUT=50 bench c42_$i "$G/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
    BENCH_TIMEOUT=50 bench g4_$i "$BG/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
  done
  grep -h -E "^ +(gemm_bf16|gemm_fp8|gemm_fp8_grouped) " "$OUT"/bench_c42_1.err "$OUT"/bench_g4_1.err | cut -c1-100
  echo "at ${SECONDS}s"
  [ $SECONDS -lt 420 ] && timeout 100 python3 tests/gpu/batch_file.py "$G/ornith_full" "$C/full" /tmp/batch_fp8.jsonl 256
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete)
