#!/usr/bin/env bash
# Session 23, call E (builds .gpu/s23e = c49af1d + the per-slot NVFP4 products' table staged in
# shared memory, waited for just before the prologue's closing barrier): the NVFP4 kernel tests,
# the full NVFP4A16 preset at 2K (1 sequence), then the shallow NVFP4A16 model checks.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s23e
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
timeout 60 "$G/kernels" --ignored --test-threads=1 --nocapture nvfp4 > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/kernels.log" | cut -c1-200; t0=$SECONDS
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > /dev/null 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 60 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 64 --budget-s 40 --batch 1 > "$OUT/bench_nvfp4.json" 2> "$OUT/bench_nvfp4.err"
echo "bench nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
python3 - "$OUT" <<'PY'
import json, sys
d = json.load(open(f"{sys.argv[1]}/bench_nvfp4.json"))
for br in d.get("batch_runs") or []:
    ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
    keys = [k for k in ab if k.startswith(("moe", "swiglu", "gemv_nvfp4", "rmsnorm"))]
    print(br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"], " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
for r in d.get("runs") or []:
    print("run", {k: round(r[k], 3) for k in r if k in ("prompt_tokens", "decode_tok_s", "decode_default_sampling_tok_s", "decode_top_p_tok_s", "prefill_tok_s")})
PY
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > /dev/null 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 70 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow_nvfp4.log" 2>&1
echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/test_shallow_nvfp4.log" | cut -c1-200 | head -4
