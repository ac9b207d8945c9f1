#!/usr/bin/env bash
# Thirty-ninth session, call C: figures of HEAD's kernels and engine (g39c = 1509185's bench_full
# and ornith_full, which equal d364933's; d364933's xtask). On an H200: the issue targets' set (2K at
# 1 / 8 / 32 / 64 sequences, the 256-request batch file, 32K and 128K at one sequence). On an H100
# (whose set the thirty-seventh session took): batched decode at 32K (8 and 16 sequences), not
# measured lately.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds g39c
exec > >(tee "$L/summary.txt") 2>&1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
synth_full || exit 1
t0=$SECONDS
if echo "$gpu" | grep -q H200; then
  BENCH_TIMEOUT=130 bench fp8 "$G/bench_full" "$C/full" --prompts 2048 --batch 8,32,64
  t0=$SECONDS; timeout 100 python3 tests/gpu/batch_file.py "$G/ornith_full" "$C/full" /tmp/batch_fp8.jsonl 256; echo "batch file fp8 $((SECONDS - t0))s"
  [ $SECONDS -lt 400 ] && BENCH_TIMEOUT=$((560 - SECONDS)) bench long "$G/bench_full" "$C/full" --prompts 32768,131072 --batch 1
else
  BENCH_TIMEOUT=200 bench k32 "$G/bench_full" "$C/full" --prompts 32768 --batch 8,16
  grep -E "^ +(8|16) +[0-9.]+ +[0-9.]+ " "$OUT/bench_k32.err" | cut -c1-120
fi
echo "total ${SECONDS}s"
