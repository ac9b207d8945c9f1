# Sourced by the tests/emu scripts (tests/emu/README.md).
# emu_prepare SRC DIR: kernels/cuda and kernels/include of SRC — a git revision, or a directory
# holding kernels/ (a worktree) — copied into DIR and prepared for emu.h: common.cuh includes emu.h
# first and loses its two PTX statements (griddepcontrol: no-ops here), each `extern __shared__`
# array becomes a pointer to the harness's emu_smem, and a read of %dynamic_smem_size becomes
# emu_dynamic_smem.
EMU_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
emu_prepare() {
    local src=$1 dir=$2
    mkdir -p "$dir"
    if [ -d "$src/kernels/cuda" ]; then
        cp "$src"/kernels/cuda/*.cu "$src"/kernels/cuda/*.cuh "$src"/kernels/include/*.h "$dir"/
    else
        git archive "$src" kernels/cuda kernels/include | tar x -C "$dir"
        mv "$dir"/kernels/cuda/* "$dir"/kernels/include/* "$dir"/ && rm -r "$dir/kernels"
    fi
    sed -i -e 's|#include "../include/ornith_kernels.h"|#include "ornith_kernels.h"|' \
        -e 's|asm volatile("griddepcontrol\.[a-z_]*;" ::: "memory");||' -e '1i #include "emu.h"' "$dir/common.cuh"
    sed -i -e 's|extern __shared__ __align__([0-9]*) \([a-z0-9_]*\) \([A-Za-z0-9_]*\)\[\];|\1 *\2 = reinterpret_cast<\1 *>(emu_smem);|' \
        -e 's|asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(\([a-z]*\)));|\1 = (unsigned)emu_dynamic_smem;|' "$dir"/*.cu
}
# emu_build DIR HARNESS OUT CONTRACTION: the harness (including its kernel file from DIR) built with
# $CXX (default g++; C++20 with <barrier>: g++ 11+, clang++ 14+), fused multiply-adds allowed
# (x86-64: -mfma; aarch64 has them) and contracted or not (off / fast).
emu_build() {
    local fma=""
    [ "$(uname -m)" = x86_64 ] && fma=-mfma
    "${CXX:-g++}" -std=c++20 -O2 $fma -ffp-contract="$4" -Wno-unknown-pragmas -I "$1" -I "$EMU_DIR" \
        -I "$EMU_DIR/cuda" -o "$3" "$2" -lpthread
}
