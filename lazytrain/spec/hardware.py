"""HardwareSpec: what the planner needs to know about one machine.

Capacities in GiB (binary), link rates in GB/s (decimal), compute in TFLOP/s, exactly as users
override them (`hardware.device_memory_gib=20`, `hardware.h2d_gbps=12`). `*_bytes` and
`*_bytes_per_s` properties give the planner's units.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from .units import GB, GiB


# Rates and throughputs: a 0 would be a division by zero in the planner (capacities may be 0).
RATES = ("h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps", "device_tflops", "efficiency",
         "host_memory_gbps")


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    device_type: str                 # "cuda" | "cpu" (CPU as the compute device with a budget)
    device_memory_gib: float
    host_memory_gib: float
    nvme_capacity_gib: float
    h2d_gbps: float                  # host -> device (pinned)
    d2h_gbps: float                  # device -> host (pinned)
    nvme_read_gbps: float
    nvme_write_gbps: float
    device_tflops: float             # peak dense matmul throughput in the compute dtype
    efficiency: float = 0.5          # achieved / peak on transformer layers
    host_memory_gbps: float = 20.0   # what the host optimizer step streams (memory-bound)
    workspace_gib: float = 1.0       # CUDA context, allocator slack, kernels' scratch
    host_reserve_gib: float = 4.0    # left to the OS, the Python process, the page cache
    optimizer_overlaps_compute: bool = True  # False when the device *is* the CPU
    # False: NVMe reads and writes share the drive's time (a read and a write in the same window
    # take read_s + write_s), what this project's machines measure (concurrent 256 MiB read +
    # write: 1.8 GB/s together, as if serial); True: they proceed in parallel at full rates.
    nvme_full_duplex: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            # A unit typo (`device_memory_gib=4G`, `h2d_gbps=fast`) arrives as a string: without
            # this it passed and was later multiplied as one ("4G" * GiB, a 4-GiB string).
            if f.type == "float" and (isinstance(v, bool) or not isinstance(v, numbers.Real)):
                raise ValueError(f"hardware.{f.name} must be a plain number (its unit is in its name), "
                                 f"got {v!r}")
            if f.type == "bool" and not isinstance(v, bool):   # ('no' is a true string)
                raise ValueError(f"hardware.{f.name} must be true or false, got {v!r}")
            if isinstance(v, float | int) and not isinstance(v, bool):
                if not math.isfinite(v):   # (inf GiB overflowed int() in the byte conversions)
                    raise ValueError(f"hardware.{f.name} must be a finite number, got {v}")
                if f.name == "efficiency" and v > 1:
                    raise ValueError(f"hardware.efficiency is the achieved fraction of device_tflops, "
                                     f"at most 1, got {v}")
                if f.name in RATES and not v > 0:   # (the planner divides by them)
                    raise ValueError(f"hardware.{f.name} must be > 0, got {v}")
                if v < 0:
                    raise ValueError(f"hardware.{f.name} must be >= 0, got {v}")
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"hardware.device_type must be 'cuda' or 'cpu', got {self.device_type!r}")

    @property
    def copies_share_compute(self) -> bool:
        """The device is the CPU: a host<->device copy is a memcpy by the cores that compute, so
        it takes compute time (the executor runs it in the step's order), and an NVMe read lands
        in device memory with no copy after it."""
        return self.device_type == "cpu"

    # planner units
    @property
    def device_memory_bytes(self) -> int: return int(self.device_memory_gib * GiB)
    @property
    def host_memory_bytes(self) -> int: return int(self.host_memory_gib * GiB)
    @property
    def nvme_capacity_bytes(self) -> int: return int(self.nvme_capacity_gib * GiB)
    @property
    def workspace_bytes(self) -> int: return int(self.workspace_gib * GiB)
    @property
    def host_usable_bytes(self) -> int: return max(0, int((self.host_memory_gib - self.host_reserve_gib) * GiB))
    @property
    def host_capacity_bytes(self) -> int:
        """What the planner may put on the host tier: the usable host RAM, less a CPU device's
        budget (carved out of the same RAM), at least 0."""
        return max(0, self.host_usable_bytes - (self.device_memory_bytes if self.device_type == "cpu" else 0))
    @property
    def h2d_bytes_per_s(self) -> float: return self.h2d_gbps * GB
    @property
    def d2h_bytes_per_s(self) -> float: return self.d2h_gbps * GB
    @property
    def nvme_read_bytes_per_s(self) -> float: return self.nvme_read_gbps * GB
    @property
    def nvme_write_bytes_per_s(self) -> float: return self.nvme_write_gbps * GB
    @property
    def host_memory_bytes_per_s(self) -> float: return self.host_memory_gbps * GB
    @property
    def achieved_flops_per_s(self) -> float: return self.device_tflops * 1e12 * self.efficiency

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "HardwareSpec":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HardwareSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown hardware keys {unknown}; valid: {sorted(known)}")
        return cls(**dict(d))
