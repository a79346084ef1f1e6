"""Predicted vs measured step time of an NVMe-tier plan, with this machine measured first.

    .venv/bin/python scripts/bench_nvme_prediction.py      # ~3 min

The plan is bench_vs_deepspeed's NVMe-tier plan (220M Llama, seq 256, batch 1, parameters and
optimizer state pinned to NVMe, clipping 1.0). The hardware profile is measured in-process, as
`lazytrain profile` does (copies, O_DIRECT read/write, bf16 matmul, this model's layers). The plan
is simulated with the drive modelled half-duplex (the default: reads and writes share it) and
full-duplex, with clipped updates (after the backward, as the executor runs them here) and, for
comparison, as if each layer's update followed its backward; then run by the executor. The table
is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_streaming as bs  # noqa: E402
import bench_vs_deepspeed as bvd  # noqa: E402

from lazytrain.cli.config import hardware_spec, load_config  # noqa: E402
from lazytrain.costmodel import job_costs  # noqa: E402
from lazytrain.plan.simulate import simulate  # noqa: E402
from lazytrain.plan.solve import assignment_of  # noqa: E402
from lazytrain.runtime import StreamingExecutor  # noqa: E402
from lazytrain.spec import JobSpec, ModelSpec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nvme-dir", default=None)
    args = ap.parse_args()
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="lazytrain-nvme-pred-")
    try:
        run(args, nvme_dir)
    finally:
        if args.nvme_dir is None:
            shutil.rmtree(nvme_dir, ignore_errors=True)


def run(args: argparse.Namespace, nvme_dir: str) -> None:
    a = argparse.Namespace(hidden=1024, intermediate=2816, layers=12, heads=16, vocab=32000, seq=256,
                           batch=1, nvme_dir=nvme_dir, mem_limit_gib=12.0)
    plan = bvd.make_plan(a, 1, "nvme")
    spec = ModelSpec.from_hf_config(bvd.model_config(a), name="bench-llama")
    job = JobSpec(batch_size=1, seq_len=a.seq, mode="full", compute_dtype="bf16", clip_grad=True)
    measured = bs.measured_hardware(hardware_spec(load_config(["hardware=cpu"])), spec, job, nvme_dir)
    print(f"measured: NVMe read {measured.nvme_read_gbps:.2f} / write {measured.nvme_write_gbps:.2f} GB/s, "
          f"matmul {measured.device_tflops * 1e3:.0f} GFLOP/s x {measured.efficiency:.2f}", flush=True)
    pred = {}
    for duplex, clip in ((False, True), (True, True), (False, False)):
        hw = dataclasses.replace(measured, nvme_full_duplex=duplex)
        pred[duplex, clip] = simulate(job_costs(spec, hw, dataclasses.replace(job, clip_grad=clip)),
                                      assignment_of(plan), hw, plan.options.prefetch_depth).step_time_s
    model = bs.build_model(argparse.Namespace(hidden=a.hidden, intermediate=a.intermediate, layers=a.layers,
                                              vocab=a.vocab))
    ex = StreamingExecutor(model, plan, device="cpu", nvme_dir=nvme_dir, lr=1e-4, max_grad_norm=1.0)
    try:
        mbs = bs.batch(1, a.seq, a.vocab)
        ex.train_step(mbs)
        ex.wait()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            ex.train_step(mbs)
            ex.wait()
            times.append(time.perf_counter() - t)
    finally:
        ex.close()
    m = statistics.median(times)
    print()
    # (measured - predicted) / predicted, as bench_streaming.py (c) reports it: + means the step took
    # longer than predicted (this script printed the other sign until 2026-12-01: review)
    print(f"{'NVMe-tier plan, 220M Llama':<44}{'step s':>8}{'measured vs this':>18}")
    print("-" * 70)
    print(f"{'measured (median of ' + str(args.steps) + ')':<44}{m:>8.2f}{'':>18}")
    for key, label in (((False, True), "predicted, half-duplex drive (default)"),
                       ((True, True), "predicted, full-duplex drive"),
                       ((False, False), "predicted, half-duplex, updates not clipped")):
        print(f"{label:<44}{pred[key]:>8.2f}{(m - pred[key]) / pred[key] * 100:>+17.0f}%")


if __name__ == "__main__":
    main()
