#!/usr/bin/env bash
# The NVFP4A16 kernel tests only (cuda/nvfp4_tests.rs), on the device: a narrow run of the
# ornith-runtime lib test binary that tests/gpu/build.sh NAME (or the `kernels` step alone) put
# in .gpu/NAME/kernels.xz. Usage: bash tests/gpu/run_nvfp4.sh NAME   (logs under $OUT)
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?usage: tests/gpu/run_nvfp4.sh NAME}
dir=.gpu/$name
out=${OUT:-/tmp/out}
mkdir -p "$out"
[ -f "$dir/kernels" ] || xz -dk "$dir/kernels.xz"
chmod +x "$dir/kernels"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
cat "$dir/COMMIT" 2>/dev/null | tee "$out/commit.txt" || true
set +e
"$dir/kernels" --ignored --test-threads=1 --nocapture nvfp4 > "$out/nvfp4.log" 2>&1
rc=$?
set -e
grep -E "^test |test result|PERF|panicked" "$out/nvfp4.log" | cut -c1-220
exit $rc
