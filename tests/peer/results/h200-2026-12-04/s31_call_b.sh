#!/usr/bin/env bash
# Session 19, call B: gdn_out_proj with the ticket only up to 2 tokens (gdn_out_reduce beyond) and
# the heads' loads in one group — kernel test, bench against HEAD and against call A's build.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s19b
unxz_to .gpu/head/bench_full.xz "$G/bench_base"
unxz_to .gpu/s19/bench_full.xz "$G/bench_v1"
t0=$SECONDS
timeout 100 "$G/kernels" --ignored --test-threads=1 --nocapture gdn_out > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result|PERF gdn_out" "$OUT/kernels.log" | cut -c1-200
[ $rc = 0 ] || exit 1
synth_full || exit 1
for b in base v1 full; do
  t0=$SECONDS
  timeout 110 "$G/bench_$b" --model "$C/full" --prompts 2048 --gen 64 --budget-s 80 --batch 1,8,32,64 > "$OUT/bench_$b.json" 2> "$OUT/bench_$b.err"
  echo "bench $b rc=$? $((SECONDS - t0))s"; grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ " "$OUT/bench_$b.err" | head -8
done
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
for b in ("base", "v1", "full"):
    try: d = json.load(open(f"{o}/bench_{b}.json"))
    except Exception as e: print(b, "no json", e); continue
    for br in d["batch_runs"]:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("gemv_bf16", "gated", "gdn_out"))]
        print(b, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"],
              " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
PY
