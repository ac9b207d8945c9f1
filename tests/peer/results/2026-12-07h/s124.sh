#!/usr/bin/env bash
# Forty-eighth session, second call. Builds (x86 host, not committed):
#   h48  5b1c462 (HEAD before this session): BINS="bench_full xtask" tests/gpu/build.sh h48
#   f48  h48 + next_w47.patch (moe_sort windows, swiglu_quant_ct in registers, moe_combine_prefill
#        8 columns per thread) + the launch's shared-memory opt-in counting the kernel's static
#        shared memory + a 3,072-token moe_sort case: BINS="kernels bench_full" tests/gpu/build.sh f48
# Checks f48's kernel tests (moe_prefill digests against s121's HEAD kernels), then benches f48 and
# h48 alternately (2K / 32K prompts at 8,192-token steps and at the bench's default steps, 8 seqs).
set -uo pipefail
. tests/gpu/lib.sh
export CUDA_CACHE_MAXSIZE=4294967296
unpack_builds h48
unpack_as F f48
H=$G
exec > >(tee "$OUT/summary.txt") 2>&1
echo "ORNITH_CUBIN_DIR=${ORNITH_CUBIN_DIR:-unset}: $(ls /tmp/ornith-cubin 2>/dev/null | wc -l) cubins"
(synth_full > "$OUT/synth_bg.txt" 2>&1; echo "synth done at ${SECONDS}s" >> "$OUT/synth_bg.txt") &
SYN=$!
kernel_tests kf "$F/kernels" moe_sort moe_route_sort moe_prefill moe_combine_prefill swiglu_quant_ct \
    | grep -E "PERF|rc=|result|panicked"
grep -E "moe_prefill" "$OUT/bits_kf.txt" > "$OUT/bits_kfm.txt"
grep -E "moe_prefill" tests/peer/results/2026-12-07g/ref_bits_s121_kb.txt > "$OUT/bits_refm.txt"
same_bits refm kfm
wait $SYN; tail -2 "$OUT/synth_bg.txt"
echo "at ${SECONDS}s"
A="--prompts 2048,32768 --max-batch-tokens 8192 --batch 8"
if [ -f "$C/full/config.json" ]; then
    t0=$SECONDS
    BENCH_TIMEOUT=75 bench f_1 "$F/bench_full" "$C/full" $A
    BENCH_TIMEOUT=75 bench h_1 "$H/bench_full" "$C/full" $A
    BENCH_TIMEOUT=75 bench f_2 "$F/bench_full" "$C/full" $A
    BENCH_TIMEOUT=75 bench h_2 "$H/bench_full" "$C/full" $A
    BENCH_TIMEOUT=75 bench f_d "$F/bench_full" "$C/full" --prompts 2048,32768
    BENCH_TIMEOUT=75 bench h_d "$H/bench_full" "$C/full" --prompts 2048,32768
    bench_rows "moe_sort|swiglu_quant_ct|moe_combine_prefill"
fi
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
