#!/usr/bin/env bash
# The whole H200 check in one device call (about 7–8 minutes of device time), from the binaries
# that tests/gpu/build.sh NAME left in .gpu/NAME (carry it, and .gpu/wheels for the peer):
#   1. every CUDA kernel test (vs the CPU reference; PERF lines);
#   2. shallow preset: the decode graph against eager launches, CUDA against the CPU backend,
#      batch invariance (1..256 sequences per step, graph and eager, a mixed decode + prefill step);
#   3. full preset (37.7 GB synthesised here, 55-63 s on an H100 host at d364933): ornith-bench at 512 / 2K / 8K / 32K / 128K,
#      then batched decode of 1, 2, 4, ..., 64, 128, 255 sequences of 2K-token prompts (BATCH);
#   4. 64 sampled requests through the real binary (tests/gpu/soak_full.py), then the
#      transformers + fla peer on the same checkpoint (tests/peer/run_h200.sh) if carried;
#   5. a 256-request JSONL batch file through the real binary (tests/gpu/batch_file.py);
#   6. full preset: 1,000 greedy steps finite, the decode graph against eager.
# PHASE=check runs 1–2 only, PHASE=full 3–6 only (two device calls of under 10 minutes each; the
# full checkpoint synthesised by the first full run is reused while the machine stays warm),
# PHASE=bench 3 only, PHASE=check+bench 1–3. With BASE=<name> (a baseline's .gpu/<name>/bench_full.xz, carried too) the
# bench runs first with that binary (prompts BASE_PROMPTS, default PROMPTS), into bench_base.*.
# PHASE=prefill (about 6 minutes): the flash attention kernel test, the bench's prefill at 2K / 32K / 128K and one
# 261,000-token JSONL request through the binary (tests/gpu/long_prompt.py).
# PHASE=check+file: 1–2, then the 256-request JSONL batch file through the binary (5. above).
# PHASE=nvfp4+bench: PHASE=nvfp4's checks, then 3. (the FP8 full preset's bench).
# PHASE=nvfp4: 1–2, then 2. on the shallow preset's NVFP4A16 export (build.sh with NVFP4=1);
# PHASE=nvfp4-shallow: that last part alone.
# PHASE=nvfp4-bench: the full preset's FP8 and NVFP4A16 exports benched one after the other (PROMPTS, BATCH;
# QUANTS="fp8" or "nvfp4" for one of them; FILE_N=256 adds the JSONL batch file on the FP8 export).
# FILE_STEPS="default 2048": the batch file once per `--max-batch-tokens` value, `default` for none
# (the binary's defaults: on CUDA 8,192-row steps and up to 256 sequences; the default here).
# FILE_SEQS="64": pass `--max-seqs` too (each FILE_STEPS value once per FILE_SEQS value).
# PHASE=long (about 4 minutes per export): cuda_matches_cpu_at_length on the shallow preset at
# LONG tokens (default 16,421; ~220 s, nearly all the CPU reference), and on its NVFP4A16 export
# too when the build has test_shallow_nvfp4 (build.sh with NVFP4=1).
# PHASE=prefix: 1–2, then the full preset's prefix-cache identity test and tests/gpu/prefix_cache.py
# (a growing agent conversation and a shared-system-prompt batch file, with and without the cache).
# Logs and JSON go to $OUT; a short table to stdout.
set -uo pipefail
name=${1:?usage: tests/gpu/run_h200.sh NAME [PROMPTS] [BATCH]}
prompts=${2:-512,2048,8192,32768,131072}
batch=${3:-1,2,4,8,16,32,64,128,255}
. "$(dirname "$0")/lib.sh"
unpack_builds "$name"
phase=${PHASE:-all}
# The JSONL batch file (tests/gpu/batch_file.py) on MODEL_DIR with N requests, once per
# --max-batch-tokens value in FILE_STEPS (and --max-seqs value in FILE_SEQS); results in /tmp,
# the figures on stdout.
batch_files() {  # MODEL_DIR N TIMEOUT_S
    local steps seqs t0 flags
    for steps in ${FILE_STEPS:-default}; do
        for seqs in ${FILE_SEQS:-default}; do
            flags=()
            [ "$steps" = default ] || flags+=(--max-batch-tokens "$steps")
            [ "$seqs" = default ] || flags+=(--max-seqs "$seqs")
            t0=$SECONDS
            timeout "$3" python3 tests/gpu/batch_file.py "$G/ornith_full" "$1" "/tmp/batch_file_${steps}_$seqs.jsonl" "$2" ${flags[@]+"${flags[@]}"}
            echo "batch file (--max-batch-tokens $steps, --max-seqs $seqs) rc=$? $((SECONDS - t0))s"
        done
    done
}
if [ "$phase" = prefill ]; then
    # Long-context prefill: the flash attention kernel test (CPU reference, PERF lines to 128K
    # cached), the full preset's bench prefill at PROMPTS (default here 2K / 32K / 128K; the per-kernel
    # prefill table at the last), then one LONG-token JSONL request (default 261,000) through the binary.
    t0=$SECONDS
    timeout 120 "$G/kernels" --ignored --test-threads=1 --nocapture flash_attention > "$OUT/kernels_flash.log" 2>&1; echo "kernels flash rc=$? $((SECONDS - t0))s"
    grep -E "PERF|flash_attention t|panicked|test result" "$OUT/kernels_flash.log" | cut -c1-220
    synth_full || exit 1
    t0=$SECONDS
    timeout 200 "$G/bench_full" --model "$C/full" --prompts "${2:-2048,32768,131072}" --gen 8 --budget-s 150 > "$OUT/bench_prefill.json" 2> "$OUT/bench_prefill.err"
    echo "bench rc=$? $((SECONDS - t0))s"
    grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ |prefill of|flash_attn_prefill|gemm|gdn_chunk| MB$|skipping|error" "$OUT/bench_prefill.err" | head -40
    t0=$SECONDS
    timeout 200 python3 "$(dirname "$0")/long_prompt.py" "$G/ornith_full" "$C/full" "$OUT/long_prompt.json" "${LONG:-261000}"
    echo "long prompt rc=$? $((SECONDS - t0))s"
    exit 0
fi
if [ "$phase" = long ]; then
    for q in fp8 nvfp4; do
        bin=$G/test_shallow; [ $q = nvfp4 ] && bin=$G/test_shallow_nvfp4
        [ -x "$bin" ] || continue
        synth_at shallow $q "$C/shallow-$q"
        t0=$SECONDS
        ORNITH_TEST_MODEL=$C/shallow-$q ORNITH_LONG=${LONG:-16421} timeout 300 "$bin" --ignored --nocapture --test-threads=1 cuda_matches_cpu_at_length > "$OUT/test_long_$q.log" 2>&1
        echo "cuda_matches_cpu_at_length $q rc=$? $((SECONDS - t0))s"
        grep -E "prefill in pieces|two piece cuts|^  to|decode:|panicked|test result" "$OUT/test_long_$q.log" | cut -c1-300
        rm -rf "$C/shallow-$q"
    done
    exit 0
fi
# The model-level checks on the shallow preset's NVFP4A16 export (build.sh with NVFP4=1). Not
# cuda_ops_vs_cpu: its per-op bounds and row-0 bit-exactness are the FP8 export's (E4M3 x E4M3 sums
# are mostly exact in fp32; NVFP4A16's bf16 x bf16 sums are not), see docs/TESTING.md.
nvfp4_shallow() {
    synth_at shallow nvfp4 "$C/shallow-nvfp4"
    t0=$SECONDS
    ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 240 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance cuda_penalties --skip cuda_matches_cpu_at_length > "$OUT/test_shallow_nvfp4.log" 2>&1
    echo "test_shallow_nvfp4 rc=$? $((SECONDS - t0))s"
    grep -E "^OP|CPU chunked|prefill:|decode|batch invariance|panicked|test result" "$OUT/test_shallow_nvfp4.log" | cut -c1-330
    rm -rf "$C/shallow-nvfp4"
}
if [ "$phase" = nvfp4-shallow ]; then  # only those (MODEL_TESTS=0 builds are enough)
    nvfp4_shallow
    exit 0
fi
if [ "$phase" != full ] && [ "$phase" != bench ] && [ "$phase" != nvfp4-bench ]; then
t0=$SECONDS
timeout 240 "$G/kernels" --ignored --test-threads=1 --nocapture > "$OUT/kernels.log" 2>&1; echo "kernels rc=$? $((SECONDS - t0))s"
grep -E "PERF|panicked|test result|identical to the CPU" "$OUT/kernels.log" | cut -c1-220
synth_at shallow fp8 "$C/shallow"
t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 210 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager decode_graph_ablation cuda_matches_cpu cuda_ops_vs_cpu batch_invariance prefix_cache_resume cuda_penalties --skip cuda_matches_cpu_at_length > "$OUT/test_shallow.log" 2>&1
echo "test_shallow rc=$? $((SECONDS - t0))s"
grep -E "^OP|CPU chunked|prefill:|decode|batch invariance|prefix cache|panicked|test result" "$OUT/test_shallow.log" | cut -c1-330
rm -rf "$C/shallow"
if [ "$phase" = nvfp4 ] || [ "$phase" = nvfp4+bench ]; then
    nvfp4_shallow
    [ "$phase" = nvfp4 ] && exit 0
fi
fi
if [ "$phase" = nvfp4-bench ]; then
    # The full preset's FP8 export and its NVFP4A16 export benched in one call (PROMPTS, BATCH),
    # one checkpoint on disk at a time.
    for q in ${QUANTS:-fp8 nvfp4}; do
        dir=$C/full-$q; bin=$G/bench_full; [ $q = nvfp4 ] && bin=$G/bench_full_nvfp4
        rm -rf "$C"/full*
        synth_at full $q "$dir"
        t0=$SECONDS
        timeout 240 "$bin" --model "$dir" --prompts "$prompts" --gen 64 --budget-s 100 --batch "$batch" > "$OUT/bench_$q.json" 2> "$OUT/bench_$q.err"
        echo "bench $q rc=$? $((SECONDS - t0))s"
        grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ |prefill of|GB per|skipping|error|Spark" "$OUT/bench_$q.err" | head -30
        if [ $q = fp8 ] && [ -n "${FILE_N:-}" ]; then  # FILE_N=256: the JSONL batch file on the FP8 export
            batch_files "$dir" "$FILE_N" 200
        fi
    done
    rm -rf "$C"/full*
    exit 0
fi
[ "$phase" = check ] && exit 0
synth_full || exit 1
if [ "$phase" = check+file ]; then
    batch_files "$C/full" "${FILE_N:-256}" 300
    exit 0
fi
if [ "$phase" = prefix ]; then
    t0=$SECONDS
    ORNITH_TEST_MODEL=$C/full timeout 150 "$G/test_full" --ignored --nocapture --test-threads=1 prefix_cache_resume > "$OUT/test_full_prefix.log" 2>&1
    echo "test_full prefix rc=$? $((SECONDS - t0))s"
    grep -E "prefix cache|panicked|test result" "$OUT/test_full_prefix.log" | cut -c1-300
    t0=$SECONDS
    timeout 420 python3 tests/gpu/prefix_cache.py "$G/ornith_full" "$C/full" "$OUT/prefix_cache.json" ${PREFIX_ARGS:-}
    echo "prefix cache rc=$? $((SECONDS - t0))s"
    exit 0
fi
if [ -n "${BASE:-}" ]; then
    t0=$SECONDS
    unxz_to ".gpu/$BASE/bench_full.xz" "$G/bench_base"
    echo "baseline bench: commit $(cat ".gpu/$BASE/COMMIT" 2>/dev/null)"
    timeout 400 "$G/bench_base" --model "$C/full" --prompts "${BASE_PROMPTS:-$prompts}" --gen 64 --budget-s 120 --batch "$batch" > "$OUT/bench_base.json" 2> "$OUT/bench_base.err"
    echo "bench base rc=$? $((SECONDS - t0))s"
    grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ " "$OUT/bench_base.err" | head -20
fi
t0=$SECONDS
timeout 400 "$G/bench_full" --model "$C/full" --prompts "$prompts" --gen 64 --budget-s 120 --batch "$batch" > "$OUT/bench_full.json" 2> "$OUT/bench_full.err"
echo "bench rc=$? $((SECONDS - t0))s"
if [ "$phase" = bench ] || [ "$phase" = check+bench ] || [ "$phase" = nvfp4+bench ]; then
    grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ |attn_decode|skipping|error" "$OUT/bench_full.err" | head -40
    exit 0
fi
grep -v uploading "$OUT/bench_full.err" | head -130
if [ -x "$G/ornith_full" ]; then
    t0=$SECONDS
    timeout 150 python3 tests/gpu/soak_full.py "$G/ornith_full" "$C/full" "$OUT/soak_full.jsonl"; echo "soak rc=$? $((SECONDS - t0))s"
    batch_files "$C/full" 256 240
fi
if [ -d .gpu/wheels ]; then
    t0=$SECONDS
    OUT=$OUT timeout 220 bash tests/peer/run_h200.sh "$C/full" "$OUT/bench_full.json" .gpu/wheels 512,2048 > "$OUT/peer.out" 2> "$OUT/peer.err"
    echo "peer rc=$? $((SECONDS - t0))s"
    tail -25 "$OUT/peer.out"
fi
t0=$SECONDS
ORNITH_TEST_MODEL=$C/full timeout 60 "$G/test_full" --ignored --nocapture --test-threads=1 cuda_decode_1000 cuda_decode_graph prefix_cache_resume > "$OUT/test_full.log" 2>&1
echo "test_full rc=$? $((SECONDS - t0))s"
grep -E "1000|graph|panicked|test result" "$OUT/test_full.log" | cut -c1-300
