#!/usr/bin/env bash
# Nsight Compute on kernel tests: no checkpoint needed (profile.sh profiles the bench's ranges on
# the full preset). Runs the `kernels` binary of .gpu/NAME (tests/gpu/build.sh, or any build of
# the ornith-runtime lib tests) under ncu, one test per job, and profiles launches of one kernel.
# Each JOB is TEST,KERNEL,SKIP[,COUNT]: the test by its full name (--exact), the kernel's name,
# how many of its launches to pass over first (a test's checked shapes come before its PERF
# ones), and how many to profile (default 1).
# Usage: tests/gpu/profile_kernels.sh NAME JOB [JOB ...]
#   e.g. tests/gpu/profile_kernels.sh k41 cuda::prefill_tests::gemm_bf16_matches_reference,gemm_bf16,15
# Per job: $OUT/ncuk_<i>.txt (the details page), $OUT/ncuk_<i>.csv (every metric), with KEEP_REP=1
# the report; on stdout a line per profiled launch (ncu_summary.py: duration, DRAM / L2 / L1
# throughput, issue slots busy, occupancy, IPC, the largest stall reasons).
set -uo pipefail
name=${1:?usage: tests/gpu/profile_kernels.sh NAME TEST,KERNEL,SKIP[,COUNT] ...}
shift
. "$(dirname "$0")/lib.sh"
unpack_builds "$name"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
[ -x "$NCU" ] || { echo "profile_kernels: no Nsight Compute at $NCU"; exit 1; }
[ -x "$G/kernels" ] || { echo "profile_kernels: no kernels binary in .gpu/$name"; exit 1; }
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats
 --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats
 --section MemoryWorkloadAnalysis_Tables"
# NCU_SOURCE=1: per-instruction stall sampling too (SourceCounters), exported as ${tag}_<i>.sass.csv
# (the source page, SASS) and summarised by ncu_sass_summary.py (stall samples by opcode, the
# hottest instructions).
[ "${NCU_SOURCE:-0}" = 1 ] && sections="$sections --section SourceCounters"
tag=${NCU_TAG:-ncuk}  # the files' prefix (NCU_TAG: several runs into one $OUT)
i=0
for job in "$@"; do
    i=$((i + 1))
    IFS=, read -r test kernel skip count <<< "$job"
    t0=$SECONDS
    # shellcheck disable=SC2086
    timeout "${NCU_TIMEOUT:-200}" "$NCU" --kernel-name "$kernel" --launch-skip "${skip:-0}" --launch-count "${count:-1}" $sections \
        --force-overwrite -o "$OUT/${tag}_$i" "$G/kernels" --ignored --exact --test-threads=1 "$test" \
        > "$OUT/${tag}_$i.log" 2>&1
    echo "job $i ($kernel in $test, skip ${skip:-0}) rc=$? $((SECONDS - t0))s"
    if [ "${NCU_SOURCE:-0}" = 1 ]; then
        "$NCU" --import "$OUT/${tag}_$i.ncu-rep" --page source --csv --print-source sass > "$OUT/${tag}_$i.sass.csv" 2>&1
        python3 "$GPU_SCRIPTS/ncu_sass_summary.py" "$OUT/${tag}_$i.sass.csv"
    fi
    ncu_export "$OUT/${tag}_$i"
done
