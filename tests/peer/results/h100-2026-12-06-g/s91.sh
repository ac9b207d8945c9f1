#!/usr/bin/env bash
# Thirty-ninth session, call B. r39 = 5e7db1c (the router products with the routing in their grid:
# gemv_bf16_route / gemv_bf16_norm_route for decode groups of 1..8 rows); g39 = the base's
# bench_full (1509185: the same kernels and engine as d364933).
#  1. kernel tests: the new route tail against the product + top-k (+ sort), route_sort, sort;
#  2. shallow FP8: graph = eager, CUDA vs CPU, batch invariance (1..256, every PDL mode);
#  3. full FP8 preset, bench at 2K, 1 and 8 sequences, base / new alternating twice.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds g39b; GB=$G
unpack_builds r39s
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
timeout 100 "$G/kernels" --ignored --test-threads=1 --nocapture gemv_bf16_route_matches_product_and_routing moe_route_sort_matches_router_and_sort moe_sort_matches_reference norm_prologue_and_fold_match_the_norm_kernel > "$OUT/kernels.log" 2>&1; echo "kernels rc=$? $((SECONDS - t0))s"
grep -E "PERF (router|moe_route|moe_sort)|panicked|test result|^test " "$OUT/kernels.log" | cut -c1-200
synth_at shallow fp8 "$C/shallow-fp8"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-fp8 timeout 170 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance --skip cuda_matches_cpu_at_length > "$OUT/test_shallow_fp8.log" 2>&1
echo "test_shallow fp8 rc=$? $((SECONDS - t0))s"
grep -E "prefill:|batch invariance: (1|8|256) |mixed|panicked|test result" "$OUT/test_shallow_fp8.log" | cut -c1-200
rm -rf "$C/shallow-fp8"
synth_full || exit 1
t0=$SECONDS
for r in 1 2; do
  BENCH_TIMEOUT=60 bench base_$r "$GB/bench_full" "$C/full" --prompts 2048 --batch 8
  BENCH_TIMEOUT=60 bench new_$r "$G/bench_full" "$C/full" --prompts 2048 --batch 8
  [ $SECONDS -gt 520 ] && break
done
grep -h -E "^ +8 +[0-9.]+ +[0-9.]+ " "$OUT"/bench_*.err | cut -c1-100
grep -h -E "moe_router_topk|moe_route_sort|gemv_bf16_route|gemv_bf16_norm_route|gemv_bf16_norm |in-graph cost|step [0-9]+ us as replayed" "$OUT"/bench_new_1.err "$OUT"/bench_base_1.err | cut -c1-110
echo "total ${SECONDS}s"
