#!/usr/bin/env bash
# Session 22, call E (dcea40b, the committed NVFP4 kernels): every NVFP4 kernel test and the
# shallow NVFP4A16 model checks (graph = eager, CUDA vs CPU, batch invariance 1-40 sequences,
# whose groups from 8 rows on run the grouped product).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s22e
t0=$SECONDS
timeout 120 "$G/kernels" --ignored --test-threads=1 --nocapture nvfp4 > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result" "$OUT/kernels.log" | cut -c1-200
t0=$SECONDS
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > "$OUT/synth_shallow.log" 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 120 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow.log" 2>&1
echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"
grep -E "decode graph|batch invariance|panicked|test result" "$OUT/test_shallow.log" | cut -c1-200 | head -12
