#!/usr/bin/env bash
# Whether two versions of kernels/cuda/gdn_chunk.cu give the same bits, on the CPU (tests/emu/README.md):
#   tests/emu/compare_gdn_chunk.sh A B [TOKENS...]
# A and B: a git revision, or a directory holding kernels/ (a worktree). Each is built twice (g++
# -ffp-contract=off and =fast: without and with fused multiply-adds, as nvcc contracts
# `acc += a * b`) and run at each token count (default 1 63 130 200 777); o and the final state
# must be equal byte for byte. Exit status 0 when every pair is identical.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/emu/lib.sh
a=${1:?usage: compare_gdn_chunk.sh A B [TOKENS...]}
b=${2:?usage: compare_gdn_chunk.sh A B [TOKENS...]}
shift 2
tokens=${*:-1 63 130 200 777}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for side in a b; do
    emu_prepare "${!side}" "$tmp/$side"
    for fc in off fast; do emu_build "$tmp/$side" tests/emu/gdn_chunk.cpp "$tmp/$side/run_$fc" $fc; done
done
rc=0
for t in $tokens; do
    for fc in off fast; do
        "$tmp/a/run_$fc" "$t" "$tmp/a.bin" > /dev/null
        "$tmp/b/run_$fc" "$t" "$tmp/b.bin" > /dev/null
        if cmp -s "$tmp/a.bin" "$tmp/b.bin"; then echo "tokens $t, contraction $fc: identical"
        else echo "tokens $t, contraction $fc: DIFFERENT"; rc=1; fi
    done
done
exit $rc
