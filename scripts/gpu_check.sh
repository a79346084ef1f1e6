#!/usr/bin/env bash
# One prepared device check (for a lent GPU machine): the `gpu` tests, then short GPU runs of the
# benchmarks, ending with a short table. Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || make venv >/dev/null
PY=.venv/bin/python
mkdir -p "${OUT:-/tmp/gpu_check}"
OUTDIR="${OUT:-/tmp/gpu_check}"
$PY - <<'PY'
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY
$PY -m pytest -m gpu -q -p no:warnings 2>&1 | tee "$OUTDIR/gpu_tests.txt" | tail -15
status_tests=${PIPESTATUS[0]}
# the CUDA benchmark (the CPU benchmarks in scripts/ have no CUDA mode)
timeout 300 $PY scripts/bench_gpu.py > "$OUTDIR/bench_gpu.txt" 2>&1
echo "== bench_gpu (rc=$?)"; tail -9 "$OUTDIR/bench_gpu.txt"
echo
echo "check            result"
echo "gpu tests        $(tail -1 "$OUTDIR/gpu_tests.txt") (rc=$status_tests)"
