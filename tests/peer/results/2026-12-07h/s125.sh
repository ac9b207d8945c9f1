#!/usr/bin/env bash
# Prepared in the forty-eighth session (its device budget went on failed starts): the next
# session's first call. Builds (x86 host, not committed):
#   f48  fdd90d3 or later (the landed moe_prefill.cu kernels; launches opt into dynamic shared
#        memory by static + dynamic > 48 KiB; a 3,072-token moe_sort case):
#        BINS="kernels bench_full" tests/gpu/build.sh f48
#   q48  f48 + next_qk_rope_warp.patch, `cargo xtask ptx` (qk_norm_rope one warp per (token, head)
#        row, 4 rows per block, the one-block-per-row kernel's sum order kept: same bits):
#        BINS="kernels test_shallow bench_full" tests/gpu/build.sh q48
# Build both from the same tree (the attention group test's digest line came after the first
# builds). Carry .gpu/f48 .gpu/q48 (~26 MB with the ~35 MB tree).
# Checks: f48's kernel tests (moe_prefill digests against s121's HEAD kernels; moe_sort at 3,072
# tokens: 48 KiB of dynamic shared memory, refused before fdd90d3), q48's qk_norm_rope / decode
# attention digests against f48's and s121's, the shallow FP8 model checks with q48; then benches
# q48 / f48 alternating (2K / 32K at 8,192-token steps, decode 1 and 8 sequences) and the
# kernels' rows.
set -uo pipefail
. tests/gpu/lib.sh
export CUDA_CACHE_MAXSIZE=4294967296
unpack_builds f48
unpack_as Q q48
F=$G
exec > >(tee "$OUT/summary.txt") 2>&1
echo "ORNITH_CUBIN_DIR=${ORNITH_CUBIN_DIR:-unset}: $(ls /tmp/ornith-cubin 2>/dev/null | wc -l) cubins"
(synth_full > "$OUT/synth_bg.txt" 2>&1; echo "synth done at ${SECONDS}s" >> "$OUT/synth_bg.txt") &
SYN=$!
kernel_tests kf "$F/kernels" moe_sort moe_route_sort moe_prefill moe_combine_prefill swiglu_quant_ct \
    qk_norm_rope attention_decode | grep -E "PERF|rc=|result|panicked"
grep -E "moe_prefill" "$OUT/bits_kf.txt" > "$OUT/bits_kfm.txt"
grep -E "moe_prefill" tests/peer/results/2026-12-07g/ref_bits_s121_kb.txt > "$OUT/bits_refm.txt"
same_bits refm kfm
grep -E "qk_norm_rope" tests/peer/results/2026-12-07g/ref_bits_s121_kb.txt > "$OUT/bits_refq.txt"
grep -E "qk_norm_rope|atten" "$OUT/bits_kf.txt" > "$OUT/bits_kfq.txt"
kernel_tests kq "$Q/kernels" qk_norm_rope attention_decode | grep -E "PERF|rc=|result|panicked"
grep -E "qk_norm_rope|atten" "$OUT/bits_kq.txt" > "$OUT/bits_kqa.txt"
same_bits kfq kqa
grep -E "qk_norm_rope" "$OUT/bits_kq.txt" > "$OUT/bits_kqq.txt"
same_bits refq kqq
echo "at ${SECONDS}s"
synth_at shallow fp8 "$C/shallow-fp8"
t1=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-fp8 timeout 150 "$Q/test_shallow" --ignored --nocapture --test-threads=1 \
    cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance prefix_cache_resume --skip cuda_matches_cpu_at_length \
    > "$OUT/test_shallow_fp8.log" 2>&1
echo "test_shallow fp8 (q48) rc=$? $((SECONDS - t1))s"
grep -E "prefill:|batch invariance: (1|8|256) |mixed|prefix cache|panicked|test result" "$OUT/test_shallow_fp8.log" | cut -c1-200
rm -rf "$C/shallow-fp8"
wait $SYN; tail -2 "$OUT/synth_bg.txt"
echo "at ${SECONDS}s"
A="--prompts 2048,32768 --max-batch-tokens 8192 --batch 8"
if [ -f "$C/full/config.json" ]; then
    t0=$SECONDS
    BENCH_TIMEOUT=75 bench q_1 "$Q/bench_full" "$C/full" $A
    BENCH_TIMEOUT=75 bench f_1 "$F/bench_full" "$C/full" $A
    BENCH_TIMEOUT=75 bench q_2 "$Q/bench_full" "$C/full" $A
    BENCH_TIMEOUT=75 bench f_2 "$F/bench_full" "$C/full" $A
    bench_rows "qk_norm_rope|moe_sort|swiglu_quant_ct|moe_combine_prefill"
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
