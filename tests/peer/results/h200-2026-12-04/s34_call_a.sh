#!/usr/bin/env bash
# Session 20, call A: the staged MoE decode products (cp.async of each warp's whole K slice) and
# the pipelined grouped tile against the current ones — kernel tests (bits vs base, PERF), then
# the full-preset bench with each variant (ORNITH_MOE_VARIANT, experiment build).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s20a
t0=$SECONDS
timeout 150 "$G/kernels" --ignored --test-threads=1 --nocapture moe gdn_out gemv prologue > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result|PERF moe" "$OUT/kernels.log" | cut -c1-160
synth_full || exit 1
for v in staged base pipe; do
  [ $SECONDS -gt 430 ] && { echo "skip $v (time)"; continue; }
  t0=$SECONDS
  ORNITH_MOE_VARIANT=$v timeout 110 "$G/bench_full" --model "$C/full" --prompts 2048 --gen 64 --budget-s 80 --batch 1,8,32,64 > "$OUT/bench_$v.json" 2> "$OUT/bench_$v.err"
  echo "bench $v rc=$? $((SECONDS - t0))s"
done
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
for b in ("base", "pipe", "staged"):
    try: d = json.load(open(f"{o}/bench_{b}.json"))
    except Exception as e: print(b, "no json", e); continue
    for br in d["batch_runs"]:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith("moe_gemv")]
        print(b, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"],
              " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
PY
