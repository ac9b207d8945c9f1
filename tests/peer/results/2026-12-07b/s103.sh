#!/usr/bin/env bash
# Forty-second session, call 3 (little budget left). c42b = a33ec89 (both new GEMM forms): the
# shallow FP8 model checks (the grouped FP8 GEMM's first run inside the model), then the full
# preset's prefill in both exports in one call (issue 16's prefill ratio with the new kernels).
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c42b
exec > >(tee "$L/summary.txt") 2>&1
shallow_checks "$G/test_shallow"
echo "at ${SECONDS}s"
if [ $SECONDS -lt 90 ] && synth_full; then
  t0=$SECONDS
  BENCH_TIMEOUT=40 bench fp8 "$G/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
  rm -rf "$C/full"
  if [ $SECONDS -lt 100 ] && synth_full_nvfp4; then
    t0=$SECONDS
    BENCH_TIMEOUT=40 bench nvfp4 "$G/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
  fi
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete)
