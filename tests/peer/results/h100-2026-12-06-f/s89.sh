#!/usr/bin/env bash
# Thirty-eighth session, call C: the full NVFP4A16 synth timed, then the NVFP4A16 binary's load
# (3ea9ff8: experts' host parts on every core) timed with an empty input, twice (g38t = 1509185).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds g38t
rm -rf "$C/full"
synth_full_nvfp4 || exit 1
for i in 1 2; do
  t0=$(date +%s.%N)
  "$G/ornith_full_nvfp4" --model "$C/full-nvfp4" --backend cuda < /dev/null > /dev/null 2> "$OUT/load_$i.err"
  echo "empty run $i rc=$? $(python3 -c "import time; print(round(time.time() - $t0, 2))")s"
  grep -iE "load|ready|weights" "$OUT/load_$i.err" | grep -v uploading | head -3 | cut -c1-200
done
