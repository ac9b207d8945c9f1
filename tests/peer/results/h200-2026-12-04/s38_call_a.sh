#!/usr/bin/env bash
# Session 21, call A (0bf7ce9: moe_combine in the per-slot down products' epilogue): the MoE
# kernel tests (FP8 and NVFP4 prologues + the combine epilogue), the shallow model checks, the
# full preset at 2K (1 and 8 sequences) and 128K (batch 1), and Nsight Compute on the grouped
# MoE products at 8 sequences (where the step's time goes: 2.9 TB/s of touched bytes).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s21a
t0=$SECONDS
timeout 150 "$G/kernels" --ignored --test-threads=1 --nocapture swiglu_prologue moe_nvfp4_prologues moe_decode > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result|^test " "$OUT/kernels.log" | cut -c1-200
t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > "$OUT/synth_shallow.log" 2>&1; echo "synth shallow rc=$? $((SECONDS - t0))s"
ORNITH_TEST_MODEL=$C/shallow timeout 150 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu cuda_ops_vs_cpu batch_invariance > "$OUT/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"
grep -E "CPU chunked|decode graph|panicked|test result" "$OUT/test_shallow.log" | cut -c1-200 | head -12
rm -rf "$C/shallow"
synth_full || exit 1
t0=$SECONDS
timeout 100 "$G/bench_full" --model "$C/full" --prompts 2048 --gen 64 --budget-s 70 --batch 1,8 > "$OUT/bench_2k.json" 2> "$OUT/bench_2k.err"
echo "bench 2k rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 100 "$G/bench_full" --model "$C/full" --prompts 131072 --gen 64 --budget-s 70 --batch 1 > "$OUT/bench_long.json" 2> "$OUT/bench_long.err"
echo "bench long rc=$? $((SECONDS - t0))s"
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
for b in ("2k", "long"):
    try: d = json.load(open(f"{o}/bench_{b}.json"))
    except Exception as e: print(b, "no json", e); continue
    for br in d["batch_runs"]:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("moe", "swiglu"))]
        print(b, br["prompt_tokens"], br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"],
              "prefill %.3f s" % br["prefill_s"], " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
PY
NCU=/usr/local/cuda/bin/ncu
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis"
t0=$SECONDS
# shellcheck disable=SC2086
timeout 200 $NCU --profile-from-start off --kernel-name "regex:^moe_gemv_grouped$" --launch-count 2 $sections --force-overwrite -o "$OUT/ncu_1" \
    "$G/bench_full" --model "$C/full" --prompts 2048 --gen 4 --batch 8 > /dev/null 2> "$OUT/ncu_1.log"
echo "ncu rc=$? $((SECONDS - t0))s"
$NCU --import "$OUT/ncu_1.ncu-rep" --page details --print-units base > "$OUT/ncu_1.txt" 2>&1
rm -f "$OUT/ncu_1.ncu-rep"
grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Ipc A|Registers Per|Block Limit|Grid Size|Warp Cycles Per Issued|No Eligible|One or More" "$OUT/ncu_1.txt" | head -60
grep -iE "stall|est\. speedup" "$OUT/ncu_1.txt" | cut -c1-220 | head -20
