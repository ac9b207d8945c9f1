#!/usr/bin/env bash
# Session 26: the model-level GPU test of penalties (cuda_penalties_match_cpu_sampling) on the
# shallow FP8 preset, HEAD acbbd74.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s26m
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > "$OUT/synth.log" 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 150 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_penalties > "$OUT/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"
grep -E "^test |panicked|test result" "$OUT/test_shallow.log" | cut -c1-300
tail -5 "$OUT/synth.log"
