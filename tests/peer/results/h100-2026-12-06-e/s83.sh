#!/usr/bin/env bash
# Thirty-seventh session, the correctness half (one call): cuda_matches_cpu_at_length (new, never
# run; build c81 = HEAD's test_shallow) on the shallow preset at 16,421 tokens, then the NVFP4A16
# user path never run through the binary: the 256-request batch file through ornith_full_nvfp4
# (c80x). Carry .gpu/c81 and .gpu/c80x.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds c80x; G80=$G
unpack_builds c81
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > "$OUT/synth_shallow.log" 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow ORNITH_LONG=${LONG:-16421} timeout ${LONG_TIMEOUT:-270} "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_matches_cpu_at_length > "$OUT/test_long.log" 2>&1
echo "cuda_matches_cpu_at_length rc=$? $((SECONDS - t0))s"; t0=$SECONDS
grep -E "prefill in pieces|two piece cuts|^row|^  to|decode:|panicked|test result" "$OUT/test_long.log" | cut -c1-300
rm -rf "$C/shallow"
if [ $SECONDS -lt 295 ]; then
  G=$G80; src=.gpu/c80x
  synth_full_nvfp4 || exit 1; t0=$SECONDS
  timeout 65 python3 tests/gpu/batch_file.py "$G/ornith_full_nvfp4" "$C/full-nvfp4" /tmp/batch_nvfp4.jsonl 256
  echo "batch file nvfp4 rc=$? $((SECONDS - t0))s"
fi
echo "total ${SECONDS}s"
