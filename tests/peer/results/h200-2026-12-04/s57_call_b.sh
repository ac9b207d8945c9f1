#!/usr/bin/env bash
# Session 25 plan, call B. Build: on a555aaf `git apply tests/peer/results/h200-2026-12-04/s57_moe_variants.patch`, `cargo xtask ptx`,
# then NVFP4=1 tests/gpu/build.sh s25a (kernels, test_shallow[_nvfp4], bench_full[_nvfp4], xtask); carry .gpu/s25a and this script.
# the full FP8 preset at 2K batch 1 per experiment variant
# (s57_moe_variants.patch): ORNITH_XDIV=2 (the GDN input projection's K split 8: 772 blocks);
# ORNITH_XMOE = sd4 / sd4n (the per-slot down product with 4 rounds in flight, 3 / 4 blocks per SM),
# nd4 (gate|up, 4 rounds), nt512 / nt512d4 (gate|up K split 8), ei (gate|up triggers its dependents
# after its wait; down reads the routed index and issues its weights before its wait), eid4 (ei + 4 rounds);
# then 8 sequences with and without gei (the grouped pair reordered as ei).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s25a
exec > >(tee "$OUT/summary.txt") 2>&1
synth_full; t0=$SECONDS
run() { local v=$1; shift
  local args=(--prompts 2048 --batch 1); [ "${v#b8}" != "$v" ] && args=(--prompts --batch 8)
  env "$@" timeout 60 "$G/bench_full" --model "$C/full" "${args[@]}" --gen 64 --budget-s 40 > "$OUT/bench_$v.json" 2> "$OUT/bench_$v.err"
  echo "bench $v rc=$? $((SECONDS - t0))s"; t0=$SECONDS; }
run base0 X=1
run ei ORNITH_XMOE=ei
run eid4 ORNITH_XMOE=eid4
run sd4 ORNITH_XMOE=sd4
run sd4n ORNITH_XMOE=sd4n
run nd4 ORNITH_XMOE=nd4
run nt512 ORNITH_XMOE=nt512
run nt512d4 ORNITH_XMOE=nt512d4
run div2 ORNITH_XDIV=2
run base1 X=1
run b8base X=1
run b8gei ORNITH_XMOE=gei
python3 tests/peer/results/h200-2026-12-04/s57_table.py "$OUT"
