#!/usr/bin/env bash
# Planned (twenty-seventh session), not run. Build: on HEAD `git apply
# tests/peer/results/h200-2026-12-05/s59_grouped_combine_noinline.patch`, `cargo xtask ptx`, then
# `tests/gpu/build.sh s59` (kernels, test_shallow, bench_full, ornith_full, xtask); carry .gpu/s59 and this script.
# 1. kernel tests moe (the grouped combine epilogue, now out of line, one copy of the tile) and the
#    shallow FP8 batch invariance with ORNITH_XGC=1 (the backend takes the epilogue); also
#    cuda_penalties (the twenty-eighth session's logprobs and grammar-masked rows on CUDA);
# 2. full FP8 preset, 2K prompts: 8 / 32 / 64 sequences without and with ORNITH_XGC=1 (does the
#    single-tile, out-of-line form keep the kernel's speed, and does the epilogue then pay?);
# 3. more sequences than ever measured: --batch 128,256 (MAX_DECODE_ROWS is 256; never benched);
# 4. the 256-request JSONL batch file at --max-seqs 64 (the default) and 256, --max-batch-tokens 8192.
set -uo pipefail
. tests/gpu/lib.sh
OUT0=$OUT; L=/tmp/s59; mkdir -p $L; OUT=$L
unpack_builds s59
exec > >(tee "$L/summary.txt") 2>&1
save() { tar czf "$OUT0/s59.tgz" -C /tmp s59; cp "$L/summary.txt" "$OUT0/summary.txt"; }
t0=$SECONDS
timeout 120 "$G/kernels" --ignored --test-threads=1 moe > "$L/kernels.log" 2>&1
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
python3 tests/peer/results/h200-2026-12-04/s57_table.py "$L"
for s in 64 256; do
  timeout 150 python3 tests/gpu/batch_file.py "$G/ornith_full" "$C/full" "/tmp/batch_file_$s.jsonl" 256 --max-seqs $s --max-batch-tokens 8192
  echo "batch file --max-seqs $s rc=$? $((SECONDS - t0))s"; t0=$SECONDS
done
save
