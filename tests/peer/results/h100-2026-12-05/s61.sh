#!/usr/bin/env bash
# Thirtieth session, call 2 (s61): the landed tree's kernel tests (SIMT scan + the new prep) and
# the scan A/B on one card: kernels (SIMT scan) against kernels_tc (= s60's kernels_prep: the
# 3xTF32 tensor-core scan), gdn_chunked twice each, alternating.
set -uo pipefail
. tests/gpu/lib.sh
OUT0=$OUT; L=/tmp/s61; mkdir -p $L; OUT=$L
unpack_builds s61
exec > >(tee "$L/summary.txt") 2>&1
save() { tar czf "$OUT0/s61.tgz" -C /tmp s61; cp "$L/summary.txt" "$OUT0/summary.txt"; }
t0=$SECONDS
timeout 150 "$G/kernels" --ignored --nocapture --test-threads=1 > "$L/kernels_all.log" 2>&1
echo "kernels (all) rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result|PERF gdn" "$L/kernels_all.log" | cut -c1-160; t0=$SECONDS; save
for k in kernels_tc kernels kernels_tc; do
  timeout 60 "$G/$k" --ignored --nocapture --test-threads=1 gdn_chunked > "$L/$k.log" 2>&1
  echo "$k gdn_chunked rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result|PERF" "$L/$k.log" | cut -c1-160; t0=$SECONDS; save
done
