#!/usr/bin/env bash
# Builds everything the H200 run needs, here (x86-64; the device has no Rust toolchain), into
# .gpu/<name>/ (git-ignored), xz-compressed so that binaries + the working tree stay under the
# device tool's 64 MiB carry limit:
#   kernels       the ornith-runtime lib tests (every CUDA kernel test, spec-independent)
#   test_shallow  tests/cuda_model.rs compiled for the shallow preset's spec
#   test_full     the same for the full preset
#   bench_full    ornith-bench for the full preset
#   ornith_full   the ornith binary for the full preset (the sampled-request soak)
#   xtask         to synthesise the real-data checkpoints on the device
#   cubin_sm_90.tar  the build's PTX assembled for sm_90 (`cargo xtask cubin`, ptxas next to nvcc or
#                 PTXAS; left out with a note when there is none): lib.sh serves them to every
#                 binary (ORNITH_CUBIN_DIR), so the device does not JIT the PTX (~100 s a build)
#   with NVFP4=1 also test_shallow_nvfp4, bench_full_nvfp4 and ornith_full_nvfp4 (the NVFP4A16
#   export of those presets; ornith_full_nvfp4 for the batch file through the NVFP4A16 user path)
# Usage: tests/gpu/build.sh NAME        then, on the device: bash tests/gpu/run_h200.sh NAME
#   (BINS="kernels bench_full ...": only those; the cubins always)
# The specs come from headers-only checkpoints (sparse files, seconds); their fingerprints equal
# those of the real-data checkpoints synthesised on the device with the same preset.
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?usage: tests/gpu/build.sh NAME}
out=.gpu/$name
specs=${ORNITH_GPU_SPECS:-/tmp/ornith-gpu-specs}
rm -rf "$out" && mkdir -p "$out" "$specs"
for preset in shallow full; do
    if [ ! -f "$specs/$preset.spec.json" ]; then
        cargo xtask synth --preset $preset --headers-only --out "$specs/$preset" >&2
        ORNITH_SPEC="$specs/$preset.spec.json" cargo xtask gen --model "$specs/$preset" >&2
    fi
    # NVFP4=1: the NVFP4A16 export of the same presets as well (test_shallow_nvfp4, bench_full_nvfp4).
    if [ "${NVFP4:-0}" = 1 ] && [ ! -f "$specs/$preset-nvfp4.spec.json" ]; then
        cargo xtask synth --preset $preset --quant nvfp4a16 --headers-only --out "$specs/$preset-nvfp4" >&2
        ORNITH_SPEC="$specs/$preset-nvfp4.spec.json" cargo xtask gen --model "$specs/$preset-nvfp4" >&2
    fi
done
# The test executable of a cargo test build (the path does not change with the spec: copy at once).
test_exe() {
    cargo test --release "$@" --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] != ["bin"]:
        print(m["executable"])' | tail -1
}
# BINS: which of the binaries below to build (default all; a call comparing builds carries only
# what it runs: the device tool's 64 MiB limit). MODEL_TESTS=0: neither test_shallow nor test_full.
bins=" ${BINS:-kernels test_shallow test_full bench_full ornith_full xtask} "
if [ "${MODEL_TESTS:-1}" != 1 ]; then bins=${bins/ test_shallow / }; bins=${bins/ test_full / }; fi
[ "${NVFP4:-0}" = 1 ] && bins="$bins test_shallow_nvfp4 bench_full_nvfp4 ornith_full_nvfp4 "
want() { [[ $bins == *" $1 "* ]]; }
t=${CARGO_TARGET_DIR:-target}/release
want kernels && cp "$(test_exe -p ornith-runtime --lib)" "$out/kernels"
want test_shallow && cp "$(ORNITH_SPEC=$specs/shallow.spec.json test_exe -p ornith-runtime --test cuda_model)" "$out/test_shallow"
want test_full && cp "$(ORNITH_SPEC=$specs/full.spec.json test_exe -p ornith-runtime --test cuda_model)" "$out/test_full"
want test_shallow_nvfp4 &&
    cp "$(ORNITH_SPEC=$specs/shallow-nvfp4.spec.json test_exe -p ornith-runtime --test cuda_model)" "$out/test_shallow_nvfp4"
for q in "" nvfp4; do  # the FP8 export, then the NVFP4A16 one (binaries *_nvfp4, specs *-nvfp4)
    if want bench_full${q:+_$q}; then
        ORNITH_SPEC=$specs/full${q:+-$q}.spec.json cargo build -q --release -p ornith-runtime --bin ornith-bench
        cp "$t/ornith-bench" "$out/bench_full${q:+_$q}"
    fi
    if want ornith_full${q:+_$q}; then
        ORNITH_SPEC=$specs/full${q:+-$q}.spec.json cargo build -q --release -p ornith-runtime --bin ornith
        cp "$t/ornith" "$out/ornith_full${q:+_$q}"
    fi
done
cargo build -q --release -p xtask  # (the cubins below need it either way)
want xtask && cp "$t/xtask" "$out/xtask"
if "$t/xtask" cubin --arch sm_90 --out "$out/cubin" 2>/dev/null; then
    tar cf "$out/cubin_sm_90.tar" -C "$out/cubin" . && rm -rf "$out/cubin"
else
    rm -rf "$out/cubin"; echo "build.sh: no cubins (no ptxas: set PTXAS or put nvcc on PATH); the device JITs the PTX" >&2
fi
for f in "$out"/*; do case $f in *.tar) ;; *) strip "$f" ;; esac; done
xz -T0 -6 "$out"/*
git rev-parse --short HEAD > "$out/COMMIT"
du -sh "$out"
