#!/usr/bin/env bash
# Forty-first session: the prepared sm_90 FP8 prefill patch (s40_e4m3_once.patch), everything in one call.
# c41 = 8aeccba + patch: bench_full, test_shallow, xtask; b40base = HEAD's bench_full (41ec81d, same runtime code);
# k_baseb / k_cvt2b = kernel tests of HEAD / patch (digests printed).
#  0. kernel tests both builds, digests diffed, PERF lines;  1. shallow FP8 model checks (patched);
#  2. full FP8 preset; bench base / new alternating: prompts 2048 and 32768, max-batch-tokens 8192.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c41
unpack_as GB b40base
exec > >(tee "$L/summary.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
( nvcc -O3 -arch=sm_90 -o /tmp/rope_bin .gpu/rope/rope.cu && timeout 120 python3 .gpu/rope/rope.py 262144 ) 2>&1 | tail -20
unpack_as KB k_baseb; unpack_as KC2 k_cvt2b
T="gemm_fp8_matches_reference moe_prefill_matches_reference gemm_bf16_matches_reference"
for v in cvt2 base; do
  bin=$KB/kernels; [ $v = cvt2 ] && bin=$KC2/kernels
  t0=$SECONDS
  timeout 120 "$bin" --ignored --test-threads=1 --nocapture $T > "$OUT/kernels_${v}.log" 2>&1; echo "kernels $v rc=$? $((SECONDS - t0))s"
  grep -E "PERF (gemm_fp8|moe_prefill|gemm_bf16 2048x2048 -> 8192)|panicked|test result" "$OUT/kernels_${v}.log" | sed 's/.*PERF/PERF/' | cut -c1-120
done
for v in cvt2 base; do grep -oE "^(gemm_fp8|gemm_bf16|moe_prefill) [^:]*: .*bits [0-9a-f]+" "$OUT/kernels_${v}.log" | sed 's/: max.*bits/:/' > "$OUT/bits_$v.txt"; done
wc -l "$OUT"/bits_*.txt; diff "$OUT/bits_base.txt" "$OUT/bits_cvt2.txt" && echo "BITS IDENTICAL (cvt2 = base)"
shallow_checks "$G/test_shallow"
synth_full || exit 1
t0=$SECONDS
for r in 1 2 3; do
  BENCH_TIMEOUT=90 bench base_$r "$GB/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
  BENCH_TIMEOUT=90 bench new_$r "$G/bench_full" "$C/full" --prompts 2048,32768 --max-batch-tokens 8192
  [ $SECONDS -gt 420 ] && break
done
grep -h -E "^ +(gemm_fp8|gemm_fp8_grouped|gemm_bf16) " "$OUT"/bench_base_1.err "$OUT"/bench_new_1.err | cut -c1-100
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null; (cd "$OUT" && tar cJf logs.tar.xz *.log *.err *.txt 2>/dev/null; rm -f *.log *.err)
