"""Turn measurements into a hardware profile YAML that `hardware=measured` loads.

The YAML holds exactly the HardwareSpec keys (so the planner reads it like any hardware config);
the device type is the one timed; capacities come from the machine (host RAM, free space under the
NVMe dir, a CUDA device's memory) or, where not measured (a CPU device's planned budget, reserves),
from the base hardware config the user named. The raw figures (per-layer times, pinned/pageable,
O_DIRECT or not) go to a JSON file next to it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..spec import HardwareSpec
from .layers import LayerTime, achieved_tflops
from .links import CopyRates, DiskRates


def host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None


def cuda_memory_gib(device) -> float:
    """The CUDA device's total memory (what `torch.cuda.mem_get_info` reports)."""
    import torch

    return torch.cuda.mem_get_info(device)[1] / 2**30


def cpu_on_cuda_base(base: HardwareSpec) -> str:
    """Why `lazytrain profile` refuses to time the CPU into a CUDA base profile: its device memory
    and reserves are the GPU's (h200: a 131 GiB "device" carved out of this machine's RAM plans
    nothing). (`measured_spec` itself takes any base: its CPU device keeps the base's budget.)"""
    return (f"no CUDA device is visible, so the profile would time the CPU, but base hardware {base.name!r} "
            f"is a CUDA profile (device memory {base.device_memory_gib} GiB, the GPU's); profile with "
            f"hardware=cpu as the base on this machine, or run where the GPU is visible")


def measured_spec(base: HardwareSpec, copies: CopyRates, disk: DiskRates | None,
                  peak_tflops: float, layers: list[LayerTime] | None,
                  host_optimizer_gbps: float | None = None,
                  device_memory_gib: float | None = None) -> HardwareSpec:
    """`base` with every measured field replaced. `host_optimizer_gbps` (a timed host update,
    links.measure_host_optimizer) sets host_memory_gbps; without it, on a CPU-only machine the
    copy rate stands in for it (an underestimate: a fused update streams ~2.5x faster here).

    The device is the one timed (`copies.device`), whatever the base says: `lazytrain profile`
    on a GPU machine with the default `hardware=cpu` base must not write `device_type: cpu` (a
    plan that charges the GPU's copies to compute, and a run that trains on the CPU). On CUDA the
    device memory is `device_memory_gib` (the card's total, `cuda_memory_gib`); on a CPU device it
    is the base's planned budget. A CUDA profile needs that figure where the base is a CPU one."""
    kind = copies.device.split(":")[0]
    h2d = copies.h2d_pinned_gbps or copies.h2d_pageable_gbps
    d2h = copies.d2h_pinned_gbps or copies.d2h_pageable_gbps
    upd: dict[str, Any] = dict(name="measured", h2d_gbps=round(h2d, 3), d2h_gbps=round(d2h, 3),
                               device_tflops=round(peak_tflops, 4), device_type=kind,
                               # a CPU device runs the host optimizer on the cores that compute
                               optimizer_overlaps_compute=kind != "cpu")
    if kind == "cuda":
        if device_memory_gib is not None:
            upd["device_memory_gib"] = math.floor(device_memory_gib * 10) / 10   # (never above it)
        elif base.device_type != "cuda":
            raise ValueError(f"the profile times a CUDA device but its device memory was not given "
                             f"and base hardware {base.name!r} is a {base.device_type} profile whose "
                             f"budget ({base.device_memory_gib} GiB) says nothing of the GPU; pass "
                             f"device_memory_gib or a CUDA base (hardware=h200, rtx3090, ...)")
        if base.device_type != "cuda":   # a CPU base's workspace (0.25 GiB) cannot hold a CUDA context
            upd["workspace_gib"] = max(base.workspace_gib, HardwareSpec.workspace_gib)
    if host_optimizer_gbps:
        upd["host_memory_gbps"] = round(host_optimizer_gbps, 3)
    elif copies.device == "cpu":
        upd["host_memory_gbps"] = round(copies.h2d_pageable_gbps, 3)
    if disk is not None:
        upd.update(nvme_read_gbps=round(disk.read_gbps, 3), nvme_write_gbps=round(disk.write_gbps, 3),
                   nvme_capacity_gib=round(disk.free_bytes / 2**30, 1))
        if disk.duplex_overlap is not None:   # the model is one or the other: the nearer one
            upd["nvme_full_duplex"] = disk.duplex_overlap >= 0.5
    mem = host_memory_gib()
    if mem:
        upd["host_memory_gib"] = round(mem, 1)
    if layers and peak_tflops > 0:
        upd["efficiency"] = round(min(1.0, achieved_tflops(layers) / peak_tflops), 4)
    return replace(base, **upd)


def write_profile(spec: HardwareSpec, yaml_path: Path, details: dict[str, Any]) -> Path:
    """Write `spec` as YAML (with a provenance comment) and details as JSON next to it."""
    import yaml

    yaml_path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"# Measured by `lazytrain profile` on {stamp}; details in {yaml_path.stem}.profile.json.\n"
              f"# Re-run `lazytrain profile` to refresh; plan with `hardware=measured`.\n")
    tmp = yaml_path.with_suffix(".tmp")
    try:
        with open(tmp, "w") as f:   # on disk before it replaces the old profile
            f.write(header + yaml.safe_dump(asdict(spec), sort_keys=False))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(yaml_path)
    except BaseException:   # (no half-written .tmp left next to where the profile was to go)
        tmp.unlink(missing_ok=True)
        raise
    det = yaml_path.with_name(f"{yaml_path.stem}.profile.json")
    det.write_text(json.dumps(details, indent=1, default=str))
    return yaml_path


def details_dict(copies: CopyRates, disk: DiskRates | None, peak_tflops: float,
                 layers: list[LayerTime] | None, model_name: str | None, batch_size: int,
                 seq_len: int, compute_dtype: str, host_optimizer_gbps: float | None = None,
                 optimizer_state_bits: int | None = None) -> dict[str, Any]:
    return {
        "copies": asdict(copies), "disk": disk and asdict(disk), "matmul_peak_tflops": peak_tflops,
        # host_memory_gbps: a timed update with these optimizer states (a profile taken for
        # 32-bit states misjudges an 8-bit job's update and vice versa)
        "host_optimizer_gbps": host_optimizer_gbps,
        "host_optimizer_state_bits": optimizer_state_bits if host_optimizer_gbps else None,
        "model": model_name, "batch_size": batch_size, "seq_len": seq_len,
        "compute_dtype": compute_dtype,
        "layers": [asdict(lt) for lt in layers or []],
        "achieved_block_tflops": achieved_tflops(layers) if layers else None,
    }


def profile_machine(base: HardwareSpec, model, job, device, nvme_dir: str, size: int, repeats: int,
                    with_layers: bool = True, log=None) -> tuple[HardwareSpec, dict[str, Any]]:
    """Measure this machine as `lazytrain profile` does: host<->device copies, NVMe O_DIRECT reads
    and writes in `nvme_dir`, the matmul peak in the job's compute dtype, `model`'s per-layer
    forward/backward time (unless `with_layers` is False) and the host update of the job's
    optimizer. Returns `base` with the measured fields and the raw figures (`details_dict`);
    `log(line)` gets one line per measurement."""
    from .layers import DTYPES, measure_layers
    from .links import measure_copies, measure_disk, measure_host_optimizer, measure_matmul_tflops

    say = log or (lambda line: None)
    dtype = job.compute_dtype
    copies = measure_copies(size, repeats, device)
    say(f"  host->device {copies.h2d_pageable_gbps:.1f} GB/s pageable"
        + (f", {copies.h2d_pinned_gbps:.1f} pinned" if copies.h2d_pinned_gbps else " (no pinned memory without CUDA)")
        + f";  device->host {copies.d2h_pageable_gbps:.1f} pageable"
        + (f", {copies.d2h_pinned_gbps:.1f} pinned" if copies.d2h_pinned_gbps else ""))
    disk = measure_disk(nvme_dir, size, repeats=max(1, repeats // 2))
    duplex = ("not measured (no O_DIRECT): nvme_full_duplex kept from the base profile"
              if disk.duplex_overlap is None else f"{disk.duplex_overlap:.0%} of the possible overlap "
              f"({'full' if disk.duplex_overlap >= 0.5 else 'half'}-duplex)")
    say(f"  NVMe ({disk.reason}) read {disk.read_gbps:.2f} GB/s, write {disk.write_gbps:.2f} GB/s; "
        f"read while writing: {duplex}")
    peak = measure_matmul_tflops(DTYPES[dtype], device)   # the dtype the layers are timed in
    say(f"  matmul peak {peak * 1e3:.0f} GFLOP/s ({dtype})")
    layers = None
    if with_layers:
        layers = measure_layers(model, job.batch_size, job.seq_len, dtype, device, repeats=repeats)
        for lt in (layers[0], layers[1], layers[-1]):
            say(f"  {lt.name:<8} fwd {lt.fwd_s * 1e3:8.2f} ms  bwd {lt.bwd_s * 1e3:8.2f} ms")
    opt_gbps = measure_host_optimizer(job, repeats=max(2, repeats))
    say(f"  host optimizer update ({job.optimizer_state_bits}-bit states) {opt_gbps:.1f} GB/s of "
        f"optimizer traffic")
    mem = cuda_memory_gib(device) if device.type == "cuda" else None
    if device.type != base.device_type:
        say(f"  the device timed is {device.type}, base hardware {base.name} is {base.device_type}: "
            f"device_type and optimizer overlap come from the device timed, "
            + (f"device memory too ({mem:.1f} GiB, the card's total)" if mem is not None else
               f"device memory is the base's {base.device_memory_gib} GiB (the planned budget)"))
    spec = measured_spec(base, copies, disk, peak, layers, opt_gbps, device_memory_gib=mem)
    details = details_dict(copies, disk, peak, layers, model.name if layers else None, job.batch_size,
                           job.seq_len, dtype, opt_gbps, job.optimizer_state_bits)
    return spec, details
