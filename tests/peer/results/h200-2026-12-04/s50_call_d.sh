#!/usr/bin/env bash
# Session 23, call D (builds .gpu/s23c = a70452c): the shallow NVFP4A16 and FP8 model checks again
# (call C's logs of them did not come back), each summary line kept in $OUT/summary.txt.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s23c
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > /dev/null 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 100 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow_nvfp4.log" 2>&1
echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"; grep -E "^test |panicked|test result" "$OUT/test_shallow_nvfp4.log" | cut -c1-200 | head -8; t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow fp8 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 120 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu cuda_ops_vs_cpu batch_invariance > "$OUT/test_shallow_fp8.log" 2>&1
echo "test_shallow fp8 rc=$? $((SECONDS - t0))s"; grep -E "^test |panicked|test result" "$OUT/test_shallow_fp8.log" | cut -c1-200 | head -8
