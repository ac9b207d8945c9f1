#!/usr/bin/env bash
# Session 26: the first GPU run of the kernel tests of HEAD acbbd74: apply_penalties (new), the
# sampler, nvfp4 (750a70b's fp4_params review) and the norm prologues.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s26k
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
timeout 200 "$G/kernels" --ignored --test-threads=1 apply_penalties sample argmax nvfp4 norm_prologue > "$OUT/kernels.log" 2>&1
echo "kernels rc=$? $((SECONDS - t0))s"
grep -E "^test |panicked|test result" "$OUT/kernels.log" | cut -c1-200
