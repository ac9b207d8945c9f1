#!/usr/bin/env bash
# Session 22, call B (the dequantisation table + the kernels' sign order + the lane's 32-bit
# offsets): every NVFP4 kernel test, the shallow NVFP4A16 model checks, the full NVFP4A16 preset
# at 2K (1, 8 and 32 sequences), and Nsight Compute on the grouped product at 32 sequences.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s22b
t0=$SECONDS
timeout 200 "$G/kernels" --ignored --test-threads=1 --nocapture nvfp4 > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result|^test " "$OUT/kernels.log" | cut -c1-200
grep -E "^\| (gemv|moe|gemm)_nvfp4" "$OUT/kernels.log" | head -12
t0=$SECONDS
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > "$OUT/synth_shallow.log" 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 150 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu cuda_ops_vs_cpu batch_invariance > "$OUT/test_shallow.log" 2>&1
echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"
grep -E "CPU chunked|decode graph|panicked|test result" "$OUT/test_shallow.log" | cut -c1-200 | head -12
rm -rf "$C/shallow-nvfp4"
t0=$SECONDS
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$OUT/synth_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 120 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 64 --budget-s 90 --batch 1,8,32 > "$OUT/bench_nvfp4.json" 2> "$OUT/bench_nvfp4.err"
echo "bench nvfp4 rc=$? $((SECONDS - t0))s"
python3 - "$OUT" <<'PY'
import json, sys
d = json.load(open(f"{sys.argv[1]}/bench_nvfp4.json"))
for br in d["batch_runs"]:
    ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
    keys = [k for k in ab if k.startswith(("moe", "swiglu"))]
    print("nvfp4", br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"], "prefill %.3f s" % br["prefill_s"],
          " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
for r in d.get("runs") or []:
    print("nvfp4 run", {k: r[k] for k in r if k in ("prompt_tokens", "decode_tok_s", "decode_default_sampling_tok_s", "prefill_tok_s", "ttft_s")})
PY
[ $SECONDS -gt 480 ] && { echo "skip ncu (time)"; exit 0; }
NCU=/usr/local/cuda/bin/ncu
t0=$SECONDS
timeout 100 $NCU --profile-from-start off --kernel-name "regex:^moe_gemv_nvfp4_grouped$" --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section InstructionStats --force-overwrite -o "$OUT/ncu_g32" \
    "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 4 --batch 32 > /dev/null 2> "$OUT/ncu_g32.log"
echo "ncu rc=$? $((SECONDS - t0))s"
$NCU --import "$OUT/ncu_g32.ncu-rep" --page details --print-units base > "$OUT/ncu_g32.txt" 2>&1; rm -f "$OUT/ncu_g32.ncu-rep"
grep -E "Duration|Issue Slots Busy|Executed Instructions  |Compute \(SM\)|ALU is" "$OUT/ncu_g32.txt" | head -12
