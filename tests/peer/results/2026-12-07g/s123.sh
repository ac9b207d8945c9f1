#!/usr/bin/env bash
# Prepared in the forty-seventh session (which got no device): the next session's first call.
# Builds (x86 host, not committed; every build carries its cubins, so nothing here JIT-compiles
# PTX except the one run that measures the driver's JIT on purpose):
#   h48  HEAD (this session's last commit):    BINS="bench_full xtask" tests/gpu/build.sh h48
#   w48  HEAD + next_w47.patch + next_conv4.patch, `cargo xtask ptx` (the patch carries
#        kernels/src/bindings.rs as bindgen writes it):  BINS="kernels" tests/gpu/build.sh w48
#        = moe_sort's staging decided by the launcher alone (the kernel reads its window from
#        %dynamic_smem_size), staged up to 65,536 rows in 32,768-row windows (8,192-token steps);
#        swiglu_quant_ct holding rows of <= 512 values in registers (silu once per value);
#        moe_combine_prefill with 8 columns per thread; new kernel tests moe_combine_prefill and
#        swiglu_quant_ct; gdn_chunked_matches_reference prints a digest of o and the state;
#        conv1d_silu_chunk with four channels per thread where channels and stride allow
#   s48  w48 + next_s47.patch, `cargo xtask ptx`: BINS="kernels test_shallow bench_full" tests/gpu/build.sh s48
#        = gdn_chunk_scan in four warps with 4 x 4 thread tiles (X|Y, S') and 2 x 4 (Vn, O)
# Carry: .gpu/h48 .gpu/w48 .gpu/s48 (~21 MB with the ~33 MB tree).
# Checks: w48's kernel tests (moe_prefill digests against s121's HEAD kernels: swiglu_quant_ct and
# moe_combine_prefill must keep every bit), s48's GDN test (digests against w48's = HEAD's scan),
# the shallow FP8 model checks with s48; then the full preset (synthesised in the background):
# s48 / h48 benches from cubins, h48 once more with the driver's JIT (JIT-vs-cubin speed: the
# first time measured), s48 again. Each bench: prefill at 2K and 32K (8,192-token steps), decode
# at one sequence (greedy, default sampling, top-p) after each, and 8 sequences of 2K prompts.
set -uo pipefail
. tests/gpu/lib.sh
export CUDA_CACHE_MAXSIZE=4294967296
unpack_builds h48
unpack_as W w48
unpack_as S s48
H=$G
exec > >(tee "$OUT/summary.txt") 2>&1
echo "ORNITH_CUBIN_DIR=${ORNITH_CUBIN_DIR:-unset}: $(ls /tmp/ornith-cubin 2>/dev/null | wc -l) cubins"
(synth_full > "$OUT/synth_bg.txt" 2>&1; echo "synth done at ${SECONDS}s" >> "$OUT/synth_bg.txt") &
SYN=$!
kernel_tests kw "$W/kernels" moe_sort moe_route_sort moe_prefill moe_combine_prefill swiglu_quant_ct \
    fp8_quantisers conv1d_chunk gdn_chunked | grep -E "PERF|rc=|result|panicked"
grep -E "moe_prefill" "$OUT/bits_kw.txt" > "$OUT/bits_kwm.txt"
grep -E "moe_prefill" tests/peer/results/2026-12-07g/ref_bits_s121_kb.txt > "$OUT/bits_refm.txt"
same_bits refm kwm
echo "at ${SECONDS}s"
kernel_tests ks "$S/kernels" gdn_chunked | grep -E "PERF|rc=|result|panicked"
grep gdn_chunked "$OUT/bits_kw.txt" > "$OUT/bits_kwg.txt"; grep gdn_chunked "$OUT/bits_ks.txt" > "$OUT/bits_ksg.txt"
same_bits kwg ksg
echo "at ${SECONDS}s"
synth_at shallow fp8 "$C/shallow-fp8"
t1=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-fp8 timeout 150 "$S/test_shallow" --ignored --nocapture --test-threads=1 \
    cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance prefix_cache_resume --skip cuda_matches_cpu_at_length \
    > "$OUT/test_shallow_fp8.log" 2>&1
echo "test_shallow fp8 (s48) rc=$? $((SECONDS - t1))s"
grep -E "prefill:|batch invariance: (1|8|256) |mixed|prefix cache|panicked|test result" "$OUT/test_shallow_fp8.log" | cut -c1-200
rm -rf "$C/shallow-fp8"
wait $SYN; tail -2 "$OUT/synth_bg.txt"
echo "at ${SECONDS}s"
A="--prompts 2048,32768 --max-batch-tokens 8192 --batch 8"
if [ -f "$C/full/config.json" ]; then
    t0=$SECONDS
    BENCH_TIMEOUT=75 bench s_1 "$S/bench_full" "$C/full" $A
    BENCH_TIMEOUT=75 bench h_1 "$H/bench_full" "$C/full" $A
    [ $SECONDS -lt 380 ] && (unset ORNITH_CUBIN_DIR; BENCH_TIMEOUT=180 bench h_jit "$H/bench_full" "$C/full" $A)
    [ $SECONDS -lt 500 ] && BENCH_TIMEOUT=75 bench s_2 "$S/bench_full" "$C/full" $A
    bench_rows "moe_sort|swiglu_quant_ct|moe_combine_prefill|gdn_chunk_scan|gdn_chunk_prep|conv1d_silu_chunk"
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
