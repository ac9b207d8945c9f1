#!/usr/bin/env bash
# Session 19, call D: the router's top-k in its product's epilogue (up to 8 rows) on top of
# gdn_out_proj — kernel tests, shallow FP8 checks, bench against call B's build (23711f1); the
# shallow NVFP4A16 checks last, if time is left.
set -uo pipefail
. tests/gpu/lib.sh
unpack_builds s19d
unxz_to .gpu/s19b/bench_full.xz "$G/bench_base"
t0=$SECONDS
timeout 120 "$G/kernels" --ignored --test-threads=1 --nocapture router gdn_out norm_prologue moe_decode > "$OUT/kernels.log" 2>&1; rc=$?
echo "kernels rc=$rc $((SECONDS - t0))s"
grep -E "panicked|test result" "$OUT/kernels.log" | cut -c1-200
[ $rc = 0 ] || exit 1
shallow() {
  local q=$1 t0=$SECONDS dir=$C/shallow-$1 bin=$G/test_shallow
  [ $q = nvfp4 ] && bin=$G/test_shallow_nvfp4
  "$G/xtask" synth --preset shallow --quant $( [ $q = nvfp4 ] && echo nvfp4a16 || echo fp8 ) --out "$dir" > "$OUT/synth_shallow_$q.log" 2>&1; echo "synth shallow $q rc=$? $((SECONDS - t0))s"
  ORNITH_TEST_MODEL=$dir timeout 150 "$bin" --ignored --nocapture --test-threads=1 cuda_decode_graph_matches_eager cuda_matches_cpu batch_invariance > "$OUT/test_shallow_$q.log" 2>&1
  echo "test_shallow $q rc=$? $((SECONDS - t0))s"
  grep -E "batch invariance: (1|2|3|40) |mixed|panicked|test result" "$OUT/test_shallow_$q.log" | grep -v "PDL off\|PDL all" | cut -c1-200
  rm -rf "$dir"
}
shallow fp8
synth_full || exit 1
for b in base full; do
  t0=$SECONDS
  timeout 100 "$G/bench_$b" --model "$C/full" --prompts 2048 --gen 64 --budget-s 70 --batch 1,8,32,64 > "$OUT/bench_$b.json" 2> "$OUT/bench_$b.err"
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
        keys = [k for k in ab if k.startswith(("gemv_bf16", "moe_router"))]
        print(b, br["batch"], "%.1f / %.1f" % (br["decode_tok_s"], br["decode_default_sampling_tok_s"]), "step %.3f ms" % br["decode_step_ms"],
              " ".join("%s=%.0f" % (k, ab[k]) for k in keys))
PY
[ $SECONDS -lt 380 ] && shallow nvfp4
true
