#!/usr/bin/env bash
# Forty-fifth session, call A. Builds (x86 host, not committed; tree = b96f7d0 + the two changes):
#   k45t  kernel tests with gemm_fp8_grouped_96 (next_fp8_grouped_96.patch) and the NVFP4 96/128-row
#         forms' table entries by cp.async before the mma (nvfp4_tab.patch)
#   k44   the landed kernels (e38041b: same NVFP4 body as HEAD) for the NVFP4 timings beside k45t's
#   f45base / f45   FP8 model binaries at b96f7d0 / with both changes
#   n44 / n45t      NVFP4A16 model binaries at e38041b (HEAD's rule at 2K) / with both changes
#   x45 = c42b's xtask only (the synthesis)
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds x45
unpack_as FB sf45base
unpack_as FN sf45
unpack_as NB sn44
unpack_as NN sn45t
unpack_as KN k45t
unpack_as KB k44
exec > >(tee "$OUT/summary.txt") 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
kernel_tests k45ta "$KN/kernels" nvfp4 | grep -E "grouped 2048|grouped 8192|rc=|result"
# (dropped after failed starts) kernel_tests k44a "$KB/kernels" nvfp4 | grep -E "grouped 2048|grouped 8192|rc=|result"
kernel_tests k45tb "$KN/kernels" moe_prefill gemm_fp8 moe_sort | tail -12
echo "at ${SECONDS}s"
if synth_full; then
  for i in 1 2; do
    [ $SECONDS -lt 250 ] || break
    BENCH_TIMEOUT=150 bench "fb_$i" "$FB/bench_full" "$C/full" --prompts 2048
    BENCH_TIMEOUT=150 bench "fn_$i" "$FN/bench_full" "$C/full" --prompts 2048
  done
  rm -rf "$C/full"
fi
echo "at ${SECONDS}s"
if synth_full_nvfp4; then
  for i in 1 2; do
    [ $SECONDS -lt 330 ] || break
    BENCH_TIMEOUT=120 bench "nb_$i" "$NB/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
    BENCH_TIMEOUT=120 bench "nn_$i" "$NN/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
  done
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
