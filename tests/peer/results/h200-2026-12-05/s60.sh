#!/usr/bin/env bash
# Twenty-ninth session, call 2 (s60 build): MoE blocks over several prefill chunks at once
# (`moe_segments`, scratch for --max-batch-tokens rows up to 8,192) and multi-chunk engine steps.
set -uo pipefail
. tests/gpu/lib.sh
OUT0=$OUT; L=/tmp/s60; mkdir -p $L; OUT=$L
unpack_builds s60
exec > >(tee "$L/summary.txt") 2>&1
save() { tar czf "$OUT0/s60.tgz" -C /tmp s60; cp "$L/summary.txt" "$OUT0/summary.txt"; }
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 150 "$G/test_shallow" --ignored --nocapture --test-threads=1 batch_invariance prefix_cache_resume_matches_cold > "$L/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow.log" | cut -c1-250 | head -4; grep -E "batch invariance: mixed|prefix cache on|test result" "$L/test_shallow.log"; t0=$SECONDS
save
timeout 100 "$G/kernels" --ignored --nocapture --test-threads=1 moe_prefill > "$L/kernels.log" 2>&1
echo "kernels moe_prefill rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result|PERF|max \|d\|" "$L/kernels.log" | cut -c1-200; t0=$SECONDS
save
synth_full || { save; exit 1; }; t0=$SECONDS
for m in 8192; do
  timeout 110 "$G/bench_full" --model "$C/full" --prompts 32768 --batch 64 --gen 16 --max-batch-tokens $m > "$L/bench_m$m.json" 2> "$L/bench_m$m.err"
  echo "bench --max-batch-tokens $m rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +(2048|32768) " "$L/bench_m$m.err" | cut -c1-120; grep -E "^ +(8|64) +[0-9.]+ " "$L/bench_m$m.err" | head -2 | cut -c1-100
  save
done
for m in 8192; do
  timeout 120 python3 tests/gpu/batch_file.py "$G/ornith_full" "$C/full" "$L/batch_file_$m.jsonl" 256 --max-seqs 64 --max-batch-tokens $m
  echo "batch file --max-batch-tokens $m rc=$? $((SECONDS - t0))s"; t0=$SECONDS; rm -f "$L"/*.jsonl; save
done
