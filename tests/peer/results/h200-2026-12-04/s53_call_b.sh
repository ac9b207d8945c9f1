#!/usr/bin/env bash
# Session 24, call B (builds .gpu/s24b = 44d716d + the fold loop + L2 prefetch variants, chosen by
# ORNITH_EXP_PF: "moe" = the per-slot MoE prologue forms (FP8 and NVFP4) and the attention q|k|v
# norm products prefetch the rest of their slice to L2 after their first rounds; "all" adds the
# GDN input projection's next 2 rounds; "alla" its whole slice): the prologue kernel tests under
# "alla" (bit-exact against the unfused kernels), then the full FP8 and NVFP4A16 presets at 2K
# batch 1 per variant.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s24b
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
ORNITH_EXP_PF=alla timeout 90 "$G/kernels" --ignored --test-threads=1 --nocapture norm_prologue swiglu_prologue moe_nvfp4 gemv_nvfp4_norm > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels (alla) rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result|PERF norm" "$OUT/kernels.log" | cut -c1-200; t0=$SECONDS
synth_full; t0=$SECONDS
for v in base moe all alla; do
ORNITH_EXP_PF=$([ $v = base ] || echo $v) timeout 60 "$G/bench_full" --model "$C/full" --prompts 2048 --gen 64 --budget-s 40 --batch 1 > "$OUT/bench_fp8_$v.json" 2> "$OUT/bench_fp8_$v.err"
echo "bench fp8 $v rc=$? $((SECONDS - t0))s"; t0=$SECONDS
done
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > /dev/null 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
for v in base moe alla; do
ORNITH_EXP_PF=$([ $v = base ] || echo $v) timeout 60 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 64 --budget-s 40 --batch 1 > "$OUT/bench_nvfp4_$v.json" 2> "$OUT/bench_nvfp4_$v.err"
echo "bench nvfp4 $v rc=$? $((SECONDS - t0))s"; t0=$SECONDS
done
python3 - "$OUT" <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(f"{sys.argv[1]}/bench_*.json")):
    v = os.path.basename(f)[6:-5]
    try: d = json.load(open(f))
    except Exception as e: print(v, "no json", e); continue
    for br in d.get("batch_runs") or []:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("moe", "gemv", "gdn"))]
        print(v, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"], " ".join("%s=%.0f" % (k.replace("moe_gemv_", "m_"), ab[k]) for k in keys))
PY
