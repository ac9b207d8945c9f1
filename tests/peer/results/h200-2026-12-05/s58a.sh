#!/usr/bin/env bash
# Session 25 plan, call A. Build: on HEAD (or a555aaf) `git apply tests/peer/results/h200-2026-12-04/s57_moe_variants.patch`, `cargo xtask ptx`,
# then NVFP4=1 tests/gpu/build.sh s25a (kernels, test_shallow[_nvfp4], bench_full[_nvfp4], xtask); carry .gpu/s25a and this script.
# correctness of the experiment variants, then the NVFP4A16 full preset at 2K batch 1 with and without "ei".
#  - kernel tests nvfp4 / norm_prologue / swiglu_prologue / moe (750a70b's fp4_params review: first GPU run) / apply_penalties (54cf17b: first GPU run);
#  - the moe kernel tests again under ORNITH_XMOE=ei,gei and =eid4 and =nd4 (bit-identical to the reference forms);
#  - shallow FP8 and NVFP4A16 model checks (graph = eager, CUDA vs CPU, batch invariance) under ORNITH_XMOE=ei,gei
#    (gei: the grouped FP8 pair from 4 rows on, the same reordering):
#    the early routed index of the down product is a PDL ordering change, which only the model tests exercise.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s25a
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
timeout 120 "$G/kernels" --ignored --test-threads=1 nvfp4 norm_prologue swiglu_prologue moe apply_penalties > "$OUT/kernels.log" 2>&1
echo "kernels rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/kernels.log" | cut -c1-200; t0=$SECONDS
for v in ei,gei eid4 nd4; do
  ORNITH_XMOE=$v timeout 60 "$G/kernels" --ignored --test-threads=1 moe > "$OUT/kernels_$v.log" 2>&1
  echo "kernels moe $v rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/kernels_$v.log" | cut -c1-200; t0=$SECONDS
done
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow fp8 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_XMOE=ei,gei ORNITH_TEST_MODEL=$C/shallow timeout 100 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance cuda_penalties > "$OUT/test_shallow_ei.log" 2>&1
echo "test_shallow fp8 ei rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/test_shallow_ei.log" | cut -c1-200 | head -4; t0=$SECONDS
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > /dev/null 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_XMOE=ei,gei ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 100 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager batch_invariance > "$OUT/test_shallow_nvfp4_ei.log" 2>&1
echo "test_shallow nvfp4 ei rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/test_shallow_nvfp4_ei.log" | cut -c1-200 | head -4; t0=$SECONDS
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > /dev/null 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
for v in base ei base2; do
  ORNITH_XMOE=$([ "$v" = ei ] && echo ei) timeout 60 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 64 --budget-s 40 --batch 1 > "$OUT/bench_nvfp4_$v.json" 2> "$OUT/bench_nvfp4_$v.err"
  echo "bench nvfp4 $v rc=$? $((SECONDS - t0))s"; t0=$SECONDS
done
python3 tests/peer/results/h200-2026-12-04/s57_table.py "$OUT"
