#!/usr/bin/env bash
# Session 19, call A: gdn_out_proj (the GDN out_proj with its gated RMSNorm, K split by head) —
# kernel tests, shallow FP8 and NVFP4A16 checks, bench against HEAD (0ace055's bench) at 2K.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s19
unxz_to .gpu/head/bench_full.xz "$G/bench_base"
t0=$SECONDS
timeout 200 "$G/kernels" --ignored --test-threads=1 --nocapture gdn_out gated_rmsnorm gemv_bf16 > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result|PERF gdn_out|PERF gemv_bf16 in 4096 out 2048" "$OUT/kernels.log" | cut -c1-200
[ $rc = 0 ] || exit 1
for q in fp8 nvfp4; do
  t0=$SECONDS; dir=$C/shallow-$q; bin=$G/test_shallow; [ $q = nvfp4 ] && bin=$G/test_shallow_nvfp4
  "$G/xtask" synth --preset shallow --quant $( [ $q = nvfp4 ] && echo nvfp4a16 || echo fp8 ) --out "$dir" > "$OUT/synth_shallow_$q.log" 2>&1; echo "synth shallow $q rc=$? $((SECONDS - t0))s"
  ORNITH_TEST_MODEL=$dir timeout 150 "$bin" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow_$q.log" 2>&1
  echo "test_shallow $q rc=$? $((SECONDS - t0))s"
  grep -E "batch invariance: (1|2|3|40) |mixed|panicked|test result" "$OUT/test_shallow_$q.log" | grep -v "PDL off\|PDL all" | cut -c1-200
  rm -rf "$dir"
done
synth_full || exit 1
for b in base full; do
  t0=$SECONDS
  timeout 110 "$G/bench_$b" --model "$C/full" --prompts 2048 --gen 64 --budget-s 80 --batch 1,8,32,64 > "$OUT/bench_$b.json" 2> "$OUT/bench_$b.err"
  echo "bench $b rc=$? $((SECONDS - t0))s"; grep -E "^ +[0-9]+ +[0-9.]+ +[0-9]+ " "$OUT/bench_$b.err" | head -8
done
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
for b in ("base", "full"):
    try: d = json.load(open(f"{o}/bench_{b}.json"))
    except Exception as e: print(b, "no json", e); continue
    for br in d["batch_runs"]:
        ab = {x["kernel"]: x["in_graph_us"] for x in br.get("decode_graph_ablation") or []}
        keys = [k for k in ab if k.startswith(("gemv_bf16", "gated", "gdn_out"))]
        print(b, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"],
              " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
PY
