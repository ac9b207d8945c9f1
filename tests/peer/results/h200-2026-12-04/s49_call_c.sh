#!/usr/bin/env bash
# Session 23, call C (builds .gpu/s23c = a70452c, the committed kernels): every NVFP4 kernel test,
# the shallow NVFP4A16 and FP8 model checks (graph = eager, CUDA vs CPU, batch invariance), then
# the full NVFP4A16 preset at 2K (1, 8, 32, 64 sequences) and at 32K / 128K (batch 1).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s23c
t0=$SECONDS
timeout 100 "$G/kernels" --ignored --test-threads=1 --nocapture nvfp4 > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/kernels.log" | cut -c1-200; t0=$SECONDS
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > "$OUT/synth_shallow.log" 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 100 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow_nvfp4.log" 2>&1
echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/test_shallow_nvfp4.log" | cut -c1-200 | head -6; t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > "$OUT/synth_shallow_fp8.log" 2>&1; echo "synth shallow fp8 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 100 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow_fp8.log" 2>&1
echo "test_shallow fp8 rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/test_shallow_fp8.log" | cut -c1-200 | head -6; t0=$SECONDS
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$OUT/synth_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 110 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 64 --budget-s 90 --batch 1,8,32,64 > "$OUT/bench_nvfp4.json" 2> "$OUT/bench_nvfp4.err"
echo "bench nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 110 "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 32768,131072 --gen 64 --budget-s 90 > "$OUT/bench_nvfp4_long.json" 2> "$OUT/bench_nvfp4_long.err"
echo "bench nvfp4 long rc=$? $((SECONDS - t0))s"
python3 - "$OUT" <<'PY'
import json, sys
for name in ("nvfp4", "nvfp4_long"):
    try: d = json.load(open(f"{sys.argv[1]}/bench_{name}.json"))
    except Exception as e: print(name, "no json", e); continue
    for br in d.get("batch_runs") or []:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("moe", "swiglu", "gemv_nvfp4", "rmsnorm"))]
        print(name, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"], "prefill %.3f s" % br["prefill_s"],
              " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
    for r in d.get("runs") or []:
        print(name, "run", {k: round(r[k], 3) for k in r if k in ("prompt_tokens", "decode_tok_s", "decode_default_sampling_tok_s", "decode_top_p_tok_s", "prefill_tok_s", "ttft_s")})
PY
# Nsight Compute at one sequence on the GDN input projection (BF16 2048 -> 12,352 with the norm
# prologue, ~23 us per launch = ~2.2 TB/s in the kernel test) and the GDN output projection.
NCU=/usr/local/cuda/bin/ncu
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats"
t0=$SECONDS
timeout 150 $NCU --profile-from-start off --kernel-name "regex:^(gemv_bf16_norm|gdn_out_proj)$" --launch-count 4 $sections --force-overwrite -o "$OUT/ncu_b1" \
    "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 4 > /dev/null 2> "$OUT/ncu_b1.log"
echo "ncu b1 rc=$? $((SECONDS - t0))s"
$NCU --import "$OUT/ncu_b1.ncu-rep" --page details --print-units base > "$OUT/ncu_b1.txt" 2>&1
rm -f "$OUT/ncu_b1.ncu-rep"
grep -E "^  [a-z_]+|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Registers Per|Grid Size|Block Limit|Warp Cycles Per Issued|No Eligible" "$OUT/ncu_b1.txt" | head -60
grep -iE "stall" "$OUT/ncu_b1.txt" | cut -c1-240 | head -10
