"""`lazytrain profile hardware=NAME [model=...] [job.*=...] [--nvme-dir DIR] [--size-mib N]`

Measures this machine — host<->device copies (pinned and pageable), NVMe write/read with O_DIRECT
in --nvme-dir, the matmul peak, the per-layer forward/backward time of the model given with model=
or model.path= (without one, the efficiency is hardware=NAME's) and the host optimizer update for
the job's optimizer (job.optimizer_state_bits) — and writes configs/hardware/measured.yaml
(HardwareSpec keys; unmeasured capacities from hardware=NAME), so that
`lazytrain plan|train hardware=measured` plans with it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="lazytrain profile", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides: hardware=NAME model=NAME job.seq_len=N ... "
                   "(without model= or model.path=, no per-layer timing: the efficiency stays hardware=NAME's)")
    p.add_argument("--nvme-dir", default=None, help="directory on the SSD to measure (default: a temp dir)")
    p.add_argument("--size-mib", type=int, default=256, help="bytes per timed transfer (MiB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-layers", action="store_true", help="skip the per-layer model timing")
    p.add_argument("--out", default=None, help="YAML to write (default: configs/hardware/measured.yaml)")
    return p.parse_intermixed_args(argv), []   # (overrides after an option were refused: a review)


def _names_a_model(overrides: list[str]) -> bool:
    """Whether the overrides choose or shape the model (model=NAME, model.path=DIR, model.*=...)."""
    keys = (o.split("=", 1)[0].lstrip("+~") for o in overrides)
    return any(k == "model" or k.startswith("model.") for k in keys)


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
    for flag, v in (("--size-mib", args.size_mib), ("--repeats", args.repeats)):
        if v < 1:
            print(f"lazytrain profile: {flag} must be >= 1, got {v}", file=sys.stderr)
            return 2
    if args.nvme_dir and not Path(args.nvme_dir).is_dir():
        print(f"lazytrain profile: --nvme-dir {args.nvme_dir} does not exist", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else config_dir() / "hardware" / "measured.yaml"
    try:   # (before minutes of timing: a path it cannot write is one line now, not a traceback then)
        from ..cli.plan import _check_output
        _check_output(str(out), "--out")
    except ConfigError as e:
        print(f"lazytrain profile: {e}", file=sys.stderr)
        return 2
    import torch

    from ..profile.hardware import profile_machine, write_profile

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and base.device_type == "cuda":   # said before minutes of timing
        from ..profile.hardware import cpu_on_cuda_base
        print(f"lazytrain profile: {cpu_on_cuda_base(base)}", file=sys.stderr)
        return 2
    # The config's default model is the toy tiny-llama (hidden 64): its blocks reach a few percent
    # of the matmul peak, an efficiency that made every plan for a real model ~7x too slow.
    with_layers = not args.no_layers and _names_a_model(args.overrides)
    print(f"profiling {device} (base hardware {base.name}, "
          f"{f'model {mspec.name}' if with_layers else 'no per-layer timing'}) ...", flush=True)
    if not args.no_layers and not with_layers:
        print(f"  no model= given: per-layer timing skipped, efficiency {base.efficiency} kept from "
              f"hardware={base.name} (model=NAME or model.path=DIR measures it for that model)", flush=True)
    from ..storage.tiers import memory_backed

    disk_dir = args.nvme_dir or tempfile.gettempdir()
    fs = memory_backed(disk_dir)
    if fs:   # (the drive test would time RAM and write it into the profile as the NVMe's rates)
        print(f"  warning: {disk_dir} is on {fs} (RAM): its read/write rates are not a drive's; give "
              f"--nvme-dir a directory on the SSD that storage.nvme_dir will use", flush=True)
    busy = _busy_cores()
    if busy:
        print(f"  warning: {busy}; the timings will be low (profile on an idle machine)", flush=True)
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as d:
        spec, details = profile_machine(base, mspec, job, device, args.nvme_dir or d, args.size_mib * MiB,
                                        args.repeats, with_layers=with_layers,
                                        log=lambda line: print(line, flush=True))
    try:
        write_profile(spec, out, details)
    except OSError as e:
        print(f"lazytrain profile: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    default = (config_dir() / "hardware" / "measured.yaml").resolve()
    use = ("hardware=measured" if Path(out).resolve() == default else
           f"hardware=NAME once it is copied to {config_dir() / 'hardware'}/NAME.yaml")
    print(f"wrote {out} (efficiency {spec.efficiency:.3g}); plan with {use}")
    if with_layers and spec.efficiency < LOW_EFFICIENCY:
        print(f"  warning: efficiency {spec.efficiency:.3g}: {mspec.name}'s blocks reach under "
              f"{LOW_EFFICIENCY:.0%} of the matmul peak (a small model's are mostly overhead); a plan for a "
              "larger model with this profile will predict it far too slow: profile with the model you "
              "will train", flush=True)
    return 0


LOW_EFFICIENCY = 0.05


def _busy_cores() -> str | None:
    """What else is running, when the 1-minute load average says others hold over a quarter of
    the cores this process may use (the profile times this machine as if it were its own)."""
    import os

    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return None
    if load > 0.25 * cores + 0.5:
        return f"the 1-minute load average is {load:.1f} on {cores} core(s): other processes are running"
    return None
