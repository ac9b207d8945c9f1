#!/usr/bin/env bash
# Thirty-first session, call 1 (s64 = 51d8c56 + s63_blocked_inverse_only.patch): the GDN prep's
# (I + M)^-1 by 16-row blocks with the products kept in the reference's SIMT order — every
# shallow FP8 model test (row 0 bit-exact?) and the GDN kernel test's timing against HEAD's
# kernels (kernels_head), and the scan with the next chunk prefetched into L2 (kernels_pf); then the first figures above 64 sequences: the 256-request batch file
# at --max-seqs 256 / 64 / 128 and ornith-bench's batched decode at 128 and 255 sequences.
set -uo pipefail
. tests/gpu/lib.sh
OUT0=$OUT; L=/tmp/s64; mkdir -p $L; OUT=$L
unpack_builds s64
exec > >(tee "$L/summary.txt") 2>&1
save() { tar czf "$OUT0/s64.tgz" -C /tmp s64; cp "$L/summary.txt" "$OUT0/summary.txt"; }
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 150 "$G/test_shallow" --ignored --nocapture --test-threads=1 > "$L/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/test_shallow.log"; t0=$SECONDS
save
i=0
for k in kernels kernels_head kernels_pf kernels_pf kernels_head kernels; do
  i=$((i + 1)); timeout 60 "$G/$k" --ignored --nocapture --test-threads=1 gdn_chunked > "$L/$k.$i.log" 2>&1
  echo "$k gdn_chunked rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result|PERF|gdn_chunked t2048" "$L/$k.$i.log" | cut -c1-160; t0=$SECONDS
done
save
synth_full || { save; exit 1; }; t0=$SECONDS
run_batch() {  # MAX_SEQS
  timeout 110 python3 tests/gpu/batch_file.py "$G/ornith_full" "$C/full" "$L/batch_file_$1.jsonl" 256 --max-seqs $1 --max-batch-tokens 8192
  echo "batch file --max-seqs $1 rc=$? $((SECONDS - t0))s"; t0=$SECONDS; rm -f "$L"/*.jsonl; save
}
run_batch 256; run_batch 64
timeout 120 "$G/bench_full" --model "$C/full" --prompts 2048 --batch 128,255 --gen 16 --max-batch-tokens 8192 > "$L/bench.json" 2> "$L/bench.err"
echo "bench --batch 128,255 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
grep -E "^ +2048 |^ +(128|255) +[0-9.]+ |moe_gemv_grouped|gdn_recurrent|gemv_bf16_wide" "$L/bench.err" | cut -c1-120; save
run_batch 128
