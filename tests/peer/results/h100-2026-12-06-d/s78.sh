#!/usr/bin/env bash
# Thirty-fifth session, third call: build w3 (03bb2c1: c562b4c + swiglu_bf16 over a 1-D grid — the
# second call found NVFP4A16 prefill steps of 8,192 tokens failing, 65,536 rows past grid.y). Order:
# kernel test swiglu_bf16; NVFP4A16 full preset: bench w3 at 8,192 (8,192-row steps) and 2,048,
# base (samp 0766919) at 2,048; full FP8 preset: bench w3 the same way (the same call's FP8 against
# NVFP4A16); a 32K prompt in 2,048- and 8,192-row steps; the 256-request batch file (w3).
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c78base; GB=$G
unpack_builds c78; GW=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
timeout 60 "$GW/kernels" --ignored --nocapture --test-threads=1 swiglu_bf16 > "$L/kernels.log" 2>&1
echo "kernels rc=$? $((SECONDS - t0))s"; grep -E -A2 "panicked" "$L/kernels.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/kernels.log"; t0=$SECONDS
bench() {  # NAME BIN MODEL ARGS...
  local n=$1 b=$2 m=$3; shift 3
  timeout 100 "$b" --model "$m" --gen 16 "$@" > "/tmp/bench_$n.json" 2> "$L/bench_$n.err"
  echo "bench $n $* rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+ " "$L/bench_$n.err" | cut -c1-110; grep -E "error" "$L/bench_$n.err" | head -2
}
"$GW/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$L/synth_full_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
bench nvfp4_w3 "$GW/bench_full_nvfp4" "$C/full-nvfp4" --prompts 8192,2048 --max-batch-tokens 8192
[ $SECONDS -lt 200 ] && bench nvfp4_base "$GB/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048
rm -rf "$C/full-nvfp4"
synth_full || exit 1; t0=$SECONDS
bench fp8_w3 "$GW/bench_full" "$C/full" --prompts 8192,2048 --max-batch-tokens 8192
for mbt in 2048 8192; do
  [ $SECONDS -lt 500 ] || break
  bench fp8_32k_$mbt "$GW/bench_full" "$C/full" --prompts 32768 --max-batch-tokens $mbt
done
if [ $SECONDS -lt 530 ]; then
  timeout 65 python3 tests/gpu/batch_file.py "$GW/ornith_full" "$C/full" "/tmp/batch_w3.jsonl" 256
  echo "batch file w3 rc=$? $((SECONDS - t0))s"
fi
echo "total ${SECONDS}s"
