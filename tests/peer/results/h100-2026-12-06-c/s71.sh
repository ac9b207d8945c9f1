#!/usr/bin/env bash
# Thirty-fourth session, first call: the device sampler's candidate lists and the draw's prefix-sum block search (build samp, 0766919) against the
# landed 43e75ec (build base: bench only). Order: kernel tests (sampler, route); the shallow model
# tests on both exports (s70 of the thirty-third session); full FP8 preset: bench at 2K (1 / 8 /
# 32 / 64 sequences) base then samp; the 256-request batch file (samp); 261K (samp) if time is left.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds base; GB=$G
unpack_builds samp; GF=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
timeout 120 "$GF/kernels" --ignored --nocapture --test-threads=1 sample_ argmax_matches apply_penalties moe_route_sort_matches moe_sort_matches > "$L/kernels.log" 2>&1
echo "kernels rc=$? $((SECONDS - t0))s"; grep -E -A2 "panicked" "$L/kernels.log" | cut -c1-250 | head -8; grep -E "^PERF|^test .*(ok|FAILED)$|test result|draws identical" "$L/kernels.log" | cut -c1-200; t0=$SECONDS
"$GF/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 150 "$GF/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$L/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/test_shallow.log"; t0=$SECONDS
"$GF/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > /dev/null 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 150 "$GF/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$L/test_shallow_nvfp4.log" 2>&1
echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow_nvfp4.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/test_shallow_nvfp4.log"; t0=$SECONDS
synth_full || exit 1; t0=$SECONDS
bench() {  # NAME BIN MODEL PROMPTS BATCHES
  timeout 150 "$2" --model "$3" --prompts "$4" --batch "$5" --gen 16 > "/tmp/bench_$1.json" 2> "$L/bench_$1.err"
  echo "bench $1 --prompts $4 --batch $5 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+ |^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ " "$L/bench_$1.err" | cut -c1-110
}
bench base "$GB/bench_full" "$C/full" 2048 8,32,64
bench samp "$GF/bench_full" "$C/full" 2048 8,32,64
timeout 100 python3 tests/gpu/batch_file.py "$GF/ornith_full" "$C/full" "/tmp/batch_file.jsonl" 256
echo "batch file (default flags) rc=$? $((SECONDS - t0))s"; t0=$SECONDS
[ $SECONDS -lt 420 ] && bench long "$GF/bench_full" "$C/full" 261000 1
echo "total ${SECONDS}s"
