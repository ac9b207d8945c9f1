#!/usr/bin/env bash
# Session 20, call D: the shared row quantiser (quant_row_256) in quantize_fp8_rows and the
# attention combine — the kernel tests that check both bit for bit.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s20d
t0=$SECONDS
timeout 100 "$G/kernels" --ignored --test-threads=1 --nocapture attention quant > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "^test |panicked|test result" "$OUT/kernels.log" | cut -c1-120
