#!/usr/bin/env bash
# NOTE (after the run): the bench and batch-file steps did not run — G pointed at k39b (kernel tests only) after the unpacks; s91 took the base figures.
# Thirty-ninth session, call A. Builds: k39b = d364933's kernel tests (base), k39t = the same with
# next_tail_body.patch (the grouped GEMMs' tail tile as a second loop body), x39 = d364933's xtask
# (4db6e62: the synth writer thread), g39 = 1509185's bench_full / ornith_full (the same kernels
# and engine as HEAD: later commits touched the HTTP paths, synth and docs only).
#  1. prefill GEMM kernel tests, base / tail alternating twice (bits vs the CPU reference, PERF);
#  2. the full FP8 preset synthesised with x39 (timed);
#  3. bench at 2K: 1 / 8 / 32 / 64 sequences; the 256-request batch file; 32K and 128K if time.
set -uo pipefail
. tests/gpu/lib.sh
L=$OUT
unpack_builds k39t; KT=$G
unpack_builds x39; X=$G
unpack_builds g39
unpack_builds k39b; KB=$G
exec > >(tee "$L/summary.txt") 2>&1
T="gemm_nvfp4_matches_reference moe_prefill_matches_reference"
for r in 1 2; do for v in base tail; do
  bin=$KB/kernels; [ $v = tail ] && bin=$KT/kernels
  t0=$SECONDS
  timeout 100 "$bin" --ignored --test-threads=1 --nocapture $T > "$OUT/kernels_${v}_$r.log" 2>&1; echo "kernels $v $r rc=$? $((SECONDS - t0))s"
  grep -E "PERF (gemm_nvfp4_grouped|moe_prefill|gemm_nvfp4 2048)|panicked|test result" "$OUT/kernels_${v}_$r.log" | sed 's/.*PERF/PERF/' | cut -c1-120
done; done
G0=$G; G=$X
rm -rf "$C/full"
synth_full || exit 1
G=$G0
t0=$SECONDS
BENCH_TIMEOUT=130 bench fp8 "$G/bench_full" "$C/full" --prompts 2048 --batch 8,32,64
[ $SECONDS -lt 420 ] && { t0=$SECONDS; timeout 100 python3 tests/gpu/batch_file.py "$G/ornith_full" "$C/full" /tmp/batch_fp8.jsonl 256; echo "batch file fp8 $((SECONDS - t0))s"; }
[ $SECONDS -lt 470 ] && BENCH_TIMEOUT=$((580 - SECONDS)) bench long "$G/bench_full" "$C/full" --prompts 32768,131072 --batch 1
echo "total ${SECONDS}s"
