#!/usr/bin/env bash
# Session 24, call C (builds .gpu/s24c = 44d716d + gemv_nvfp4's fold loop + gemv_fp8_quant: the FP8
# o_proj of one decode row quantises its bf16 input in its prologue instead of the attention
# combine's last block; ORNITH_EXP_NOQP=1 restores the combine's quantisation for the A/B): the
# kernel tests (the new one, the prologues, the decode attention), the shallow FP8 model checks
# (batch invariance: one row takes the prologue, a group the combine), then the full FP8 preset at
# 2K batch 1 alternating new / old twice, and batch 1 at 32K / 128K.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s24c
exec > >(tee "$OUT/summary.txt") 2>&1
t0=$SECONDS
timeout 90 "$G/kernels" --ignored --test-threads=1 --nocapture gemv_fp8_quant norm_prologue attention_decode > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/kernels.log" | cut -c1-200; t0=$SECONDS
"$G/xtask" synth --preset shallow --out "$C/shallow" > /dev/null 2>&1; echo "synth shallow fp8 rc=$? $((SECONDS - t0))s"; t0=$SECONDS
ORNITH_TEST_MODEL=$C/shallow timeout 100 "$G/test_shallow" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow.log" 2>&1
echo "test_shallow fp8 rc=$? $((SECONDS - t0))s"; grep -E "panicked|test result" "$OUT/test_shallow.log" | cut -c1-200 | head -4; t0=$SECONDS
synth_full; t0=$SECONDS
for v in new old new2 old2; do
if [ ${v#old} != $v ]; then export ORNITH_EXP_NOQP=1; else unset ORNITH_EXP_NOQP; fi
timeout 60 "$G/bench_full" --model "$C/full" --prompts 2048 --gen 64 --budget-s 40 --batch 1 > "$OUT/bench_$v.json" 2> "$OUT/bench_$v.err"
echo "bench $v rc=$? $((SECONDS - t0))s"; t0=$SECONDS
done
unset ORNITH_EXP_NOQP
timeout 110 "$G/bench_full" --model "$C/full" --prompts 32768,131072 --gen 64 --budget-s 90 > "$OUT/bench_long.json" 2> "$OUT/bench_long.err"
echo "bench long rc=$? $((SECONDS - t0))s"
python3 - "$OUT" <<'PY'
import json, sys
for v in ("new", "old", "new2", "old2", "long"):
    try: d = json.load(open(f"{sys.argv[1]}/bench_{v}.json"))
    except Exception as e: print(v, "no json", e); continue
    for br in d.get("batch_runs") or []:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("attn", "gemv_fp8", "quant"))]
        print(v, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"], " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
    for r in d.get("runs") or []:
        print(v, "run", {k: round(r[k], 3) for k in r if k in ("prompt_tokens", "decode_tok_s", "decode_default_sampling_tok_s", "decode_top_p_tok_s", "prefill_tok_s", "ttft_s")})
PY
