#!/usr/bin/env bash
# Session 20, call B: gdn_recurrent and conv1d_silu loading their state (and conv weights) before
# the PDL wait, launched with the attribute (ORNITH_GDN_FIRST / ORNITH_CONV_FIRST, experiment
# build), and gdn_out_reduce's loads in groups of 16 — kernel tests, shallow model checks with
# both on, full-preset bench without, with GDN, with GDN + conv.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s20b
t0=$SECONDS
timeout 100 "$G/kernels" --ignored --test-threads=1 --nocapture gdn conv > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result|PERF gdn_out" "$OUT/kernels.log" | cut -c1-160
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > "$OUT/synth_shallow.log" 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"
ORNITH_GDN_FIRST=1 ORNITH_CONV_FIRST=1 ORNITH_TEST_MODEL=$C/shallow timeout 150 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow.log" 2>&1
echo "test_shallow (gdn+conv first) rc=$? $((SECONDS - t0))s"
grep -E "batch invariance|panicked|test result" "$OUT/test_shallow.log" | cut -c1-200
rm -rf "$C/shallow"
synth_full || exit 1
for v in off gdn both; do
  [ $SECONDS -gt 470 ] && { echo "skip $v (time)"; continue; }
  t0=$SECONDS
  case $v in off) e="";; gdn) e="ORNITH_GDN_FIRST=1";; both) e="ORNITH_GDN_FIRST=1 ORNITH_CONV_FIRST=1";; esac
  env $e timeout 110 "$G/bench_full" --model "$C/full" --prompts 2048 --gen 64 --budget-s 80 --batch 1,8,32,64 > "$OUT/bench_$v.json" 2> "$OUT/bench_$v.err"
  echo "bench $v rc=$? $((SECONDS - t0))s"
done
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
for b in ("off", "gdn", "both"):
    try: d = json.load(open(f"{o}/bench_{b}.json"))
    except Exception as e: print(b, "no json", e); continue
    for br in d["batch_runs"]:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("gdn", "conv"))]
        print(b, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"],
              " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
PY
