#!/usr/bin/env bash
# Session 19, call C: batch 1 at 32K and 128K, HEAD (0ace055's bench) against gdn_out_proj (23711f1).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s19b
unxz_to .gpu/head/bench_full.xz "$G/bench_base"
synth_full || exit 1
for b in base full; do
  t0=$SECONDS
  timeout 150 "$G/bench_$b" --model "$C/full" --prompts 32768,131072 --gen 64 --budget-s 100 --batch 1 > "$OUT/bench_$b.json" 2> "$OUT/bench_$b.err"
  echo "bench $b rc=$? $((SECONDS - t0))s"; grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ " "$OUT/bench_$b.err" | head -4
done
