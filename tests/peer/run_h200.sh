#!/usr/bin/env bash
# Peer benchmark on the GPU machine, in one go (no network there):
#   tests/peer/run_h200.sh CHECKPOINT_DIR ORNITH_BENCH_JSON [WHEEL_DIR] [PROMPTS]
#   CHECKPOINT_DIR     the full checkpoint ornith-bench ran on (`cargo xtask synth --preset full`)
#   ORNITH_BENCH_JSON  ornith-bench's stdout from the same machine (its runs must include the PROMPTS lengths)
#   WHEEL_DIR          the flash-linear-attention wheels (default .gpu/wheels; README.md says which)
#   PROMPTS            prompt lengths (default 512,2048)
# Installs flash-linear-attention offline into a temp dir on PYTHONPATH (never into site-packages), runs
# hf_peer.py with --gen 32, prints the side-by-side table, and leaves hf_peer.json + hf_peer.log in $OUT
# (or /tmp/hf-peer-out). Needs ~75 GB of free GPU memory: run it after ornith-bench has exited.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ck=${1:?usage: run_h200.sh CHECKPOINT_DIR ORNITH_BENCH_JSON [WHEEL_DIR] [PROMPTS]}
ornith=${2:?usage: run_h200.sh CHECKPOINT_DIR ORNITH_BENCH_JSON [WHEEL_DIR] [PROMPTS]}
wheels=${3:-.gpu/wheels}
prompts=${4:-512,2048}
out=${OUT:-/tmp/hf-peer-out}
mkdir -p "$out"
py=${PYTHON:-python3}

site=$(mktemp -d /tmp/fla-site.XXXXXX)
t0=$SECONDS
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
echo "run_h200: installed $(cd "$wheels" && ls *.whl | tr '\n' ' ')into $site in $((SECONDS - t0)) s" >&2
"$py" -c 'import fla, einops, triton, torch; print("run_h200: fla", fla.__version__, "from", fla.__file__, "| triton", triton.__version__, "| torch", torch.__version__, "| GPU", torch.cuda.get_device_name(0))' >&2

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader >&2 || true
t0=$SECONDS
set +e
PYTHONUNBUFFERED=1 timeout 360 "$py" "$here/hf_peer.py" --model "$ck" --ornith-json "$ornith" \
    --prompts "$prompts" --gen 32 --out "$out/hf_peer.json" 2>&1 | tee "$out/hf_peer.log"
rc=${PIPESTATUS[0]}
set -e
echo "run_h200: hf_peer.py rc=$rc in $((SECONDS - t0)) s; report $out/hf_peer.json, log $out/hf_peer.log" >&2
exit "$rc"
