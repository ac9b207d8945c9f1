#!/usr/bin/env bash
# Thirty-fifth session, first call: the grouped MoE GEMMs in 128-row tiles for steps of >= 128
# rows per expert and the GEMMs' cp.async offsets computed once (build wide, 681a2b7) against the
# landed kernels (build base = samp, 0766919: same kernels as ddfcdc7). Order: kernel tests (GEMMs,
# MoE prefill and sort, NVFP4 grouped; base's MoE prefill timing too); full FP8 preset: bench
# batch-1 prefill at 8,192 (8,192-row steps) and 2,048, base then wide; the 256-request batch file
# (8,192-row steps by default), base then wide, outputs compared line for line.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c75base; GB=$G
unpack_builds c75wide; GW=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
timeout 200 "$GW/kernels" --ignored --nocapture --test-threads=1 gemm_ moe_prefill moe_sort moe_route_sort moe_gemv_grouped moe_gemv_nvfp4_grouped > "$L/kernels_wide.log" 2>&1
echo "kernels wide rc=$? $((SECONDS - t0))s"; grep -E -A2 "panicked" "$L/kernels_wide.log" | cut -c1-250 | head -8; grep -E "^PERF|^test .*(ok|FAILED)$|test result" "$L/kernels_wide.log" | cut -c1-200; t0=$SECONDS
timeout 60 "$GB/kernels" --ignored --nocapture --test-threads=1 moe_prefill_matches > "$L/kernels_base_moe.log" 2>&1
echo "kernels base moe_prefill rc=$? $((SECONDS - t0))s"; grep -E "^PERF|test result" "$L/kernels_base_moe.log" | cut -c1-200; t0=$SECONDS
synth_full || exit 1; t0=$SECONDS
bench() {  # NAME BIN MODEL ARGS...
  local n=$1 b=$2 m=$3; shift 3
  timeout 120 "$b" --model "$m" --gen 16 "$@" > "/tmp/bench_$n.json" 2> "$L/bench_$n.err"
  echo "bench $n $* rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+ " "$L/bench_$n.err" | cut -c1-110
  grep -E "gemm_fp8_grouped|gemm_fp8 |gemm_bf16 |^prefill of" "$L/bench_$n.err" | head -6
}
bench base "$GB/bench_full" "$C/full" --prompts 8192,2048 --max-batch-tokens 8192
bench wide "$GW/bench_full" "$C/full" --prompts 8192,2048 --max-batch-tokens 8192
for b in base wide; do
  [ $SECONDS -lt 480 ] || break
  G2=$GB; [ $b = wide ] && G2=$GW
  timeout 100 python3 tests/gpu/batch_file.py "$G2/ornith_full" "$C/full" "$L/batch_$b.jsonl" 256
  echo "batch file $b rc=$? $((SECONDS - t0))s"; t0=$SECONDS
done
[ -f "$L/batch_base.jsonl" ] && [ -f "$L/batch_wide.jsonl" ] && python3 - "$L/batch_base.jsonl" "$L/batch_wide.jsonl" <<'PY'
import json, sys
a = {json.loads(l)["custom_id"]: json.loads(l) for l in open(sys.argv[1])}
b = {json.loads(l)["custom_id"]: json.loads(l) for l in open(sys.argv[2])}
txt = lambda r: json.dumps(r["response"]["body"]["choices"], sort_keys=True) if not r.get("error") else "ERR"
same = sum(1 for k in a if k in b and txt(a[k]) == txt(b[k]))
print(f"batch file outputs: {same} of {len(a)} identical (base vs wide)")
PY
rm -f "$L"/batch_*.jsonl
echo "total ${SECONDS}s"
