#!/usr/bin/env bash
# Session 24, call F (the kernel tests of .gpu/s24e = 8690549 under Nsight Compute): why the GDN input
# projection's shape streams slower than the lm_head. gemv_bf16 (narrow, 1 token) at 2048 -> 12,352
# and at 2048 -> 248,320, and gemv_bf16_norm at 2048 -> 12,352, L2 flushed before each (ncu's default).
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s24e
exec > >(tee "$OUT/summary.txt") 2>&1
NCU=/usr/local/cuda/bin/ncu
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats"
t0=$SECONDS
timeout 150 $NCU --kernel-name regex:"^gemv_bf16$" --launch-count 40 $sections -o "$OUT/ncu_gemv" \
  "$G/kernels" --ignored --test-threads=1 gemv_bf16_matches_reference > "$OUT/ncu_gemv.log" 2>&1
echo "ncu gemv rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 100 $NCU --kernel-name regex:"^gemv_bf16_norm$" --launch-count 12 $sections -o "$OUT/ncu_norm" \
  "$G/kernels" --ignored --test-threads=1 norm_prologue > "$OUT/ncu_norm.log" 2>&1
echo "ncu norm rc=$? $((SECONDS - t0))s"
for r in gemv norm; do
  $NCU --import "$OUT/ncu_$r.ncu-rep" --page details --print-units base > "$OUT/ncu_$r.txt" 2>&1; rm -f "$OUT/ncu_$r.ncu-rep"
done
python3 - "$OUT" <<'PY'
import re, sys
keys = ["Grid Size", "Duration", "DRAM Throughput", "Memory Throughput", "L2 Hit Rate", "L1/TEX Hit Rate", "Achieved Occupancy",
        "Registers Per Thread", "Eligible Warps Per Scheduler", "No Eligible", "Mem Busy", "Max Bandwidth", "Mem Pipes Busy"]
for r in ("gemv", "norm"):
    cur = None; rows = []
    for line in open(f"{sys.argv[1]}/ncu_{r}.txt"):
        m = re.match(r"^  (\w+)\s*\(", line)
        if m: cur = {"k": m.group(1)}; rows.append(cur); continue
        if cur is None: continue
        for k in keys:
            if line.strip().startswith(k) and k not in cur:
                cur[k] = line.split()[-1]
    for c in rows:
        if c.get("Grid Size") in ("386", "1940", "1544", "772") or r == "norm":
            print(r, c["k"], " ".join(f"{k}={c.get(k, '-')}" for k in keys))
PY
grep -iE "stall|sectors/req|uncoalesced|row buffer|DRAM" "$OUT/ncu_norm.txt" | sort | uniq -c | sort -rn | head -12 | cut -c1-220
