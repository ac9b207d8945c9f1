#!/usr/bin/env bash
# Thirty-second session, one call. Builds: s66 = HEAD 3dd7ff1 (bench, binary, xtask; f57b9c1's
# decode rows outside --max-batch-tokens never measured); s66v = HEAD + V1 (split decode products
# above 64 tokens through the staged build); s66b = V1 + V3a (the grouped MoE decode product's
# routed block rows in passes of 16 tokens while more than 8 remain).
# Order: s66b kernel tests; full preset: bench s66b and HEAD at 2K (8 / 128 / 255 sequences; the
# per-kernel tables attribute V1 / V3a); the 256-request batch file with HEAD's defaults; s66b
# shallow batch invariance.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds s66b; GB=$G; unpack_builds s66; GH=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
timeout 100 "$GB/kernels" --ignored --nocapture --test-threads=1 moe_decode_matches gemv_bf16_matches gemv_fp8_matches moe_sort_matches > "$L/kernels_b.log" 2>&1
echo "kernels_b rc=$? $((SECONDS - t0))s"; grep -E -A2 "panicked" "$L/kernels_b.log" | cut -c1-250 | head -8; grep -E "^test .*(ok|FAILED)$|test result" "$L/kernels_b.log" | cut -c1-200; t0=$SECONDS
G=$GH; synth_full || exit 1; t0=$SECONDS
bench() {  # NAME BIN BATCHES
  timeout 150 "$2" --model "$C/full" --prompts 2048 --batch "$3" --gen 16 > "/tmp/bench_$1.json" 2> "$L/bench_$1.err"
  echo "bench $1 --batch $3 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +2048 +[0-9.]+ +[0-9]+ |^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ " "$L/bench_$1.err" | cut -c1-110
}
bench b "$GB/bench_full" 128,255
bench head "$GH/bench_full" 128,255
timeout 100 python3 tests/gpu/batch_file.py "$GH/ornith_full" "$C/full" "/tmp/batch_file.jsonl" 256
echo "batch file (HEAD, default flags) rc=$? $((SECONDS - t0))s"; t0=$SECONDS
bench b8 "$GB/bench_full" 8
bench head8 "$GH/bench_full" 8
"$GH/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 120 "$GB/test_shallow" --ignored --nocapture --test-threads=1 batch_invariance > "$L/test_shallow_b.log" 2>&1
echo "test_shallow_b batch_invariance rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow_b.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/test_shallow_b.log"; t0=$SECONDS
rm -rf "$C/shallow"
