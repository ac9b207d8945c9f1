#!/usr/bin/env bash
# Twenty-ninth session, call 1 (s59 build: c8dfed3 + s59_grouped_combine_noinline.patch).
set -uo pipefail
. tests/gpu/lib.sh
OUT0=$OUT; L=/tmp/s59; mkdir -p $L; OUT=$L
unpack_builds s59
exec > >(tee "$L/summary.txt") 2>&1
save() { tar czf "$OUT0/s59.tgz" -C /tmp s59; cp "$L/summary.txt" "$OUT0/summary.txt"; }
t0=$SECONDS
timeout 200 "$G/kernels" --ignored --test-threads=1 moe gemm_ > "$L/kernels.log" 2>&1
echo "kernels rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$L/kernels.log" | cut -c1-200; t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_XGC=1 ORNITH_TEST_MODEL=$C/shallow timeout 120 "$G/test_shallow" --ignored --nocapture --test-threads=1 batch_invariance cuda_decode_graph_matches_eager cuda_penalties > "$L/test_shallow_xgc.log" 2>&1
echo "test_shallow xgc rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow_xgc.log" | cut -c1-250 | head -4; grep -E "test result" "$L/test_shallow_xgc.log"; t0=$SECONDS
save
synth_full; t0=$SECONDS
for v in base xgc; do
  env $([ $v = xgc ] && echo ORNITH_XGC=1 || echo X=1) timeout 120 "$G/bench_full" --model "$C/full" --prompts --batch 8,32,64 --gen 64 --budget-s 100 > "$L/bench_$v.json" 2> "$L/bench_$v.err"
  echo "bench $v rc=$? $((SECONDS - t0))s"; t0=$SECONDS; save
done
timeout 150 "$G/bench_full" --model "$C/full" --prompts --batch 128,256 --gen 32 --budget-s 120 > "$L/bench_wide.json" 2> "$L/bench_wide.err"
echo "bench 128,256 rc=$? $((SECONDS - t0))s"; t0=$SECONDS; save
python3 tests/peer/results/h200-2026-12-04/s57_table.py "$L" 2>&1 | tail -20
save
