#!/usr/bin/env bash
# Thirty-fourth session, third call: figures not measured lately, on the landed sampler build
# (samp, 0766919) — batched decode at long context (FP8, 32K prompts, 4 and 16 sequences) and the
# NVFP4A16 export at 8 and 64 sequences (2K prompts).
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds samp; GF=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
synth_full || exit 1; t0=$SECONDS
bench() {  # NAME BIN MODEL PROMPTS BATCHES
  timeout 170 "$2" --model "$3" --prompts "$4" --batch "$5" --gen 16 > "/tmp/bench_$1.json" 2> "$L/bench_$1.err"
  echo "bench $1 --prompts $4 --batch $5 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+ |^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ " "$L/bench_$1.err" | cut -c1-110
}
bench long_batch "$GF/bench_full" "$C/full" 32768 4,16
if [ $SECONDS -lt 330 ]; then
  rm -rf "$C/full"
  "$GF/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$L/synth_full_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
  [ $SECONDS -lt 500 ] && bench nvfp4 "$GF/bench_full_nvfp4" "$C/full-nvfp4" 2048 8,64
fi
echo "total ${SECONDS}s"
