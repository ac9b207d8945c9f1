#!/usr/bin/env bash
# NOTE: never ran — no device machine came in the fortieth session (every start refused).
# Fortieth session, call B. c40 = 41ec81d + the sm_90 FP8 prefill GEMMs through f16 mma with the
# E4M3 codes converted once by the loader (cvt_v1.patch); b40base = 41ec81d's bench_full;
# k_cvt2 = cvt + ldmatrix / store addresses as one XOR per k-step on per-lane offsets (all GEMMs).
#  0. (KT=1) prefill GEMM kernel tests, k_base / k_cvt alternating (bits vs CPU; PERF);
#  1. shallow FP8 with c40: graph = eager, CUDA vs CPU, batch invariance;
#  2. full FP8 preset; bench base / new alternating: prompts 2048 and 32768, max-batch-tokens 8192.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c40t
unpack_as GB b40base
exec > >(tee "$L/summary.txt") 2>&1
if [ "${KT:-0}" = 1 ]; then
  unpack_as KB k_base; unpack_as KC k_cvt; unpack_as KC2 k_cvt2
  T="gemm_fp8_matches_reference moe_prefill_matches_reference gemm_bf16_matches_reference"
  for v in base cvt cvt2; do
    bin=$KB/kernels; [ $v = cvt ] && bin=$KC/kernels; [ $v = cvt2 ] && bin=$KC2/kernels
    t0=$SECONDS
    timeout 150 "$bin" --ignored --test-threads=1 --nocapture $T > "$OUT/kernels_${v}.log" 2>&1; echo "kernels $v rc=$? $((SECONDS - t0))s"
    grep -E "PERF (gemm_fp8|moe_prefill|gemm_bf16 2048x2048 -> 8192)|panicked|test result" "$OUT/kernels_${v}.log" | sed 's/.*PERF/PERF/' | cut -c1-120
  done
  for v in base cvt cvt2; do grep -E "max \|d\|" "$OUT/kernels_${v}.log" | md5sum | sed "s/-/$v error lines/"; done
fi
shallow_checks "$G/test_shallow"
synth_full || exit 1
t0=$SECONDS
for r in 1 2; do
  BENCH_TIMEOUT=100 bench base_$r "$GB/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
  BENCH_TIMEOUT=100 bench new_$r "$G/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
  [ $SECONDS -gt 300 ] && break
done
grep -h -E "^ +(gemm_fp8|gemm_fp8_grouped|gemm_bf16) " "$OUT"/bench_base_1.err "$OUT"/bench_new_1.err | cut -c1-100
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null; (cd "$OUT" && tar cJf logs.tar.xz *.log *.err 2>/dev/null && rm -f *.log *.err)
