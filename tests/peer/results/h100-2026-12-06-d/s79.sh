#!/usr/bin/env bash
# Thirty-fifth session, fourth call: the NVFP4A16 user path the second call found broken — the
# 256-request batch file through an `ornith` built for the full NVFP4A16 preset (a052d50; `run`'s
# default 8,192-row steps, 65,536 expert rows per MoE block, 128-row NVFP4 expert tiles).
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c79; GW=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
"$GW/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > /dev/null 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 150 python3 tests/gpu/batch_file.py "$GW/ornith_full_nvfp4" "$C/full-nvfp4" "/tmp/batch_nvfp4.jsonl" 256
echo "batch file nvfp4 rc=$? $((SECONDS - t0))s"
echo "total ${SECONDS}s"
