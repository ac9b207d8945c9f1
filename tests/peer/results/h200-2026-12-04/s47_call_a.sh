#!/usr/bin/env bash
# Session 23, call A (builds .gpu/s23a: f59dfa3 + the per-slot NVFP4 products' table staged in shared memory, and the
# experimental grouped kernel with the same staging under ORNITH_EXP_GST): NVFP4 kernel tests (and
# the grouped ones again with ORNITH_EXP_GST), the shallow NVFP4A16 model checks, then the full
# NVFP4A16 preset at 2K (1, 8, 32 sequences), and 8, 32 sequences with ORNITH_EXP_GST.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s23a
t0=$SECONDS
timeout 100 "$G/kernels" --ignored --test-threads=1 --nocapture nvfp4 > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/kernels.log" | cut -c1-200; t0=$SECONDS
ORNITH_EXP_GST=1 timeout 60 "$G/kernels" --ignored --test-threads=1 --nocapture moe_gemv_nvfp4 moe_nvfp4 > "$OUT/kernels_gst.log" 2>&1; rc=$?
echo "kernels gst rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/kernels_gst.log" | cut -c1-200; t0=$SECONDS
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > "$OUT/synth_shallow.log" 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 100 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow.log" 2>&1
echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/test_shallow.log" | cut -c1-200 | head -6; t0=$SECONDS
ORNITH_EXP_GST=1 ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 60 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 batch_invariance > "$OUT/test_shallow_gst.log" 2>&1
echo "test_shallow_nvfp4 gst rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/test_shallow_gst.log" | cut -c1-200 | head -6; t0=$SECONDS
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$OUT/synth_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 100 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 64 --budget-s 80 --batch 1,8,32 > "$OUT/bench_nvfp4.json" 2> "$OUT/bench_nvfp4.err"
echo "bench nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_EXP_GST=1 timeout 80 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts --gen 64 --budget-s 60 --batch 8,32 > "$OUT/bench_nvfp4_gst.json" 2> "$OUT/bench_nvfp4_gst.err"
echo "bench nvfp4 gst rc=$? $((SECONDS - t0))s"
python3 - "$OUT" <<'PY'
import json, sys
for name in ("nvfp4", "nvfp4_gst"):
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
