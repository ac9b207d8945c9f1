#!/usr/bin/env bash
# NOTE: never ran — no device machine came in the fortieth session (every start refused).
# Fortieth session, call C (call B, with the full-preset benches, never got a machine). c40 = 41ec81d + the sm_90 FP8 prefill GEMMs through f16 mma with the
# E4M3 codes converted once by the loader (cvt_v1.patch); b40base = 41ec81d's bench_full;
# k_baseb / k_cvt2b = 41ec81d / cvt2 kernels with the tests printing each output digest (bits);
# k_cvt2 = cvt + ldmatrix / store addresses as one XOR per k-step on per-lane offsets (all GEMMs).
#  0. (KT=1) prefill GEMM kernel tests, k_base / k_cvt alternating (bits vs CPU; PERF);
#  1. shallow FP8 with c40v2 (test_shallow with the k_cvt2 kernels): graph = eager, CUDA vs CPU, batch invariance;
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c40v2
exec > >(tee "$L/summary.txt") 2>&1
if true; then
  unpack_as KB k_baseb; unpack_as KC2 k_cvt2b
  T="gemm_fp8_matches_reference moe_prefill_matches_reference gemm_bf16_matches_reference"
  for v in cvt2 base; do
    bin=$KB/kernels; [ $v = cvt ] && bin=$KC/kernels; [ $v = cvt2 ] && bin=$KC2/kernels
    t0=$SECONDS
    timeout 150 "$bin" --ignored --test-threads=1 --nocapture $T > "$OUT/kernels_${v}.log" 2>&1; echo "kernels $v rc=$? $((SECONDS - t0))s"
    grep -E "PERF (gemm_fp8|moe_prefill|gemm_bf16 2048x2048 -> 8192)|panicked|test result" "$OUT/kernels_${v}.log" | sed 's/.*PERF/PERF/' | cut -c1-120
  done
  for v in cvt2 base; do grep -oE "^(gemm_fp8|gemm_bf16|moe_prefill) [^:]*: .*bits [0-9a-f]+" "$OUT/kernels_${v}.log" | sed 's/: max.*bits/:/' > "$OUT/bits_$v.txt"; done
  wc -l "$OUT"/bits_*.txt; diff "$OUT/bits_base.txt" "$OUT/bits_cvt2.txt" && echo "BITS IDENTICAL (cvt2 = base)"
fi
shallow_checks "$G/test_shallow"
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null; (cd "$OUT" && tar cJf logs.tar.xz *.log *.err 2>/dev/null && rm -f *.log *.err)
