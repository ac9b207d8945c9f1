#!/usr/bin/env bash
# Prepared, NOT RUN (the device tool refused: too little time left to start a machine). Forty-fifth session, call B: the landed FP8 96-row
# expert tiles through the model against the CPU. `cuda_matches_cpu_at_length` on the shallow FP8
# preset (256 experts, top-8) at 4,097 tokens: two 2,048-token pieces (64 rows per expert: the
# 96-row tiles) and one token, then 16 decode steps. sf45t = f45's test_shallow (b96f7d0 + the
# landed change; its NVFP4 kernels carried the dropped variant, unused by the FP8 model).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds x45
unpack_as T sf45t
exec > >(tee "$OUT/summary.txt") 2>&1
synth_at shallow fp8 "$C/shallow-fp8" || exit 1
t0=$SECONDS
ORNITH_LONG=4097 ORNITH_TEST_MODEL=$C/shallow-fp8 timeout 170 "$T/test_shallow" --ignored --nocapture \
    --test-threads=1 cuda_matches_cpu_at_length > "$OUT/at_length.log" 2>&1
echo "at_length rc=$? $((SECONDS - t0))s"
grep -vE "^\s*$|uploading" "$OUT/at_length.log" | tail -25 | cut -c1-220
echo "total ${SECONDS}s"
