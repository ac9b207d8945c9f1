#!/usr/bin/env bash
# Thirty-third session. Builds: base = HEAD c6bb4d6; route = HEAD + moe_route_sort (a decode group's
# router top-k and expert sort in one launch, up to 32 rows); ms64 / ms128 = route with the decode
# attention's shortest split (plan::MIN_SPLIT) 64 / 128 keys instead of 32 (bench only).
# Order: route kernel tests; full preset: bench base / route / ms64 / ms128 at 2K, 8 / 32 / 64
# sequences; route shallow model tests (graph = eager, CPU, ops, batch invariance); base at 32K and
# 128K (one sequence) if time is left.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds route; GR=$G; unpack_builds ms64; G64=$G; unpack_builds ms128; G128=$G; unpack_builds base; GB=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
timeout 100 "$GR/kernels" --ignored --nocapture --test-threads=1 moe_route_sort_matches moe_sort_matches moe_decode > "$L/kernels_route.log" 2>&1
echo "kernels_route rc=$? $((SECONDS - t0))s"; grep -E -A2 "panicked" "$L/kernels_route.log" | cut -c1-250 | head -8; grep -E "^PERF|^test .*(ok|FAILED)$|test result" "$L/kernels_route.log" | cut -c1-200; t0=$SECONDS
G=$GB; synth_full || exit 1; t0=$SECONDS
bench() {  # NAME BIN PROMPTS BATCHES
  timeout 120 "$2" --model "$C/full" --prompts "$3" --batch "$4" --gen 16 > "/tmp/bench_$1.json" 2> "$L/bench_$1.err"
  echo "bench $1 --prompts $3 --batch $4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+ |^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ " "$L/bench_$1.err" | cut -c1-110
}
bench base "$GB/bench_full" 2048 8,32,64
bench route "$GR/bench_full" 2048 8,32,64
bench ms64 "$G64/bench_full" 2048 8,32,64
bench ms128 "$G128/bench_full" 2048 8,32,64
"$GB/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 180 "$GR/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu cuda_ops_vs_cpu batch_invariance > "$L/test_shallow_route.log" 2>&1
echo "test_shallow_route rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow_route.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/test_shallow_route.log"; t0=$SECONDS
rm -rf "$C/shallow"
[ $SECONDS -lt 470 ] && bench long "$GB/bench_full" 32768,131072 1
echo "total ${SECONDS}s"
