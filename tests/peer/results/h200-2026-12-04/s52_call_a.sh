#!/usr/bin/env bash
# Session 24, call A (builds .gpu/s24a = 44d716d + gemv_nvfp4's fold in its own loop + the
# experimental gemv_bf16_norm_s2/_s3/_s4: L2 prefetch of the first rounds before the wait and
# S register sets streamed after the prologue, chosen by ORNITH_EXP_NORM): the NVFP4 and
# norm-prologue kernel tests (the review commits' helpers, the fold), the variants' bit-exact
# checks and PERF lines, the shallow NVFP4A16 model checks, then the full NVFP4A16 preset at 2K
# batch 1 with each variant.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s24a
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
timeout 90 "$G/kernels" --ignored --test-threads=1 --nocapture nvfp4 norm_prologue > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result|PERF norm" "$OUT/kernels.log" | cut -c1-200; t0=$SECONDS
for v in s2 s3 s4; do
ORNITH_EXP_NORM=$v timeout 40 "$G/kernels" --ignored --test-threads=1 --nocapture norm_prologue > "$OUT/kernels_$v.log" 2>&1; rc=$?
echo "norm_prologue $v rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result|PERF norm" "$OUT/kernels_$v.log" | cut -c1-200; t0=$SECONDS
done
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > /dev/null 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 70 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow_nvfp4.log" 2>&1
echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/test_shallow_nvfp4.log" | cut -c1-200 | head -4; t0=$SECONDS
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > /dev/null 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
for v in base s2 s3 base2; do
ORNITH_EXP_NORM=$v timeout 60 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 64 --budget-s 40 --batch 1 > "$OUT/bench_$v.json" 2> "$OUT/bench_$v.err"
echo "bench $v rc=$? $((SECONDS - t0))s"; t0=$SECONDS
done
python3 - "$OUT" <<'PY'
import json, sys
for v in ("base", "s2", "s3", "base2"):
    try: d = json.load(open(f"{sys.argv[1]}/bench_{v}.json"))
    except Exception as e: print(v, "no json", e); continue
    for br in d.get("batch_runs") or []:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("moe", "gemv", "gdn", "conv"))]
        print(v, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"], " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
PY
