#!/usr/bin/env bash
# Prepared, not run (the forty-fourth session's device time ran out after four failed starts).
# k44f = HEAD + next_fp8_grouped_96.patch (git apply; cargo xtask ptx; /tmp-style kernel build of
# `cargo test --release -p ornith-runtime --lib --no-run` into .gpu/k44f/kernels.xz): its kernel
# tests — moe_prefill (the grouped FP8 GEMM in 64- and 96-row tiles, bit for bit moe_prefill's
# and timed at 1,024 to 8,192 tokens), gemm_fp8, moe_sort. Then the FP8 bench at 2K against HEAD
# (build both with tests/gpu/build.sh) if the 2K MoE block is faster.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds k44f
exec > >(tee "$OUT/summary.txt") 2>&1
kernel_tests k44fa "$G/kernels" moe_prefill | tail -12
kernel_tests k44fb "$G/kernels" gemm_fp8 moe_sort | tail -2
echo "total ${SECONDS}s"
cp "$0" "$OUT/" 2>/dev/null
(cd "$OUT" && tar cJf logs.tar.xz --exclude logs.tar.xz ./* 2>/dev/null && find . -type f ! -name logs.tar.xz \
    ! -name summary.txt -delete; find . -mindepth 1 -type d -empty -delete)
