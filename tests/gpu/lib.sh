# Shared by the H200 scripts (run_h200.sh, variants.sh): sourced, never run.
# unpack_builds NAME: sets src (.gpu/NAME), G (the unpacked binaries), C (checkpoints), OUT (logs;
# $OUT if set), unpacks every .gpu/NAME/*.xz into $G and prints the build's commit and the GPU.
# unxz_to FILE.xz DEST: one xz-compressed binary, executable. synth_full: the full preset's FP8
# checkpoint at $C/full, synthesised once per machine (reused while it stays warm); non-zero, with
# a line saying why, when it cannot (no xtask among the build's binaries, or the synthesis failed).
unxz_to() {
    python3 -c 'import lzma, sys; open(sys.argv[2], "wb").write(lzma.open(sys.argv[1]).read())' "$1" "$2"
    chmod +x "$2"
}
unpack_builds() {
    src=.gpu/$1; G=/tmp/ornith-gpu/$1; C=/tmp/ornith-ck; OUT=${OUT:-/tmp/ornith-out}
    mkdir -p "$G" "$C" "$OUT"
    for f in "$src"/*.xz; do unxz_to "$f" "$G/$(basename "$f" .xz)"; done
    echo "commit $(cat "$src/COMMIT" 2>/dev/null)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
}
synth_full() {
    local t0=$SECONDS
    if [ -f "$C/full/config.json" ]; then echo "synth full: reusing $C/full"; return 0; fi
    if [ ! -x "$G/xtask" ]; then echo "synth full: no xtask in $src (carry the build's xtask.xz)"; return 1; fi
    "$G/xtask" synth --preset full --out "$C/full" > "$OUT/synth_full.log" 2>&1
    local rc=$?
    echo "synth full rc=$rc $((SECONDS - t0))s"
    return $rc
}
