#!/usr/bin/env bash
# One prepared device check for a lent CUDA machine: the `gpu` tests, the CUDA benchmark, then
# `lazytrain profile` + two short `lazytrain train` runs on the GPU (whole budget; a budget that
# forces streaming and recompute) reporting predicted vs measured step time and device peak.
# Ends with a short table. Usage: bash scripts/gpu_check.sh
# Logs go to $GPU_CHECK_DIR (default /tmp/gpu_check; packed into $OUT/gpu_check.tgz when $OUT is set);
# the runs' own output dirs (traces, checkpoints) to /tmp/gpu_check_runs.
#
# Without .venv (a bare machine with CUDA torch and no network): uses python3 with this checkout on
# PYTHONPATH, after installing the wheels in .whl/ (pulp, highspy, hydra-core, omegaconf, antlr4),
# if present, into /tmp/site. .whl/ is git-ignored: fetch the wheels for the machine's Python first
# (`bash scripts/fetch_device_wheels.sh 3.12`) and have the device tool carry them (carry: [".whl"]).
set -uo pipefail
cd "$(dirname "$0")/.."
# logs go to $GPU_CHECK_DIR (default /tmp/gpu_check); with $OUT set (the device tool, which takes
# back at most 8 files) they are also packed, with both runs' traces, into $OUT/gpu_check.tgz
OUTDIR="${GPU_CHECK_DIR:-/tmp/gpu_check}"
RUNS=/tmp/gpu_check_runs
mkdir -p "$OUTDIR" "$RUNS"
rm -f "$OUTDIR/status.txt"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
  if compgen -G ".whl/*.whl" >/dev/null; then
    for w in .whl/*.whl; do   # one at a time: a wheel for another Python must not stop the rest
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w" \
        || $PY -m zipfile -e "$w" /tmp/site || echo "could not install $w"
    done
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
LT="$PY -m lazytrain.cli.main"
$PY - <<'PY' 2>&1 | tee "$OUTDIR/status.txt"
import torch, transformers, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
# The host side, for the open question of the host optimizer thread's 4x slowdown (README, "On a
# GPU"): a CPU quota below the threads torch starts (a container's cgroup cpu.max with the host's
# cores in the affinity mask) would throttle every parallel region once the quota runs out.
import os, platform
def read(path):
    try:
        return open(path).read().strip()
    except OSError:
        return "-"
model = next((l.split(":", 1)[1].strip() for l in read("/proc/cpuinfo").splitlines() if l.startswith("model name")), "-")
nodes = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]) if os.path.isdir("/sys/devices/system/node") else "-"
print(f"host: {model}; cpu_count {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}, "
      f"torch threads {torch.get_num_threads()}, NUMA nodes {nodes}; cgroup cpu.max {read('/sys/fs/cgroup/cpu.max')!r}, "
      f"cfs quota/period {read('/sys/fs/cgroup/cpu/cpu.cfs_quota_us')}/{read('/sys/fs/cgroup/cpu/cpu.cfs_period_us')}; "
      f"THP {read('/sys/kernel/mm/transparent_hugepage/enabled')}; kernel {platform.release()}")
PY

# Build what is built on first use once, up front and timed, so the tests' time limit is spent on
# tests (the xdist workers would otherwise queue on the build lock, and each compile the kernel).
echo "== build"
timeout -k 5 "${BUILD_S:-150}" $PY - <<'PY' 2>&1 | tee "$OUTDIR/build.txt" | tail -6
import time, torch
from lazytrain.optim import AdamW8bit, kernel_compiled, kernel_cpp
from lazytrain.storage import fastcopy
t = time.perf_counter(); ok = kernel_cpp.load() is not None
print(f"adam8bit C++ kernel: {ok} ({kernel_cpp.unavailable_reason() or 'built'}) {time.perf_counter() - t:.0f} s")
t = time.perf_counter(); print(f"stream-copy C++ kernel: {fastcopy.available()} {time.perf_counter() - t:.0f} s")
if torch.cuda.is_available():
    t = time.perf_counter()
    p = torch.nn.Parameter(torch.randn(3 << 20, device="cuda")); p.grad = torch.randn_like(p)
    AdamW8bit([p], lr=1e-3, max_grad_norm=1.0).step(); torch.cuda.synchronize()
    print(f"compiled CUDA 8-bit kernel: {kernel_compiled.failed() or 'ok'} {time.perf_counter() - t:.0f} s")
PY

echo "== gpu tests"
XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 4"   # 4 processes share the GPU
timeout -k 5 "${GPU_TESTS_S:-150}" $PY -m pytest -m gpu $XDIST -p no:warnings -p no:cacheprovider -rfEs \
  --maxfail=10 --durations=5 2>&1 | tee "$OUTDIR/gpu_tests.txt" | tail -25
status_tests=${PIPESTATUS[0]}

echo "== bench_gpu"
timeout -k 5 "${BENCH_S:-170}" $PY scripts/bench_gpu.py > "$OUTDIR/bench_gpu.txt" 2>&1
status_bench=$?
tail -12 "$OUTDIR/bench_gpu.txt"

echo "== bench_host_thread"   # is the optimizer thread slowed by the main thread's launching?
timeout -k 5 "${HOST_THREAD_S:-60}" $PY scripts/bench_host_thread.py > "$OUTDIR/host_thread.txt" 2>&1
tail -5 "$OUTDIR/host_thread.txt"

# A ~150M Llama on the demo corpus: profile this machine, then train with the measured profile.
M="${GPU_CHECK_MODEL:-model=small-llama model.hf_config.hidden_size=1024 model.hf_config.intermediate_size=2816
   model.hf_config.num_hidden_layers=12 model.hf_config.num_attention_heads=16
   model.hf_config.num_key_value_heads=16 job.batch_size=8 job.seq_len=512}"
BASE="${GPU_CHECK_BASE:-h200}"
echo "== profile"
timeout -k 5 60 $LT profile hardware=$BASE $M --repeats 3 --size-mib 128 --out "$RUNS/measured.yaml" \
  > "$OUTDIR/profile.txt" 2>&1
status_prof=$?
tail -8 "$OUTDIR/profile.txt"
HW="hardware=$BASE"
if [ $status_prof -eq 0 ] && [ -f "$RUNS/measured.yaml" ]; then
  cp "$RUNS/measured.yaml" "$OUTDIR/measured.yaml"
  cp "$RUNS/measured.profile.json" "$OUTDIR/" 2>/dev/null
  cp "$RUNS/measured.yaml" configs/hardware/measured.yaml && HW="hardware=measured"
  cp "$RUNS/measured.profile.json" configs/hardware/ 2>/dev/null
fi
run_train() {  # name, extra overrides...
  local name=$1; shift
  echo "== train ($name)"
  rm -rf "$RUNS/lt-$name"   # a fresh run refuses an output_dir holding an earlier run's checkpoints
  timeout -k 5 "${TRAIN_S:-55}" $LT train $HW $M data=demo job.max_steps=15 progress=false save_every=0 \
    save_final_model=false output_dir="$RUNS/lt-$name" "$@" > "$OUTDIR/train_$name.txt" 2>&1
  local rc=$?
  grep -E "busy time per resource|device peak .* budget" "$OUTDIR/train_$name.txt" | head -2
  tail -4 "$OUTDIR/train_$name.txt"
  # the run's trace against its plan, per resource (median over its steps after the first)
  $LT plan trace "$RUNS/lt-$name" 2>&1 | tee -a "$OUTDIR/train_$name.txt" | tail -16
  echo "train $name rc=$rc" >> "$OUTDIR/status.txt"
}
run_train whole
# the tight run uses 8-bit states: plan it with the host update rate measured for them
OPT8=$($PY -c "from lazytrain.profile.links import measure_host_optimizer as m; from lazytrain.spec import JobSpec
print(round(m(JobSpec(optimizer_state_bits=8), repeats=3), 2))" 2>>"$OUTDIR/status.txt" | tail -1)
echo "host 8-bit update: ${OPT8:-?} GB/s of optimizer traffic"
run_train tight hardware.device_memory_gib=0.8 hardware.workspace_gib=0.25 job.optimizer_state_bits=8 \
  ${OPT8:+hardware.host_memory_gbps=$OPT8}

echo
echo "check            result"
echo "gpu tests        $(grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$OUTDIR/gpu_tests.txt" | tail -1) (rc=$status_tests)"
echo "bench_gpu        rc=$status_bench"
echo "profile          rc=$status_prof ($HW)"
cat "$OUTDIR/status.txt" 2>/dev/null
for n in whole tight; do
  grep -h "step time: predicted" "$OUTDIR/train_$n.txt" 2>/dev/null | sed "s/^/$n: /"
done
if [ -n "${OUT:-}" ]; then   # (traces and metrics only: the run dirs also hold checkpoints)
  tar czf "$OUT/gpu_check.tgz" -C "$OUTDIR" . -C "$RUNS" $(cd "$RUNS" && ls -d lt-*/trace.jsonl lt-*/metrics.jsonl 2>/dev/null) \
    && echo "logs and traces: \$OUT/gpu_check.tgz"
fi
# the exit status says whether every step passed (it was always 0: a caller reading rc saw success)
failed=0
for rc in "$status_tests" "$status_bench" "$status_prof"; do [ "$rc" -eq 0 ] || failed=1; done
grep -q "rc=[1-9]" "$OUTDIR/status.txt" 2>/dev/null && failed=1
exit $failed
