#!/usr/bin/env bash
# Thirty-eighth session, call A. Builds: g38a = 1509185 (base kernels), k38b / m38b = a4d6b53 with
# the grouped GEMMs' empty-row-tile skip (gemm.cu, uncommitted at build time; m38b its model
# binaries), k38c = the same skip tested per k-step instead of around the stage.
#  1. the prefill GEMM kernel tests, base / new / brk: bits vs the CPU reference, PERF lines;
#  2. ncu on the base grouped NVFP4 gate|up (2,048 tokens) and grouped FP8 (moe_prefill, 2,048);
#  3. shallow FP8 and NVFP4A16 (m38b: last session's moe.rs, teacher_forced, NVFP4 loader + skip):
#     graph vs eager, CUDA vs CPU, batch invariance;
#  4. full FP8 preset synthesised (timed), prefill + decode base vs new at 2K and 8,192-row steps.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds k38b; K=$G
unpack_builds k38c; KC=$G
unpack_builds m38b; M=$G
unpack_builds g38t
exec > >(tee "$L/summary.txt") 2>&1
T="gemm_nvfp4_matches_reference moe_prefill_matches_reference gemm_fp8_matches_reference gemm_bf16_matches_reference"
for v in base new brk; do
  bin=$G/kernels; [ $v = new ] && bin=$K/kernels; [ $v = brk ] && bin=$KC/kernels
  tests=$T; [ $v = new ] || tests="gemm_nvfp4_matches_reference moe_prefill_matches_reference"
  t0=$SECONDS
  timeout 150 "$bin" --ignored --test-threads=1 --nocapture $tests > "$OUT/kernels_$v.log" 2>&1; echo "kernels $v rc=$? $((SECONDS - t0))s"
  grep -E "PERF (gemm_nvfp4_grouped|moe_prefill|gemm_nvfp4 2048|gemm_fp8 2048x2048 -> 8192|gemm_bf16 2048x2048 -> 8192)|panicked|test result" "$OUT/kernels_$v.log" | sed 's/.*PERF/PERF/' | cut -c1-150
done
for q in fp8 nvfp4; do
  t0=$SECONDS
  bin=$M/test_shallow; [ $q = nvfp4 ] && bin=$M/test_shallow_nvfp4
  "$G/xtask" synth --preset shallow --quant $( [ $q = nvfp4 ] && echo nvfp4a16 || echo fp8 ) --out "$C/shallow-$q" > "$OUT/synth_shallow_$q.log" 2>&1; echo "synth shallow $q rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  ORNITH_TEST_MODEL=$C/shallow-$q timeout 130 "$bin" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow_$q.log" 2>&1
  echo "test_shallow $q rc=$? $((SECONDS - t0))s"
  grep -E "prefill:|batch invariance|panicked|test result" "$OUT/test_shallow_$q.log" | cut -c1-200
  rm -rf "$C/shallow-$q"
done
[ $SECONDS -gt 330 ] && { echo "skip full (time) ${SECONDS}s"; exit 0; }
synth_full || exit 1
t0=$SECONDS
BENCH_TIMEOUT=45 bench fp8_base "$G/bench_full" "$C/full" --prompts 2048
BENCH_TIMEOUT=45 bench fp8_new "$M/bench_full" "$C/full" --prompts 2048
[ $SECONDS -lt 540 ] && BENCH_TIMEOUT=30 bench fp8_new_8k "$M/bench_full" "$C/full" --prompts 8192 --max-batch-tokens 8192 --gen 4
grep -h -E "gemm_fp8_grouped|prefill of" "$OUT"/bench_fp8_*.err | cut -c1-100
[ $SECONDS -lt 500 ] && {
NCU=/usr/local/cuda/bin/ncu
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section InstructionStats --section Occupancy --section SourceCounters --section MemoryWorkloadAnalysis"
t0=$SECONDS
timeout $((585 - SECONDS)) $NCU --kernel-name regex:"^gemm_nvfp4_grouped$" --launch-count 1 $S -o "$OUT/ncu_nv" \
  "$G/kernels" --ignored --test-threads=1 gemm_nvfp4_matches_reference > "$OUT/ncu_nv.log" 2>&1; echo "ncu nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
for r in nv fp8; do
  [ -f "$OUT/ncu_$r.ncu-rep" ] || continue
  $NCU --import "$OUT/ncu_$r.ncu-rep" --page details --print-units base > "$OUT/ncu_$r.txt" 2>&1
  $NCU --import "$OUT/ncu_$r.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${r}_sass.csv" 2>&1 || echo "page source failed"
  rm -f "$OUT/ncu_$r.ncu-rep"
  echo "== $r"; grep -E "Duration|Grid Size|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Achieved Occupancy|Compute \(SM\) Throughput|Memory Throughput" "$OUT/ncu_$r.txt" | head -10 | cut -c1-150
done
}
echo "total ${SECONDS}s"
