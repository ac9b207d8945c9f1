#!/usr/bin/env bash
# Thirty-eighth session, call B: cuda_matches_cpu_at_length on the shallow NVFP4A16 export (m38b;
# its GEMM change keeps every kept row's bits, so the numerics are HEAD's), then the full FP8 synth timed.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds m38b; M=$G
unpack_builds g38t
exec > >(tee "$L/summary_b.txt") 2>&1
t0=$SECONDS
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > "$OUT/synth_shallow_nvfp4.log" 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"
ORNITH_TEST_MODEL=$C/shallow-nvfp4 ORNITH_LONG=16421 timeout 330 "$M/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 --exact cuda_matches_cpu_at_length > "$OUT/test_long_nvfp4.log" 2>&1
echo "cuda_matches_cpu_at_length nvfp4 rc=$? $((SECONDS - t0))s"
grep -E "prefill in pieces|two piece cuts|^  to|decode|tolerance|panicked|test result" "$OUT/test_long_nvfp4.log" | cut -c1-300
rm -rf "$C/shallow-nvfp4"
[ $SECONDS -gt 400 ] && { echo "skip synth (time) ${SECONDS}s"; exit 0; }
timeout $((560 - SECONDS)) bash -c ". tests/gpu/lib.sh; G=$G; C=$C; OUT=$OUT; src=.gpu/g38t; synth_full"
echo "total ${SECONDS}s"
