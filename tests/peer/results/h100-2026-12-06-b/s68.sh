#!/usr/bin/env bash
# Thirty-third session, second call. Builds: r8 = moe_route_sort up to 8 rows (afb321f); early =
# r8 + the grouped down product reading its expert lists before its PDL wait (swiglu_quant waits
# before its trigger; ed9507b); early16 = early with moe_route_sort up to 16 rows (bench only).
# Order: early kernel tests; full preset: bench r8 / early / early16 at 2K, 8 / 16 / 32 sequences;
# early shallow model tests (graph = eager, CPU, ops, batch invariance); r8 / early at 64 / 128.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds early; GE=$G; unpack_builds early16; G16=$G; unpack_builds r8; GR=$G; unpack_builds base; GB=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
timeout 100 "$GE/kernels" --ignored --nocapture --test-threads=1 moe_route_sort_matches moe_decode swiglu_prologue > "$L/kernels_early.log" 2>&1
echo "kernels_early rc=$? $((SECONDS - t0))s"; grep -E -A2 "panicked" "$L/kernels_early.log" | cut -c1-250 | head -8; grep -E "^test .*(ok|FAILED)$|test result" "$L/kernels_early.log" | cut -c1-200; t0=$SECONDS
G=$GB; synth_full || exit 1; t0=$SECONDS
bench() {  # NAME BIN PROMPTS BATCHES
  timeout 120 "$2" --model "$C/full" --prompts "$3" --batch "$4" --gen 16 > "/tmp/bench_$1.json" 2> "$L/bench_$1.err"
  echo "bench $1 --prompts $3 --batch $4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+ |^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ " "$L/bench_$1.err" | cut -c1-110
}
bench r8 "$GR/bench_full" 2048 8,16,32
bench early "$GE/bench_full" 2048 8,16,32
bench early16 "$G16/bench_full" 2048 8,16,32
"$GB/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 180 "$GE/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu cuda_ops_vs_cpu batch_invariance > "$L/test_shallow_early.log" 2>&1
echo "test_shallow_early rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow_early.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/test_shallow_early.log"; t0=$SECONDS
rm -rf "$C/shallow"
[ $SECONDS -lt 440 ] && bench r8_big "$GR/bench_full" 2048 64,128
[ $SECONDS -lt 510 ] && bench early_big "$GE/bench_full" 2048 64,128
echo "total ${SECONDS}s"
