#!/usr/bin/env bash
# Thirtieth session, call 3 (s62 = 43311ba, the landed tree: SIMT scan + the blocked-inverse GDN
# prep): every shallow FP8 model test.
set -uo pipefail
. tests/gpu/lib.sh
OUT0=$OUT; L=/tmp/s62; mkdir -p $L; OUT=$L
unpack_builds s62
exec > >(tee "$L/summary.txt") 2>&1
save() { tar czf "$OUT0/s62.tgz" -C /tmp s62; cp "$L/summary.txt" "$OUT0/summary.txt"; }
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 150 "$G/test_shallow" --ignored --nocapture --test-threads=1 > "$L/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow.log" | cut -c1-250 | head -4; grep -E "^test .*(ok|FAILED)$|batch invariance: mixed|prefix cache on|test result" "$L/test_shallow.log"
save
