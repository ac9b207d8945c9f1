#!/usr/bin/env bash
# Thirty-first session, call 2 (s65 = bd1a394 + the throughput front ends' default of up to 256
# sequences at once): batch invariance at 1..256 sequences (shallow FP8), the backend's log line
# and the 256-request batch file with no flags (the new defaults), ornith-bench at 2K
# batch 1 and 64 / 255 sequences.
set -uo pipefail
. tests/gpu/lib.sh
OUT0=$OUT; L=$OUT0/s65; mkdir -p $L; OUT=$L
unpack_builds s65
exec > >(tee "$L/summary.txt") 2>&1
save() { :; }  # logs are written under $OUT itself (a cut call still returns them)
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 200 "$G/test_shallow" --ignored --nocapture --test-threads=1 batch_invariance > "$L/test_shallow.log" 2>&1
echo "test_shallow batch_invariance rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow.log" | cut -c1-250 | head -4; grep -E "^batch invariance|test result" "$L/test_shallow.log" | grep -E "PDL weights|mixed|test result"; t0=$SECONDS
save
synth_full || { save; exit 1; }; t0=$SECONDS
"$G/ornith_full" --model "$C/full" --backend cuda < /dev/null 2>&1 | grep -E "sequences at once|error" | cut -c1-250
timeout 110 python3 tests/gpu/batch_file.py "$G/ornith_full" "$C/full" "$L/batch_file.jsonl" 256
echo "batch file (default flags) rc=$? $((SECONDS - t0))s"; t0=$SECONDS; rm -f "$L"/*.jsonl "$L"/bench.json; save
timeout 150 "$G/bench_full" --model "$C/full" --prompts 2048 --batch 64,255 --gen 16 --max-batch-tokens 8192 > "$L/bench.json" 2> "$L/bench.err"
echo "bench rc=$? $((SECONDS - t0))s"
grep -E "^ +(2048|32768) +[0-9.]+ +[0-9]+ |^ +(64|255) +[0-9.]+ +[0-9.]+ " "$L/bench.err" | cut -c1-130; grep -E "gdn_chunk_(prep|scan)" "$L/bench.err" | head -2; save
