#!/usr/bin/env bash
# Nsight Compute on the full preset's decode steps and prefill, from the binaries that
# tests/gpu/build.sh NAME left in .gpu/NAME (bench_full and xtask are enough). ornith-bench runs
# under `ncu --profile-from-start off`, which profiles only the bench's profiler ranges
# (CudaContext::profiler_range): one replayed decode step of each run (batch 1 and batched) and
# the batch-1 runs' event-timed prefill. Each JOB is BATCH:REGEX:COUNT — BATCH 1: a 2K prompt at
# batch 1 (its decode step, then its prefill), N > 1: N sequences of 2K prompts (their batched step
# only); the first COUNT launches of kernels whose name matches REGEX in those ranges are profiled.
# Usage: tests/gpu/profile.sh NAME JOB [JOB ...]
#   e.g. tests/gpu/profile.sh s17 '8:^moe_gemv_grouped$:2' '1:gdn_chunk_scan|gemm_fp8_grouped:4'
# EXPORT=nvfp4: the NVFP4A16 export instead (bench_full_nvfp4 of a build made with NVFP4=1, and
# the full-nvfp4 checkpoint).
# Per job: $OUT/ncu_<i>.txt (the details page), $OUT/ncu_<i>.csv (every metric), with KEEP_REP=1
# $OUT/ncu_<i>.ncu-rep (for the Nsight Compute GUI), and a short table on stdout (duration, DRAM
# and L1 throughput, achieved occupancy, issue rate, the warp-state breakdown's largest stalls).
set -uo pipefail
name=${1:?usage: tests/gpu/profile.sh NAME BATCH:REGEX:COUNT ...}
shift
. "$(dirname "$0")/lib.sh"
unpack_builds "$name"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
[ -x "$NCU" ] || { echo "profile: no Nsight Compute at $NCU"; exit 1; }
if [ "${EXPORT:-fp8}" = nvfp4 ]; then
    bench=$G/bench_full_nvfp4 model=$C/full-nvfp4
    synth_full_nvfp4 || exit 1
else
    bench=$G/bench_full model=$C/full
    synth_full || exit 1
fi
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
 --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis"
i=0
for job in "$@"; do
    i=$((i + 1))
    IFS=: read -r bsz regex count <<< "$job"
    if [ "$bsz" = 1 ]; then bench_args=(--prompts 2048 --gen 4); else bench_args=(--prompts --gen 4 --batch "$bsz"); fi
    t0=$SECONDS
    # shellcheck disable=SC2086
    timeout "${NCU_TIMEOUT:-400}" "$NCU" --profile-from-start off --kernel-name "regex:$regex" --launch-count "$count" $sections \
        --force-overwrite -o "$OUT/ncu_$i" "$bench" --model "$model" "${bench_args[@]}" \
        > "$OUT/ncu_$i.bench.json" 2> "$OUT/ncu_$i.log"
    echo "job $i ($job) rc=$? $((SECONDS - t0))s"
    [ "${KEEP_REP:-0}" = 1 ] || rm -f "$OUT/ncu_$i.bench.json"
    ncu_export "$OUT/ncu_$i"
done
