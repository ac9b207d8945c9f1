#!/usr/bin/env bash
# Forty-second session: the prefill GEMMs. Builds (all HEAD 2c01cf2's code but for gemm_bf16):
#   k_baseb / b40base  HEAD's kernels (kernel tests / full-preset bench)
#   k_p2 / c41p2       BF16 fragments promoted every second stage (s99_bf16_promote2.patch)
#   k_w2 / bw2         gemm_bf16 in 64 x 64 warp tiles, 4 warps, 128 x 128 blocks, 3 stages,
#                      2 blocks/SM on sm_90 (s101_bf16_w64.patch with GBW_WN 2)
#   k_w4 / bw4         the same with 8 warps, 128 x 256 blocks, 2 stages, 1 block/SM (GBW_WN 4)
# The w forms consume a stage fragment by fragment with HEAD's promotion per fragment: the same
# bits as HEAD by construction (checked: same_bits).
#  1. GEMM kernel tests: base, w2, w4 (bits must equal base), p2 (error figures); all gemm/moe tests of w2, w4
#  2. full FP8 preset: bench base / w2 / w4 / p2 at 2K and 32K prompts, twice if time allows
#  3. Nsight Compute on HEAD's gemm_bf16, gemm_fp8 and gemm_fp8_grouped PERF launches and w2's gemm_bf16
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c41p2  # G: its xtask synthesises the preset
exec > >(tee "$L/summary.txt") 2>&1
unpack_as KB k_baseb; unpack_as KP k_p2; unpack_as KW2 k_w2; unpack_as KW4 k_w4
unpack_as B2 bw2; unpack_as B4 bw4; unpack_as GB b40base
T="gemm_fp8_matches_reference moe_prefill_matches_reference gemm_bf16_matches_reference"
# shellcheck disable=SC2086
kernel_tests base "$KB/kernels" $T
for v in w2 w4; do
  bin=$KW2/kernels; [ $v = w4 ] && bin=$KW4/kernels
  # shellcheck disable=SC2086
  kernel_tests $v "$bin" $T
  same_bits base $v
done
# shellcheck disable=SC2086
kernel_tests p2 "$KP/kernels" $T
for v in base p2; do
  sed 's/^test [^ ]* \.\.\. //' "$OUT/kernels_${v}.log" | grep -oE "^(gemm_bf16|moe_prefill) [^:]*: max [^,]*, rel L2 [^,]*"
done
for v in w2 w4; do
  bin=$KW2/kernels; [ $v = w4 ] && bin=$KW4/kernels
  kernel_tests ${v}_all "$bin" gemm moe --skip gemm_fp8_matches_reference --skip moe_prefill_matches_reference \
      --skip gemm_bf16_matches_reference | grep -E "rc=|test result"
done
echo "at ${SECONDS}s"
if [ $SECONDS -lt 200 ] && synth_full; then
  t0=$SECONDS
  for i in 1 2; do
    for v in base w2 w4 p2; do
      case $v in base) b=$GB/bench_full;; w2) b=$B2/bench_full;; w4) b=$B4/bench_full;; p2) b=$G/bench_full;; esac
      BENCH_TIMEOUT=50 bench ${v}_$i "$b" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
    done
    [ $SECONDS -gt 330 ] && break
  done
  grep -h -E "^ +(gemm_bf16|gemm_fp8|gemm_fp8_grouped) " "$OUT"/bench_base_1.err "$OUT"/bench_w2_1.err \
      "$OUT"/bench_w4_1.err | cut -c1-100
  rm -rf "$C/full"
fi
# 3. launches passed over: gemm_bf16 3 per checked shape (5 shapes), gemm_fp8 3 per shape (7),
# gemm_fp8_grouped 2 per moe_prefill call (3 checked cases + 3 warm-ups at 2K): the first timed
# 2K call's gate-up and down launches
export NCU_TIMEOUT=40  # a job (typically 15-30 s)
[ $SECONDS -lt 430 ] && bash tests/gpu/profile_kernels.sh k_baseb cuda::prefill_tests::gemm_bf16_matches_reference,gemm_bf16,15 \
    cuda::prefill_tests::gemm_fp8_matches_reference,gemm_fp8,21 \
    cuda::prefill_tests::moe_prefill_matches_reference,gemm_fp8_grouped,12,2
echo "at ${SECONDS}s"
# w2's gemm_bf16 under ncu (the same launch)
[ $SECONDS -lt 540 ] && NCU_TAG=ncuw2 bash tests/gpu/profile_kernels.sh k_w2 cuda::prefill_tests::gemm_bf16_matches_reference,gemm_bf16,15
echo "total ${SECONDS}s"
# back: summary.txt, the ncu details pages, everything else in logs.tar.xz (8 files at most)
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt ! -name 'ncu*_?.txt' -delete)
