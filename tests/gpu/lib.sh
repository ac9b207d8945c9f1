# Shared by the H200 scripts (run_h200.sh, variants.sh): sourced, never run.
# unpack_builds NAME: sets src (.gpu/NAME), G (the unpacked binaries), C (checkpoints), OUT (logs;
# $OUT if set), unpacks every .gpu/NAME/*.xz into $G and prints the build's commit and the GPU; a
# build's cubins (cubin_sm_90.tar, `cargo xtask cubin`) go to /tmp/ornith-cubin, shared by every
# build (named by their PTX's digest), and ORNITH_CUBIN_DIR points there, so no binary JIT-compiles
# a module whose cubin came with its build (JIT=1 before sourcing: none used, the driver JITs all).
# unpack_as VAR NAME: the same for a second build, its directory in VAR and G unchanged.
# unxz_to FILE.xz DEST: one xz-compressed binary, executable. synth_at PRESET Q DIR: a preset in
# export Q (fp8 or nvfp4) synthesised at DIR, logged and timed. synth_full: the full preset's FP8
# checkpoint at $C/full, synthesised once per machine (reused while it stays warm); non-zero, with
# a line saying why, when it cannot (no xtask among the build's binaries, or the synthesis failed).
# synth_full_nvfp4: the same for the full preset's NVFP4A16 export at $C/full-nvfp4 (the two take
# 75 GB together: delete one before the other on a 64 GB disk). bench NAME BIN MODEL ARGS...: one
# ornith-bench run (--gen 16 unless ARGS say otherwise; 100 s at most, BENCH_TIMEOUT to change),
# JSON to /tmp/bench_NAME.json, stderr to $OUT/bench_NAME.err, and its table rows and errors
# printed with the seconds since the last step ($t0, which it resets). shallow_checks BIN [Q]: a
# variant's quick model checks (graph = eager, CUDA vs CPU, batch invariance) on the shallow
# preset's FP8 (or Q = nvfp4: NVFP4A16) export, synthesised for them and removed after.
# kernel_tests V BIN TEST...: named kernel tests of a build, their PERF lines and output digests;
# same_bits A B: two such runs' digests compared.
# ncu_export BASE: an Nsight Compute report's details page, metrics and summary ($NCU set).
# bench_rows KERNELS: every bench log's kernel-loading note and the named kernels' table rows.
GPU_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this folder, absolute (for its helpers)
unxz_to() {
    python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' "$1" "$2"
    chmod +x "$2"
}
unpack_builds() {
    src=.gpu/$1; G=/tmp/ornith-gpu/$1; C=/tmp/ornith-ck; OUT=${OUT:-/tmp/ornith-out}
    mkdir -p "$G" "$C" "$OUT"
    for f in "$src"/*.xz; do unxz_to "$f" "$G/$(basename "$f" .xz)"; done
    if [ -f "$G/cubin_sm_90.tar" ] && [ "${JIT:-0}" != 1 ]; then
        mkdir -p /tmp/ornith-cubin && tar xf "$G/cubin_sm_90.tar" -C /tmp/ornith-cubin
        export ORNITH_CUBIN_DIR=/tmp/ornith-cubin
    fi
    echo "commit $(cat "$src/COMMIT" 2>/dev/null)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
}
unpack_as() {  # VAR NAME: unpack_builds NAME and set VAR to its binaries' directory, G left as it
    # was (scripts comparing builds: `unpack_builds base; unpack_as NEW new` keeps $G the base's)
    local keep=${G-}
    unpack_builds "$2"
    printf -v "$1" '%s' "$G"
    G=$keep
}
synth_at() {  # PRESET Q DIR: that preset in export Q (fp8 or nvfp4) synthesised at DIR now; its log
    # $OUT/synth_<DIR's name>.log, a line "synth <DIR's name> rc=... ...s"; xtask's status
    local t0=$SECONDS quant=fp8 name
    name=$(basename "$3")
    [ "$2" = nvfp4 ] && quant=nvfp4a16
    "$G/xtask" synth --preset "$1" --quant "$quant" --out "$3" > "$OUT/synth_$name.log" 2>&1
    local rc=$?
    echo "synth $name rc=$rc $((SECONDS - t0))s"
    return $rc
}
synth_preset() {  # DIR Q: the full preset in export Q (fp8 or nvfp4) at $C/DIR, once per machine
    local dir=$C/$1
    if [ -f "$dir/config.json" ]; then echo "synth $1: reusing $dir"; return 0; fi
    if [ ! -x "$G/xtask" ]; then echo "synth $1: no xtask in $src (carry the build's xtask.xz)"; return 1; fi
    synth_at full "$2" "$dir"
}
shallow_checks() {  # BIN [Q]: the test_shallow build to run on the shallow preset's export Q (fp8,
    # the default, or nvfp4: test_shallow_nvfp4); log $OUT/test_shallow_Q.log, a line
    # "test_shallow Q rc=... ...s" and its summary lines; returns the tests' status
    local q=${2:-fp8}
    synth_at shallow "$q" "$C/shallow-$q" || return 1
    local t0=$SECONDS rc
    ORNITH_TEST_MODEL=$C/shallow-$q timeout 170 "$1" --ignored --nocapture --test-threads=1 \
        cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance --skip cuda_matches_cpu_at_length \
        > "$OUT/test_shallow_$q.log" 2>&1
    rc=$?
    echo "test_shallow $q rc=$rc $((SECONDS - t0))s"
    grep -E "prefill:|batch invariance: (1|8|256) |mixed|panicked|test result" "$OUT/test_shallow_$q.log" | cut -c1-200
    rm -rf "$C/shallow-$q"
    return $rc
}
kernel_tests() {  # V BIN TEST...: a kernel-test build's tests by name (--ignored, one thread, 120 s
    # at most), log $OUT/kernels_V.log; prints "kernels V rc=... ...s", the PERF and result lines,
    # and writes the outputs' digests ("name: bits") to $OUT/bits_V.txt; returns the tests' status
    local v=$1 bin=$2 t0=$SECONDS rc
    shift 2
    timeout 120 "$bin" --ignored --test-threads=1 --nocapture "$@" > "$OUT/kernels_$v.log" 2>&1
    rc=$?
    echo "kernels $v rc=$rc $((SECONDS - t0))s"
    grep -E "PERF |panicked|test result" "$OUT/kernels_$v.log" | sed 's/.*PERF/PERF/' | cut -c1-120
    # (a test's first line follows libtest's "test NAME ... ")
    sed 's/^test [^ ]* \.\.\. //' "$OUT/kernels_$v.log" | grep -oE "^[a-z_0-9]+ [^:]*: .*bits [0-9a-f]+" \
        | sed 's/: .*bits/:/' > "$OUT/bits_$v.txt"
    return $rc
}
same_bits() {  # A B: whether kernel_tests A and B wrote the same digests (and at least one)
    if [ -s "$OUT/bits_$1.txt" ] && cmp -s "$OUT/bits_$1.txt" "$OUT/bits_$2.txt"; then
        echo "BITS IDENTICAL ($2 = $1, $(wc -l < "$OUT/bits_$1.txt") outputs)"
    else
        echo "BITS DIFFER ($2 vs $1)"; diff "$OUT/bits_$1.txt" "$OUT/bits_$2.txt" | head -8; return 1
    fi
}
ncu_export() {  # BASE: an ncu report BASE.ncu-rep written out as BASE.txt (the details page) and
    # BASE.csv (every metric), the report removed unless KEEP_REP=1 (the device tool brings back a
    # limited number of files), and a line per profiled launch on stdout (ncu_summary.py)
    "$NCU" --import "$1.ncu-rep" --page details --print-units base > "$1.txt" 2>&1
    "$NCU" --import "$1.ncu-rep" --page raw --csv --print-units base > "$1.csv" 2>/dev/null
    [ "${KEEP_REP:-0}" = 1 ] || rm -f "$1.ncu-rep"
    python3 "$GPU_SCRIPTS/ncu_summary.py" "$1.csv"
}
synth_full() { synth_preset full fp8; }
bench_rows() {  # KERNELS: for each $OUT/bench_*.err, how its kernels were loaded (JIT time, cubins)
    # and the rows of the kernels KERNELS names (an ERE alternation, e.g. "moe_sort|conv1d_silu_chunk")
    local f
    for f in "$OUT"/bench_*.err; do
        echo "$(basename "$f"): $(grep -E "kernels ready|from cubins" "$f" | tr '\n' ' ' | cut -c1-160)"
        echo "   $(grep -E "^ +($1) " "$f" | tr -s ' ' | tr '\n' ';')"
    done
}
synth_full_nvfp4() { synth_preset full-nvfp4 nvfp4; }
bench() {
    local n=$1 b=$2 m=$3
    shift 3
    timeout "${BENCH_TIMEOUT:-100}" "$b" --model "$m" --gen 16 "$@" > "/tmp/bench_$n.json" 2> "$OUT/bench_$n.err"
    echo "bench $n $* rc=$? $((SECONDS - ${t0:-0}))s"
    t0=$SECONDS
    grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ +[0-9.]+ " "$OUT/bench_$n.err" | cut -c1-110
    grep -E "error" "$OUT/bench_$n.err" | head -2
}
