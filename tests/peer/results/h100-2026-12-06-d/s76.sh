#!/usr/bin/env bash
# Thirty-fifth session, second call: the landed form (build w2, c562b4c: the GEMMs' cp.async
# offsets computed once; the NVFP4 grouped GEMM in 128-row tiles at >= 128 rows per expert, FP8
# keeping 64-row tiles) on the NVFP4A16 full preset against the landed kernels before it (base =
# samp, 0766919). Order: kernel tests (NVFP4 GEMMs, MoE prefill and sort); NVFP4A16 full preset:
# bench batch-1 prefill at 8,192 (8,192-row steps) and 2,048, base then w2; the shallow model tests
# on both exports if time is left.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c76base; GB=$G
unpack_builds c76; GW=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
timeout 150 "$GW/kernels" --ignored --nocapture --test-threads=1 gemm_nvfp4 moe_prefill moe_sort moe_route_sort moe_gemv_nvfp4_grouped > "$L/kernels.log" 2>&1
echo "kernels rc=$? $((SECONDS - t0))s"; grep -E -A2 "panicked" "$L/kernels.log" | cut -c1-250 | head -8; grep -E "^PERF|^test .*(ok|FAILED)$|test result" "$L/kernels.log" | cut -c1-200; t0=$SECONDS
"$GW/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$L/synth_full_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
bench() {  # NAME BIN MODEL ARGS...
  local n=$1 b=$2 m=$3; shift 3
  timeout 120 "$b" --model "$m" --gen 16 "$@" > "/tmp/bench_$n.json" 2> "$L/bench_$n.err"
  echo "bench $n $* rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+ " "$L/bench_$n.err" | cut -c1-110
  grep -E "gemm_nvfp4|^prefill of" "$L/bench_$n.err" | head -6
}
bench nvfp4_base "$GB/bench_full_nvfp4" "$C/full-nvfp4" --prompts 8192,2048 --max-batch-tokens 8192
bench nvfp4_w2 "$GW/bench_full_nvfp4" "$C/full-nvfp4" --prompts 8192,2048 --max-batch-tokens 8192
rm -rf "$C/full-nvfp4"
for q in "" nvfp4; do
  [ $SECONDS -lt 450 ] || break
  name=shallow${q:+-$q}; tb=test_shallow${q:+_$q}
  "$GW/xtask" synth --preset shallow ${q:+--quant nvfp4a16} --out "$C/$name" > /dev/null 2>&1; echo "synth $name rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  ORNITH_TEST_MODEL=$C/$name timeout 140 "$GW/$tb" --ignored --nocapture --test-threads=1 cuda_matches_cpu batch_invariance > "$L/$tb.log" 2>&1
  echo "$tb rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/$tb.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/$tb.log"; t0=$SECONDS
done
echo "total ${SECONDS}s"
