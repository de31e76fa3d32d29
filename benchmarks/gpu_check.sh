#!/usr/bin/env bash
# The GPU check in one call (../shared/GPU.md): from a bare GPU machine, install the wheels brought in .whl/ where
# diffusers, torchao or bitsandbytes are missing, then run benchmarks/gpu_check.py (at most 8 minutes), its log teed
# to $OUT/gpu_check.log and its table printed last.
#   benchmarks/gpu_check.sh               the GPU run
#   benchmarks/gpu_check.sh --dry-run     the commands it would run
#   benchmarks/gpu_check.sh --tiny        the same runs on the tests' tiny model on the CPU (a test runs this)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export OUT=${OUT:-$PWD/gpu_check_out} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if ! "$PYTHON" -c 'import diffusers, torchao, bitsandbytes' 2>/dev/null; then
  ls .whl/*.whl >/dev/null || { echo "diffusers, torchao or bitsandbytes missing and no wheels in .whl/ (GPU.md)"; exit 2; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
  export PYTHONPATH=$PWD/.site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  nvidia-smi -L 2>/dev/null || true
  "$PYTHON" benchmarks/gpu_check.py "$@"  # it prints the libraries' versions first
} 2>&1 | tee "$OUT/gpu_check.log"
