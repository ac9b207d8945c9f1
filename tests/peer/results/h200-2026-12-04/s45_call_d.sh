#!/usr/bin/env bash
# Session 22, call D (8512d3f + the experimental grouped U1 kernel, no prefetch): the NVFP4 MoE
# kernel tests with ORNITH_X_U1 (the U1 kernel against the CPU reference and the per-slot
# products), the full NVFP4A16 preset at 2K (1, 8, 32 sequences: U2, 8512d3f's kernels), then
# 8 and 32 sequences with ORNITH_X_U1.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s22d
t0=$SECONDS
ORNITH_X_U1=1 timeout 100 "$G/kernels" --ignored --test-threads=1 --nocapture moe_gemv_nvfp4 moe_nvfp4 > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels (U1) rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result|^test " "$OUT/kernels.log" | cut -c1-200
t0=$SECONDS
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$OUT/synth_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 120 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 64 --budget-s 90 --batch 1,8,32 > "$OUT/bench_nvfp4.json" 2> "$OUT/bench_nvfp4.err"
echo "bench nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_X_U1=1 timeout 100 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts --gen 64 --budget-s 60 --batch 8,32 > "$OUT/bench_nvfp4_u1.json" 2> "$OUT/bench_nvfp4_u1.err"
echo "bench nvfp4 u1 rc=$? $((SECONDS - t0))s"
python3 - "$OUT" <<'PY'
import json, sys
for name in ("nvfp4", "nvfp4_u1"):
    try: d = json.load(open(f"{sys.argv[1]}/bench_{name}.json"))
    except Exception as e: print(name, "no json", e); continue
    for br in d["batch_runs"]:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("moe", "swiglu", "gemv_nvfp4"))]
        print(name, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"], "prefill %.3f s" % br["prefill_s"],
              " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
    for r in d.get("runs") or []:
        print(name, "run", {k: round(r[k], 3) for k in r if k in ("prompt_tokens", "decode_tok_s", "decode_default_sampling_tok_s", "prefill_tok_s", "ttft_s")})
PY
