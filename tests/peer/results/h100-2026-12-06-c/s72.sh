#!/usr/bin/env bash
# Thirty-fourth session, second call: the landed sampler build (samp, 0766919; fb9afd7 has the same
# code) on whichever card comes, for the issue targets' figures with default sampling. Order: full
# FP8 preset: bench at 2K (1 / 8 / 32 / 64 sequences), the 256-request batch file, bench at 32K /
# 128K (one sequence); then the NVFP4A16 full preset at 2K (1 / 32 sequences).
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds samp; GF=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
synth_full || exit 1; t0=$SECONDS
bench() {  # NAME BIN MODEL PROMPTS BATCHES
  timeout 150 "$2" --model "$3" --prompts "$4" --batch "$5" --gen 16 > "/tmp/bench_$1.json" 2> "$L/bench_$1.err"
  echo "bench $1 --prompts $4 --batch $5 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+ |^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ " "$L/bench_$1.err" | cut -c1-110
}
bench fp8 "$GF/bench_full" "$C/full" 2048 8,32,64
timeout 100 python3 tests/gpu/batch_file.py "$GF/ornith_full" "$C/full" "/tmp/batch_file.jsonl" 256
echo "batch file (default flags) rc=$? $((SECONDS - t0))s"; t0=$SECONDS
[ $SECONDS -lt 300 ] && bench long "$GF/bench_full" "$C/full" 32768,131072 1
if [ $SECONDS -lt 360 ]; then
  rm -rf "$C/full"
  "$GF/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$L/synth_full_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  [ $SECONDS -lt 530 ] && bench nvfp4 "$GF/bench_full_nvfp4" "$C/full-nvfp4" 2048 32
fi
echo "total ${SECONDS}s"
