#!/usr/bin/env bash
# Session 24, call D (builds .gpu/s24d = the committed gemv_fp8_quant, its test's third shape now a
# valid FP8 row (4,368: > 16 x 256, a multiple of 16; call C's 5,000 failed gemv_fp8's own check)):
# the kernel tests of the quantisation prologue, the norm prologues and the decode attention.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s24d
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
timeout 90 "$G/kernels" --ignored --test-threads=1 --nocapture gemv_fp8_quant norm_prologue attention_decode > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result|^test " "$OUT/kernels.log" | cut -c1-250
