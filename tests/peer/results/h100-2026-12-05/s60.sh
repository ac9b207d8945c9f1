#!/usr/bin/env bash
# Thirtieth session, call 1 (s60 build): MoE blocks over several prefill chunks at once
# (`moe_segments`, scratch for --max-batch-tokens rows up to 8,192) and multi-chunk engine steps
# (27c84f7, never run on a device before), the GDN chunk scan on tensor cores (3xTF32), and as
# kernels_prep / bench_prep the same tree with gdn_chunk_prep's products on tensor cores and its
# inverse by 16-row blocks.
set -uo pipefail
. tests/gpu/lib.sh
OUT0=$OUT; L=/tmp/s60; mkdir -p $L; OUT=$L
unpack_builds s60
exec > >(tee "$L/summary.txt") 2>&1
save() { tar czf "$OUT0/s60.tgz" -C /tmp s60; cp "$L/summary.txt" "$OUT0/summary.txt"; }
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 150 "$G/test_shallow" --ignored --nocapture --test-threads=1 > "$L/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|batch invariance: mixed|prefix cache on|test result" "$L/test_shallow.log"; t0=$SECONDS
save
for k in kernels kernels_prep; do
  timeout 100 "$G/$k" --ignored --nocapture --test-threads=1 moe_prefill gdn_chunked > "$L/$k.log" 2>&1
  echo "$k moe_prefill gdn_chunked rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result|PERF|gdn_chunked t" "$L/$k.log" | cut -c1-160; t0=$SECONDS
  save
done
synth_full || { save; exit 1; }; t0=$SECONDS
timeout 80 "$G/bench_prep" --model "$C/full" --prompts 2048,32768 --gen 16 > "$L/bench_prep.json" 2> "$L/bench_prep.err"
echo "bench_prep rc=$? $((SECONDS - t0))s"; t0=$SECONDS
grep -E "^ +(2048|32768) |gdn_chunk|gemm_fp8_grouped" "$L/bench_prep.err" | cut -c1-120; save
run_bench() {
  timeout 110 "$G/bench_full" --model "$C/full" --prompts 2048,32768 --batch 64 --gen 16 --max-batch-tokens $1 > "$L/bench_m$1.json" 2> "$L/bench_m$1.err"
  echo "bench --max-batch-tokens $1 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +(2048|32768) |gdn_chunk|gemm_fp8_grouped|^ +64 +[0-9.]+ " "$L/bench_m$1.err" | cut -c1-120; save
}
run_batch() {
  timeout 120 python3 tests/gpu/batch_file.py "$G/ornith_full" "$C/full" "$L/batch_file_$1.jsonl" 256 --max-seqs 64 --max-batch-tokens $1
  echo "batch file --max-batch-tokens $1 rc=$? $((SECONDS - t0))s"; t0=$SECONDS; rm -f "$L"/*.jsonl; save
}
run_bench 8192; run_batch 8192; run_bench 2048
