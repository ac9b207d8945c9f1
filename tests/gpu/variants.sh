#!/usr/bin/env bash
# Benches several builds of ornith-bench side by side in one device call: .gpu/<name>/bench_<v>.xz
# for each variant v (built here, e.g. with different -D flags for one kernel file's PTX), over one
# synthesised full-preset checkpoint, the same prompts and batch sizes, one after the other.
# Usage (on the device): bash tests/gpu/variants.sh NAME [PROMPTS] [BATCH]   (default 2048 and 1,8,32,64)
# JSON and stderr per variant go to $OUT/<v>.json / <v>.err; a table of aggregate decode tok/s
# (greedy / default sampling) and the step's largest kernels per variant to stdout. VARIANTS="a b"
# limits the run to those variants.
set -uo pipefail
name=${1:?usage: tests/gpu/variants.sh NAME [PROMPTS] [BATCH]}
prompts=${2:-2048}
batch=${3:-1,8,32,64}
. "$(dirname "$0")/lib.sh"
unpack_builds "$name"
synth_full || exit 1
for bin in "$G"/bench_*; do
    v=${bin##*/bench_}
    if [ -n "${VARIANTS:-}" ] && [[ " $VARIANTS " != *" $v "* ]]; then rm -f "$bin"; continue; fi
    t0=$SECONDS
    timeout "${VARIANT_TIMEOUT:-200}" "$bin" --model "$C/full" --prompts "$prompts" --gen 64 --budget-s 100 --batch "$batch" > "$OUT/$v.json" 2> "$OUT/$v.err"
    echo "variant $v rc=$? $((SECONDS - t0))s"
done
python3 - "$OUT" "$G" <<'EOF'
import json, os, sys
out, g = sys.argv[1], sys.argv[2]
for b in sorted(os.listdir(g)):
    if not b.startswith("bench_"):
        continue
    v = b[len("bench_"):]
    try:
        d = json.load(open(os.path.join(out, v + ".json")))
    except Exception as e:
        print(f"{v}: no result ({e})")
        continue
    for r in d.get("batch_runs", []):
        top = sorted(r.get("kernels", []), key=lambda k: -k["total_us"])[:6]
        ks = "  ".join(f"{k['kernel']} {k['total_us']:.0f}" for k in top)
        print(f"{v:>8} b{r['batch']:<3} {r['decode_tok_s']:8.1f} / {r['decode_default_sampling_tok_s']:8.1f}  step {r['decode_step_ms']:.3f} ms | {ks}")
    for r in d.get("runs", []):
        print(f"{v:>8} prompt {r.get('prompt_tokens')} prefill {r.get('prefill_tok_s', 0):.0f} tok/s")
EOF
