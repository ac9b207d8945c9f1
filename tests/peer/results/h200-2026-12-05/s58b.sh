#!/usr/bin/env bash
# Session 27, call B (s25a build = aab6ca3 + s57_moe_variants.patch):
# 1. localise call A's FP8 shallow batch-invariance failure under ORNITH_XMOE=ei,gei: ei alone, gei alone;
# 2. the full FP8 preset at 2K batch 1 per variant, 8 sequences with / without gei (s57_call_b);
# 3. one 2,048-token request, 256 generated, default sampling, through the real binary.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s25a
L=/tmp/s58b; mkdir -p $L
exec > >(tee "$L/summary.txt") 2>&1
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow fp8 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
for v in ei gei; do
  ORNITH_XMOE=$v ORNITH_TEST_MODEL=$C/shallow timeout 100 "$G/test_shallow" --ignored --nocapture --test-threads=1 batch_invariance > "$L/test_shallow_$v.log" 2>&1
  echo "test_shallow fp8 $v rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow_$v.log" | cut -c1-250 | head -4; grep -E "^batch invariance|test result" "$L/test_shallow_$v.log" | tail -3; t0=$SECONDS
done
synth_full; t0=$SECONDS
run() { local v=$1; shift
  local args=(--prompts 2048 --batch 1); [ "${v#b8}" != "$v" ] && args=(--prompts 2048 --batch 8)
  env "$@" timeout 60 "$G/bench_full" --model "$C/full" "${args[@]}" --gen 64 --budget-s 40 > "$L/bench_$v.json" 2> "$L/bench_$v.err"
  echo "bench $v rc=$? $((SECONDS - t0))s"; t0=$SECONDS; }
run base0 X=1
run ei ORNITH_XMOE=ei
run eid4 ORNITH_XMOE=eid4
run sd4 ORNITH_XMOE=sd4
run nd4 ORNITH_XMOE=nd4
run nt512 ORNITH_XMOE=nt512
run div2 ORNITH_XDIV=2
run base1 X=1
run b8base X=1
run b8gei ORNITH_XMOE=gei
python3 tests/peer/results/h200-2026-12-04/s57_table.py "$L"
timeout 120 python3 tests/gpu/long_prompt.py "$G/ornith_full" "$C/full" "$L/binary_2k.json" 2048 256
echo "binary 2k rc=$? $((SECONDS - t0))s"
tar czf "$OUT/s58b.tgz" -C /tmp s58b; cp "$L/summary.txt" "$OUT/summary.txt"
