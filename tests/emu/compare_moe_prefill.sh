#!/usr/bin/env bash
# Whether two versions of kernels/cuda/moe_prefill.cu give the same bits, on the CPU
# (tests/emu/README.md): tests/emu/compare_moe_prefill.sh A B
# A and B: a git revision, or a directory holding kernels/ (a worktree). A runs the combine one
# column per thread, B in both forms; every output of B must equal A's byte for byte (the sort
# compared in its canonical form, see moe_prefill.cpp), with and without fused multiply-adds.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tests/emu/lib.sh
a=${1:?usage: compare_moe_prefill.sh A B}
b=${2:?usage: compare_moe_prefill.sh A B}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rc=0
for side in a b; do emu_prepare "${!side}" "$tmp/$side"; done
for fc in off fast; do
    for side in a b; do emu_build "$tmp/$side" tests/emu/moe_prefill.cpp "$tmp/$side/run_$fc" $fc; done
    "$tmp/a/run_$fc" scalar "$tmp/a.bin" > "$tmp/a.txt"
    for form in scalar vector; do
        "$tmp/b/run_$fc" $form "$tmp/b.bin" > "$tmp/b.txt" || { echo "B ($form): moe_sort inconsistent"; rc=1; }
        if cmp -s "$tmp/a.bin" "$tmp/b.bin"; then echo "contraction $fc, B's combine $form: identical"
        else echo "contraction $fc, B's combine $form: DIFFERENT"; rc=1; fi
    done
    cat "$tmp/b.txt"
done
exit $rc
