#!/usr/bin/env bash
# One device call: v2 kernel + shallow checks, then the full-preset bench of v2 (or of v1 if a
# v2 check failed) after the baseline's bench. Run from the repo root with .gpu/attn{long,v1,base} carried.
set -uo pipefail
cp .gpu/attnlong/run_h200.sh /tmp/r.sh
PHASE=check bash /tmp/r.sh attnlong 2>&1 | grep -E "commit|rc=|attention|PERF attention|test result|panicked|FAILED|batch invariance|OP decode layer3 attn |bit-identical" | cut -c1-200
ok=1
for f in kernels test_shallow; do
    grep -q "test result: ok" "$OUT/$f.log" && ! grep -qE "FAILED|panicked" "$OUT/$f.log" || ok=0
done
name=attnlong; [ $ok = 1 ] || name=attnv1
echo "checks ok=$ok: benching $name"
mkdir -p "$OUT/check"; mv "$OUT"/kernels.log "$OUT"/test_shallow.log "$OUT"/synth_shallow.log "$OUT/check/" 2>/dev/null
PHASE=bench BASE=attnbase BASE_PROMPTS=${BASE_PROMPTS:-2048,131072} bash /tmp/r.sh $name ${PROMPTS:-2048,32768,131072,261000} ${BATCH:-1,8,64} 2>&1 | cut -c1-200
for f in "$OUT"/bench_base.err "$OUT"/bench_full.err; do echo "== $f"; grep -E "attn_decode|batched|^ +(1|8|64) " "$f" | head -12; done
