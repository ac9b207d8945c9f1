#!/usr/bin/env bash
# Session 27, call C. s27c = the routed-index-early MoE pair landed (aab6ca3 + the working tree:
# per-slot gate|up forms trigger their dependents after their wait, the per-slot down forms read
# the routed index from L2 before theirs; the grouped FP8 down product takes the combine in its
# epilogue); s25x = aab6ca3 + s57_moe_variants.patch (bench_full, ornith_full).
# 1. kernel tests moe / nvfp4 / norm_prologue / swiglu_prologue; 2. shallow FP8 and NVFP4A16 model
# checks (graph = eager, batch invariance 1..40 in every PDL mode, CUDA vs CPU);
# 3. full FP8 preset: s27c at 2K / 32K / 128K batch 1 and 2K at 8 / 32 / 64 sequences;
# 4. s25x: base, ORNITH_XDIV=2 at 2K batch 1; 8 / 32 / 64 sequences; 8 with gei;
# 5. one 2,048-token request with 256 generated through s25x's binary (its decode_tok_s vs the bench's).
set -uo pipefail
. tests/gpu/lib.sh
OUT0=$OUT; L=/tmp/s58c; mkdir -p $L; OUT=$L
unpack_builds s25x; GX=$G
unpack_builds s27c
exec > >(tee "$L/summary.txt") 2>&1
save() { tar czf "$OUT0/s58c.tgz" -C /tmp s58c; cp "$L/summary.txt" "$OUT0/summary.txt"; }  # after each stage: a call cut at its limit keeps them
t0=$SECONDS
timeout 120 "$G/kernels" --ignored --test-threads=1 moe nvfp4 norm_prologue swiglu_prologue > "$L/kernels.log" 2>&1
echo "kernels rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$L/kernels.log" | cut -c1-200; t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow fp8 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 120 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$L/test_shallow.log" 2>&1
echo "test_shallow fp8 rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow.log" | cut -c1-250 | head -4; grep -E "^batch invariance|test result" "$L/test_shallow.log" | tail -4; t0=$SECONDS
"$G/xtask" synth --preset shallow --quant nvfp4a16 --out "$C/shallow-nvfp4" > /dev/null 2>&1; echo "synth shallow nvfp4 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow-nvfp4 timeout 100 "$G/test_shallow_nvfp4" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager batch_invariance > "$L/test_shallow_nvfp4.log" 2>&1
echo "test_shallow nvfp4 rc=$? $((SECONDS - t0))s"; grep -E -A1 "panicked" "$L/test_shallow_nvfp4.log" | cut -c1-250 | head -4; grep -E "test result" "$L/test_shallow_nvfp4.log"; t0=$SECONDS
save
synth_full; t0=$SECONDS
timeout 150 "$G/bench_full" --model "$C/full" --prompts 2048,32768,131072 --batch 1 --gen 64 --budget-s 120 > "$L/bench_long.json" 2> "$L/bench_long.err"; echo "bench s27c long rc=$? $((SECONDS - t0))s"; t0=$SECONDS
timeout 120 "$G/bench_full" --model "$C/full" --prompts 2048 --batch 8,32,64 --gen 64 --budget-s 100 > "$L/bench_batch.json" 2> "$L/bench_batch.err"; echo "bench s27c batch rc=$? $((SECONDS - t0))s"; t0=$SECONDS
save
run() { local v=$1; shift
  local args=(--prompts 2048 --batch 1); [ "$v" = x8base ] && args=(--prompts 2048 --batch 8,32,64); [ "$v" = x8gei ] && args=(--prompts 2048 --batch 8)
  env "$@" timeout 100 "$GX/bench_full" --model "$C/full" "${args[@]}" --gen 64 --budget-s 80 > "$L/bench_$v.json" 2> "$L/bench_$v.err"
  echo "bench $v rc=$? $((SECONDS - t0))s"; t0=$SECONDS; save; }
run xbase X=1
run xdiv2 ORNITH_XDIV=2
run x8base X=1
run x8gei ORNITH_XMOE=gei
python3 tests/peer/results/h200-2026-12-04/s57_table.py "$L"
python3 - "$L" <<'PY'
import json, sys
for f in ("bench_long", "bench_batch"):
    d = json.load(open(f"{sys.argv[1]}/{f}.json"))
    for r in d.get("runs") or []:
        print(f, r["prompt_tokens"], "ttft %.3f s prefill %.0f" % (r["ttft_s"], r["prefill_tok_s"]), "decode %.1f / %.1f / %.1f" % (r["decode_tok_s"], r["decode_default_sampling_tok_s"], r["decode_top_p_tok_s"]))
    for b in d.get("batch_runs") or []:
        print(f, "batch", b["batch"], "%.1f / %.1f" % (b["decode_tok_s"], b["decode_default_sampling_tok_s"]), "step %.3f ms" % b["decode_step_ms"])
PY
timeout 120 python3 tests/gpu/long_prompt.py "$GX/ornith_full" "$C/full" "$L/binary_2k.json" 2048 256
echo "binary 2k rc=$? $((SECONDS - t0))s"
save
