"""Measured link rates: host<->device copies (pinned and pageable), NVMe reads/writes (O_DIRECT),
and the host optimizer update the executor runs for a job.

Every figure is the median of `repeats` timed transfers after one warm-up, in GB/s (decimal).
On a CPU-only machine the "device" is the CPU itself, so host->device is a copy between two host
buffers (what the executor pays to place a layer on the device tier), made as the executor makes it
for a layer of at least storage.fastcopy.MIN_BYTES (16 MiB): with streaming stores. A model whose
layers are smaller is copied with torch's copy_, ~1.3x slower, so its planned copy times are
that much short (small copies are a small part of its step); pinned memory needs CUDA and is
reported as None there.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..spec.units import GB, MiB
from ..storage.aligned_io import DirectFile, aligned_empty, drop_page_cache, round_up
from ..storage.fastcopy import copy_into


@dataclass(frozen=True)
class CopyRates:
    device: str
    h2d_pinned_gbps: float | None
    d2h_pinned_gbps: float | None
    h2d_pageable_gbps: float
    d2h_pageable_gbps: float
    size_bytes: int


@dataclass(frozen=True)
class DiskRates:
    path: str
    direct: bool              # O_DIRECT accepted by the filesystem (else buffered + fdatasync)
    reason: str
    read_gbps: float          # cold reads (page cache dropped for the file first)
    write_gbps: float         # including fsync
    size_bytes: int
    free_bytes: int           # free space in the directory's filesystem
    duplex_overlap: float | None = None   # reading one file while writing another: 0 = the two
                              # take as long as one after the other (a half-duplex drive), 1 = as
                              # long as the slower alone (full duplex); None: not measured


def _median_gbps(fn, nbytes: int, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / GB


def measure_copies(size_bytes: int = 256 * MiB, repeats: int = 5,
                   device: torch.device | None = None) -> CopyRates:
    """Host<->device copy rates; pinned ones only where CUDA can pin host memory."""
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    n = size_bytes
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(1)  # touch the pages so first-touch faults are not timed
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cpu":   # as the executor fetches host-tier weights on a CPU device
        h2d = _median_gbps(lambda: copy_into(dev, pageable), n, repeats, sync)
    else:
        h2d = _median_gbps(lambda: dev.copy_(pageable), n, repeats, sync)
    d2h = _median_gbps(lambda: pageable.copy_(dev), n, repeats, sync)
    h2d_p = d2h_p = None
    if device.type == "cuda":
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        h2d_p = _median_gbps(lambda: dev.copy_(pinned, non_blocking=True), n, repeats, sync)
        d2h_p = _median_gbps(lambda: pinned.copy_(dev, non_blocking=True), n, repeats, sync)
    return CopyRates(device=str(device), h2d_pinned_gbps=h2d_p, d2h_pinned_gbps=d2h_p,
                     h2d_pageable_gbps=h2d, d2h_pageable_gbps=d2h, size_bytes=n)


def measure_disk(directory: str | Path, size_bytes: int = 256 * MiB, repeats: int = 3,
                 chunk_bytes: int = 16 * MiB) -> DiskRates:
    """Sequential write (+fsync) and cold read of one file in `directory`, O_DIRECT where allowed;
    then the read again while a second file is written, to see whether the drive overlaps the two
    (the planner's `nvme_full_duplex`)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f".lazytrain-profile-{os.getpid()}.bin"
    path2 = d / f".lazytrain-profile-{os.getpid()}-w.bin"
    chunk = round_up(chunk_bytes)
    n = max(chunk, size_bytes // chunk * chunk)
    buf = aligned_empty(chunk)
    buf.fill_(7)
    buf2 = aligned_empty(chunk)
    buf2.fill_(3)
    try:
        f = DirectFile(path, "w", size_bytes=n)
        direct, reason = f.direct, f.reason

        def write(f=f, buf=buf) -> None:
            for off in range(0, n, chunk):
                f.write_from(buf, off)
            f.fsync()

        def read() -> None:
            for off in range(0, n, chunk):
                f.read_into(buf, off)

        w_times, r_times = [], []
        write()  # warm-up: allocate the file's blocks
        for _ in range(repeats):
            t0 = time.perf_counter()
            write()
            w_times.append(time.perf_counter() - t0)
            drop_page_cache(path)  # a no-op for O_DIRECT; keeps buffered reads honest
            t0 = time.perf_counter()
            read()
            r_times.append(time.perf_counter() - t0)
        c_times = []
        if direct:   # buffered I/O would measure the page cache, not the drive
            f2 = DirectFile(path2, "w", size_bytes=n)
            try:
                if f2.direct:
                    write(f2, buf2)   # allocate its blocks
                for _ in range(repeats) if f2.direct else ():
                    failed: list[BaseException] = []

                    def reader() -> None:
                        try:
                            read()
                        except BaseException as e:  # re-raised below: a failed read is no overlap
                            failed.append(e)
                    th = threading.Thread(target=reader)
                    t0 = time.perf_counter()
                    th.start()
                    write(f2, buf2)
                    th.join()
                    if failed:
                        raise failed[0]
                    c_times.append(time.perf_counter() - t0)
            finally:
                f2.close()
        f.close()
    finally:
        path.unlink(missing_ok=True)
        path2.unlink(missing_ok=True)
    tr, tw = statistics.median(r_times), statistics.median(w_times)
    overlap = None
    if c_times:   # saved time / the most that could be saved
        overlap = round(min(1.0, max(0.0, ((tr + tw) - statistics.median(c_times)) / max(1e-12, min(tr, tw)))), 3)
    return DiskRates(path=str(d), direct=direct, reason=reason, read_gbps=n / tr / GB,
                     write_gbps=n / tw / GB, size_bytes=n, free_bytes=shutil.disk_usage(d).free,
                     duplex_overlap=overlap)


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, n: int = 2048,
                          repeats: int = 5) -> float:
    """Dense square matmul throughput: the compute peak the planner's efficiency is relative to."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    flops = 2 * n ** 3
    rate = _median_gbps(lambda: a @ b, flops, repeats, sync)  # "GB/s" of flops = GFLOP/s
    return rate / 1e3


def measure_host_optimizer(job, numel: int = 1 << 24, repeats: int = 5) -> float:
    """The executor's host update for `job` (fused AdamW on the master weights, or the 8-bit
    AdamW, then the compute-dtype copy of the weights), timed on one `numel`-parameter layer of
    four tensors: returns its rate as the GB/s `hardware.host_memory_gbps` means, i.e.
    costmodel.optimizer_traffic_per_param(job) bytes per parameter over the median time."""
    from torch.optim.adamw import adamw as _adamw

    from ..costmodel import optimizer_traffic_per_param
    from ..optim import AdamW8bit

    f32 = torch.float32
    mdt = f32 if job.master_bytes == 4 else torch.bfloat16
    cdt = torch.bfloat16 if job.compute_bytes == 2 else f32
    g = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=g).to(mdt) * 0.02
    grad = (torch.randn(numel, generator=g) * 1e-3).to(mdt)
    out = torch.empty(numel, dtype=cdt, pin_memory=torch.cuda.is_available())
    parts = [numel // 4] * 3 + [numel - 3 * (numel // 4)]
    if job.optimizer_state_bits == 8:
        p = torch.nn.Parameter(master)
        # weight decay 0: the executor's default, as in the fp32 branch (the kernel then skips its multiply)
        opt = AdamW8bit([p], lr=1e-4, weight_decay=0.0)

        def update() -> None:
            p.grad = grad
            opt.step_params([p], clip_scale=1.0)
            out.copy_(p.data)
    else:
        m, v = torch.zeros_like(master), torch.zeros_like(master)
        steps = [torch.zeros((), dtype=f32) for _ in parts]
        views = [t.split(parts) for t in (master, grad, m, v)]

        def update() -> None:
            _adamw(list(views[0]), list(views[1]), list(views[2]), list(views[3]), [], steps, fused=True,
                   amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-4, weight_decay=0.0, eps=1e-8,
                   maximize=False)
            out.copy_(master)
    nbytes = int(optimizer_traffic_per_param(job) * numel)
    return _median_gbps(update, nbytes, repeats)
