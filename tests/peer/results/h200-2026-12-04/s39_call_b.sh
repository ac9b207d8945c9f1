#!/usr/bin/env bash
# Session 21, call B (f68cfe7: the combine epilogue, the grouped MoE without moe_sort, last_to_arrive fenced in thread 0):
# kernel tests (MoE, attention, GDN output, the split products), shallow model checks, full-preset bench
# (1/8/32/64 sequences) and 32K/128K (batch 1), and the NVFP4A16 export at batch 1 and 32.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s21b
t0=$SECONDS
timeout 200 "$G/kernels" --ignored --test-threads=1 --nocapture moe swiglu attention gdn_out gemv quant > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result" "$OUT/kernels.log" | cut -c1-200
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > "$OUT/synth_shallow.log" 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"
ORNITH_TEST_MODEL=$C/shallow timeout 150 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu cuda_ops_vs_cpu batch_invariance > "$OUT/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"
grep -E "CPU chunked|decode graph|panicked|test result" "$OUT/test_shallow.log" | cut -c1-200 | head -12
grep -c "bit-identical" "$OUT/test_shallow.log"
rm -rf "$C/shallow"
synth_full || exit 1
t0=$SECONDS
timeout 110 "$G/bench_full" --model "$C/full" --prompts 2048 --gen 64 --budget-s 80 --batch 1,8,32,64 > "$OUT/bench_2k.json" 2> "$OUT/bench_2k.err"
echo "bench 2k rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 150 "$G/bench_full" --model "$C/full" --prompts 32768,131072 --gen 64 --budget-s 100 --batch 1 > "$OUT/bench_long.json" 2> "$OUT/bench_long.err"
echo "bench long rc=$? $((SECONDS - t0))s"
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
try:
    for r in json.load(open(f"{o}/bench_long.json"))["runs"]:
        ab = {x["kernel"]: x["in_graph_us"] for x in r.get("decode_graph_ablation") or []}
        print("runs", r["prompt_tokens"], "%.1f / %.1f / top-p %.1f" % (r["decode_tok_s"], r["decode_default_sampling_tok_s"], r["decode_top_p_tok_s"]),
              "ttft %.2f s prefill %.0f tok/s" % (r["ttft_s"], r["prefill_tok_s"]), " ".join("%s=%.0f" % (k, v) for k, v in ab.items() if k.startswith(("attn", "quant"))))
except Exception as e: print("long: no json", e)
for b in ("2k", "long"):
    try: d = json.load(open(f"{o}/bench_{b}.json"))
    except Exception as e: print(b, "no json", e); continue
    for br in d["batch_runs"]:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("attn", "moe", "swiglu", "gdn_out"))]
        print(b, br["prompt_tokens"], br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"],
              "prefill %.3f s" % br["prefill_s"], " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
PY
rm -rf "$C/full"
[ $SECONDS -gt 480 ] && { echo "skip nvfp4 (time)"; exit 0; }
t0=$SECONDS
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$OUT/synth_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 100 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 64 --budget-s 70 --batch 1,32 > "$OUT/bench_nvfp4.json" 2> "$OUT/bench_nvfp4.err"
echo "bench nvfp4 rc=$? $((SECONDS - t0))s"
python3 - "$OUT" <<'PY'
import json, sys
d = json.load(open(f"{sys.argv[1]}/bench_nvfp4.json"))
for br in d["batch_runs"]:
    ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
    print("nvfp4", br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"], "prefill %.3f s" % br["prefill_s"],
          " ".join("%s=%.0f" % (k, v) for k, v in ab.items() if k.startswith(("moe", "swiglu"))))
PY
