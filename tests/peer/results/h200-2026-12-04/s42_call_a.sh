#!/usr/bin/env bash
# Session 22, call A (73f6829 builds): Nsight Compute on the NVFP4 MoE products — the grouped
# product at 32 sequences and the per-slot norm/swiglu products at one sequence — to see where
# the NVFP4 expert time goes (issue-bound dequantisation or the codes -> scale -> table chain).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s22a
t0=$SECONDS
"$G/xtask" synth --preset full --quant nvfp4a16 --out "$C/full-nvfp4" > "$OUT/synth_nvfp4.log" 2>&1; echo "synth full nvfp4 rc=$? $((SECONDS - t0))s"
NCU=/usr/local/cuda/bin/ncu
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters"
run_ncu() {  # name regex batch count
    local t0=$SECONDS
    # shellcheck disable=SC2086
    timeout 200 $NCU --profile-from-start off --kernel-name "regex:$2" --launch-count $4 $sections --force-overwrite -o "$OUT/ncu_$1" \
        "$G/bench_full_nvfp4" --model "$C/full-nvfp4" --prompts 2048 --gen 4 --batch $3 > /dev/null 2> "$OUT/ncu_$1.log"
    echo "ncu $1 rc=$? $((SECONDS - t0))s"
    $NCU --import "$OUT/ncu_$1.ncu-rep" --page details --print-units base > "$OUT/ncu_$1.txt" 2>&1
    rm -f "$OUT/ncu_$1.ncu-rep"
    grep -E "^  [a-z_]+|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Ipc A|Registers Per|Grid Size|Warp Cycles Per Issued|No Eligible|Executed Instructions  " "$OUT/ncu_$1.txt" | head -60
    grep -iE "stall|est\. speedup" "$OUT/ncu_$1.txt" | cut -c1-240 | head -16
}
run_ncu g32 "^moe_gemv_nvfp4_grouped$" 32 2
run_ncu b1 "^moe_gemv_nvfp4_(norm|swiglu)$" 1 2
