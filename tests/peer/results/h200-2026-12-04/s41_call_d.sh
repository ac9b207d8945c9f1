#!/usr/bin/env bash
# Session 21, call D (73f6829 + tile passes per block column in moe_gemv_grouped, chosen by
# ORNITH_MOE_PASSES in the launcher — an experiment): the full preset's batched step at 8
# sequences (2K prompts) with 1 and 2 passes, then the grouped-vs-per-slot bits with 2 passes.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s21d
synth_full || exit 1
for n in 1 2; do
    t0=$SECONDS
    ORNITH_MOE_PASSES=$n timeout 30 "$G/bench_full" --model "$C/full" --prompts --gen 64 --budget-s 25 --batch 8 > "$OUT/bench_p$n.json" 2> "$OUT/bench_p$n.err"
    echo "bench passes $n rc=$? $((SECONDS - t0))s"
    python3 - "$OUT/bench_p$n.json" "$n" <<'PY'
import json, sys
try: d = json.load(open(sys.argv[1]))
except Exception as e: print("no json", e); sys.exit(0)
for br in d["batch_runs"]:
    ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
    print("passes", sys.argv[2], br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"], "moe_gemv_grouped=%.0f" % ab.get("moe_gemv_grouped", -1))
PY
done
t0=$SECONDS
ORNITH_MOE_PASSES=2 timeout 30 "$G/kernels" --ignored --test-threads=1 --nocapture moe_decode_matches_reference > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels (passes 2) rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result" "$OUT/kernels.log" | cut -c1-200
