"""`lazytrain profile hardware=NAME [model=...] [job.*=...] [--nvme-dir DIR] [--size-mib N]`

Measures this machine — host<->device copies (pinned and pageable), NVMe write/read with O_DIRECT
in --nvme-dir, the matmul peak, the per-layer forward/backward time of the chosen model and the
host optimizer update for the job's optimizer (job.optimizer_state_bits) — and
writes configs/hardware/measured.yaml (HardwareSpec keys; unmeasured capacities from hardware=NAME),
so that `lazytrain plan|train hardware=measured` plans with it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="lazytrain profile", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides: hardware=NAME model=NAME job.seq_len=N ...")
    p.add_argument("--nvme-dir", default=None, help="directory on the SSD to measure (default: a temp dir)")
    p.add_argument("--size-mib", type=int, default=256, help="bytes per timed transfer (MiB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-layers", action="store_true", help="skip the per-layer model timing")
    p.add_argument("--out", default=None, help="YAML to write (default: configs/hardware/measured.yaml)")
    return p.parse_args(argv), []


def main(argv: list[str] | None = None) -> int:
    args, _ = _parse(list(sys.argv[1:] if argv is None else argv))
    from ..cli.config import ConfigError, config_dir, hardware_spec, job_spec, load_config, model_spec
    from ..spec.units import MiB

    try:
        cfg = load_config([o for o in args.overrides if o != "hardware=measured"])
        base, mspec, job = hardware_spec(cfg), model_spec(cfg), job_spec(cfg)
    except (ConfigError, ValueError) as e:
        print(f"lazytrain profile: {e}", file=sys.stderr)
        return 2
    if args.nvme_dir and not Path(args.nvme_dir).is_dir():
        print(f"lazytrain profile: --nvme-dir {args.nvme_dir} does not exist", file=sys.stderr)
        return 2
    import torch

    from ..profile.hardware import details_dict, measured_spec, write_profile
    from ..profile.layers import DTYPES, measure_layers
    from ..profile.links import measure_copies, measure_disk, measure_host_optimizer, measure_matmul_tflops

    size = args.size_mib * MiB
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = str(cfg.job.compute_dtype)
    print(f"profiling {device} (base hardware {base.name}, model {mspec.name}) ...", flush=True)
    copies = measure_copies(size, args.repeats, device)
    print(f"  host->device {copies.h2d_pageable_gbps:.1f} GB/s pageable"
          + (f", {copies.h2d_pinned_gbps:.1f} pinned" if copies.h2d_pinned_gbps else " (no pinned memory without CUDA)")
          + f";  device->host {copies.d2h_pageable_gbps:.1f} pageable"
          + (f", {copies.d2h_pinned_gbps:.1f} pinned" if copies.d2h_pinned_gbps else ""), flush=True)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as d:
        disk = measure_disk(args.nvme_dir or d, size, repeats=max(1, args.repeats // 2))
    duplex = ("not measured (no O_DIRECT): nvme_full_duplex kept from the base profile"
              if disk.duplex_overlap is None else f"{disk.duplex_overlap:.0%} of the possible overlap "
              f"({'full' if disk.duplex_overlap >= 0.5 else 'half'}-duplex)")
    print(f"  NVMe ({disk.reason}) read {disk.read_gbps:.2f} GB/s, write {disk.write_gbps:.2f} GB/s; "
          f"read while writing: {duplex}", flush=True)
    peak = measure_matmul_tflops(DTYPES[dtype], device)   # the dtype the layers are timed in
    print(f"  matmul peak {peak * 1e3:.0f} GFLOP/s ({dtype})", flush=True)
    layers = None
    if not args.no_layers:
        layers = measure_layers(mspec, int(cfg.job.batch_size), int(cfg.job.seq_len), dtype, device,
                                repeats=args.repeats)
        for lt in (layers[0], layers[1], layers[-1]):
            print(f"  {lt.name:<8} fwd {lt.fwd_s * 1e3:8.2f} ms  bwd {lt.bwd_s * 1e3:8.2f} ms", flush=True)
    opt_gbps = measure_host_optimizer(job, repeats=max(2, args.repeats))
    print(f"  host optimizer update ({job.optimizer_state_bits}-bit states) "
          f"{opt_gbps:.1f} GB/s of optimizer traffic", flush=True)
    spec = measured_spec(base, copies, disk, peak, layers, opt_gbps)
    out = Path(args.out) if args.out else config_dir() / "hardware" / "measured.yaml"
    write_profile(spec, out, details_dict(copies, disk, peak, layers, mspec.name,
                                          int(cfg.job.batch_size), int(cfg.job.seq_len), dtype, opt_gbps,
                                          job.optimizer_state_bits))
    print(f"wrote {out} (efficiency {spec.efficiency:.2f}); plan with hardware=measured")
    return 0
