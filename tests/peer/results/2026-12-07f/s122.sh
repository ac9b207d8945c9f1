#!/usr/bin/env bash
# Forty-sixth session, call C (the session's last ~330 s of device time): the landed form's tests.
# kfin47 / ffin47 = HEAD + moe_sort's staged write-out (moe_sort only, from 2,048 to 16,384 rows, in
# dynamic shared memory; decode groups and moe_route_sort scatter directly as before) +
# conv1d_silu_chunk two channels per thread (qk_norm_rope as HEAD: call B's multi-head form cost
# decode 32 us per step at one sequence). Every PTX module differs from HEAD's (the header's
# stamp), so a HEAD bench here would pay a second JIT: call B's comparison stands for the speed.
set -uo pipefail
. tests/gpu/lib.sh
export CUDA_CACHE_MAXSIZE=4294967296
unpack_builds x45
unpack_as FN ffin47
unpack_as K kfin47
exec > >(tee "$OUT/summary.txt") 2>&1
kernel_tests kf "$K/kernels" moe_sort moe_route_sort moe_prefill conv1d_chunk attention_decode qk_norm_rope_chunk | grep -E "PERF|rc=|result"
echo "at ${SECONDS}s"
synth_at shallow fp8 "$C/shallow-fp8"
t1=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-fp8 timeout $((290 - SECONDS)) "$FN/test_shallow" --ignored --nocapture --test-threads=1 \
    cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance prefix_cache_resume --skip cuda_matches_cpu_at_length \
    > "$OUT/test_shallow_fp8.log" 2>&1
echo "test_shallow fp8 rc=$? $((SECONDS - t1))s"
grep -E "prefill:|batch invariance: (1|8|256) |mixed|prefix cache|panicked|test result" "$OUT/test_shallow_fp8.log" | cut -c1-200
echo "total ${SECONDS}s"
