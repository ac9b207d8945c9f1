#!/usr/bin/env bash
# Session 24, call E (builds .gpu/s24e = 8690549, the review refactor of the one-row FP8 launchers):
# the kernel tests of the quantisation prologue, the norm prologues and the decode attention.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s24e
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
timeout 90 "$G/kernels" --ignored --test-threads=1 --nocapture gemv_fp8_quant norm_prologue attention_decode > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result|^test " "$OUT/kernels.log" | cut -c1-250
