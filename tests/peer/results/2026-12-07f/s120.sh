#!/usr/bin/env bash
# Forty-sixth session, call A. Builds (x86 host, not committed):
#   k46 / f46 / n46  HEAD 1a943a3's kernel tests, FP8 model binaries, NVFP4A16 model binaries
#   k46a / n46a      the same with next_nvfp4_a_rows_per_stage.patch (NVFP4 96/128-row forms read
#                    A's source rows from p.a_rows per stage)
#   x45              c42b's xtask (the synthesis)
# The kernel tests run first: they also fill the driver's JIT cache for the model binaries of the
# same PTX (the benches then start in seconds).
set -uo pipefail
. tests/gpu/lib.sh
export CUDA_CACHE_MAXSIZE=4294967296
unpack_builds x45
unpack_as K k46
unpack_as KA k46a
unpack_as F f46t
unpack_as N n46b
unpack_as NA n46a
exec > >(tee "$OUT/summary.txt") 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
# 1. HEAD's k_experts_fp8 refactor (d041f5a), never run on a GPU: the MoE block against its reference
kernel_tests k46m "$K/kernels" moe_prefill gemm_fp8 moe_sort | tail -12
# 2. NVFP4 forms: the patch's bits and timings, HEAD's timings beside them
kernel_tests k46an "$KA/kernels" nvfp4 | grep -E "grouped (2048|8192)|rc=|result"
kernel_tests k46n "$K/kernels" nvfp4 | grep -E "grouped (2048|8192)|rc=|result"
echo "at ${SECONDS}s"
# 3. the FP8 model with HEAD against the CPU: quick checks, then 4,097 tokens (two 2,048-token
#    pieces: the 96-row expert tiles in the model path)
synth_at shallow fp8 "$C/shallow-fp8"
t1=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-fp8 timeout 120 "$F/test_shallow" --ignored --nocapture --test-threads=1 \
    cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance --skip cuda_matches_cpu_at_length \
    > "$OUT/test_shallow_fp8.log" 2>&1
echo "test_shallow fp8 rc=$? $((SECONDS - t1))s"
grep -E "prefill:|batch invariance: (1|8|256) |mixed|panicked|test result" "$OUT/test_shallow_fp8.log" | cut -c1-200
t1=$SECONDS
ORNITH_LONG=4097 ORNITH_TEST_MODEL=$C/shallow-fp8 timeout 150 "$F/test_shallow" --ignored --nocapture \
    --test-threads=1 cuda_matches_cpu_at_length > "$OUT/at_length.log" 2>&1
echo "at_length 4097 rc=$? $((SECONDS - t1))s"
grep -vE "^\s*$|uploading" "$OUT/at_length.log" | tail -12 | cut -c1-200
rm -rf "$C/shallow-fp8"
echo "at ${SECONDS}s"
# 4. NVFP4A16 full preset, 2K and 32K in 8,192-token steps, HEAD / patch alternating
if [ $SECONDS -lt 380 ] && synth_full_nvfp4; then
  for i in 1 2; do
    [ $SECONDS -lt 520 ] || break
    BENCH_TIMEOUT=60 bench "n_$i" "$N/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
    BENCH_TIMEOUT=60 bench "na_$i" "$NA/bench_full_nvfp4" "$C/full-nvfp4" --prompts 2048,32768 --max-batch-tokens 8192
  done
fi
# 5. the patched NVFP4 96-row form in the model path: the shallow NVFP4A16 preset at 4,097 tokens
if [ $SECONDS -lt 480 ] && synth_at shallow nvfp4 "$C/shallow-nvfp4"; then
  t1=$SECONDS
  ORNITH_LONG=4097 ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout $((560 - SECONDS)) "$NA/test_shallow_nvfp4" --ignored \
      --nocapture --test-threads=1 cuda_matches_cpu_at_length > "$OUT/at_length_nvfp4.log" 2>&1
  echo "at_length nvfp4 4097 rc=$? $((SECONDS - t1))s"
  grep -vE "^\s*$|uploading" "$OUT/at_length_nvfp4.log" | tail -8 | cut -c1-200
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
