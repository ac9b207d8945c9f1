#!/usr/bin/env bash
# Thirty-third session, fourth call (NOT RUN: the device budget was spent; for the next session): the landed build 0e45f68's shallow model tests on both exports
# (moe_route_sort serves the FP8 and the NVFP4A16 decode groups of 4 to 8 rows).
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds final; GF=$G
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
"$GF/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 150 "$GF/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$L/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/test_shallow.log"; t0=$SECONDS
"$GF/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > /dev/null 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 150 "$GF/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$L/test_shallow_nvfp4.log" 2>&1
echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow_nvfp4.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|test result" "$L/test_shallow_nvfp4.log"
echo "total ${SECONDS}s"
