#!/usr/bin/env bash
# Thirty-seventh session, on the machine s83 left warm (full-nvfp4 synthesised there): NVFP4A16
# bench at 2K for 1 / 8 / 32 / 64 sequences, then the FP8 preset (synthesised after deleting the
# NVFP4 one) with the same bench and, time allowing, the 256-request batch file. Build c80x.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c80x
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
synth_full_nvfp4 || exit 1
BENCH_TIMEOUT=130 bench nvfp4 "$G/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048 --batch 8,32,64
rm -rf "$C/full-nvfp4"
synth_full || exit 1; t0=$SECONDS
[ $SECONDS -lt 420 ] && BENCH_TIMEOUT=130 bench fp8 "$G/bench_full" "$C/full" --prompts 2048 --batch 8,32,64
[ $SECONDS -lt 480 ] && timeout 100 python3 tests/gpu/batch_file.py "$G/ornith_full" "$C/full" /tmp/batch_fp8.jsonl 256 && echo "batch file fp8 $((SECONDS - t0))s"
echo "total ${SECONDS}s"
