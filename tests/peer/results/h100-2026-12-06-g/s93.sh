#!/usr/bin/env bash
# Thirty-ninth session, call D: batched decode at 32K (8 sequences of 32,768-token prompts), which
# s92 missed (its batched rows used the default 2,048-token --batch-prompt). g39c as s92.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds g39c
exec > >(tee "$L/summary.txt") 2>&1
synth_full || exit 1
t0=$SECONDS
BENCH_TIMEOUT=$((250 - SECONDS)) bench b32k "$G/bench_full" "$C/full" --prompts 2048 --batch 8 --batch-prompt 32768
grep -E "^ +8 +[0-9.]+ +[0-9.]+ |batched decode" "$OUT/bench_b32k.err" | cut -c1-120
echo "total ${SECONDS}s"
