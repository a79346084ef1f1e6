"""Counters of the expert cache and their user-facing summary (always shown, `--json` schema)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MoeCounters:
    """Raw counters; one instance per phase (prefill, decode)."""

    tokens: int = 0
    demand: int = 0            # (layer, expert) pairs the model's routing asked for
    hits: int = 0              # ... already resident: no wait at all
    late: int = 0              # ... being prefetched, not done yet: waited (counted as a miss)
    misses: int = 0            # ... not requested before: demand read
    prefetch_issued: int = 0   # prefetch reads queued
    prefetch_used: int = 0     # of those, demanded before eviction (in this phase or a later one)
    prefetch_served: int = 0   # demands met by a prefetch, whichever phase issued it
    prefetch_dropped: int = 0  # predictions not queued (queue full or no evictable slot)
    host_hits: int = 0         # demand misses of the device slots served from the host tier
    host_prefetches: int = 0   # prefetches served from the host tier (no disk read)
    host_bytes: int = 0        # bytes copied host tier -> device slots
    bytes_read: int = 0
    reads: int = 0
    stall_s: float = 0.0       # time the forward waited on expert reads
    predictor_s: float = 0.0   # time spent predicting and issuing prefetches
    wall_s: float = 0.0

    def add(self, other: "MoeCounters") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class MoeStats:
    """The summary users see: demand hit rate, prefetch precision/recall, bytes, stalls, speed."""

    hit_rate: float | None              # None: no expert was asked for (no decode step)
    prefetch_precision: float
    prefetch_recall: float
    bytes_per_token: float
    stall_s_per_token: float
    predictor_s_per_token: float
    tokens_per_s: float
    cache_slots: int
    cache_fraction: float
    cache_bytes: int
    tokens: int
    io_mode: str
    extra: dict = field(default_factory=dict)
    host_hit_rate: float = 0.0          # share of device-slot misses served from host RAM
    host_cache_slots: int = 0           # 0: no host tier
    host_cache_bytes: int = 0

    @staticmethod
    def from_counters(c: MoeCounters, cache_slots: int, total_experts: int, slot_bytes: int,
                      io_mode: str, host_cache_slots: int = 0) -> "MoeStats":
        t = max(c.tokens, 1)
        return MoeStats(
            hit_rate=c.hits / c.demand if c.demand else None,   # (was 1.0: "hit 100%" for nothing)
            prefetch_precision=c.prefetch_used / c.prefetch_issued if c.prefetch_issued else 0.0,
            prefetch_recall=(c.prefetch_served / (c.prefetch_served + c.misses)
                             if c.prefetch_served + c.misses else 0.0),
            bytes_per_token=c.bytes_read / t, stall_s_per_token=c.stall_s / t,
            predictor_s_per_token=c.predictor_s / t,
            tokens_per_s=c.tokens / c.wall_s if c.wall_s > 0 else 0.0,
            cache_slots=cache_slots, cache_fraction=cache_slots / max(total_experts, 1),
            cache_bytes=cache_slots * slot_bytes, tokens=c.tokens, io_mode=io_mode,
            extra={"demand": c.demand, "late": c.late, "misses": c.misses, "bytes_read": c.bytes_read,
                   "prefetch_issued": c.prefetch_issued, "prefetch_dropped": c.prefetch_dropped,
                   "host_hits": c.host_hits, "host_prefetches": c.host_prefetches,
                   "host_bytes_per_token": c.host_bytes / t},
            host_hit_rate=c.host_hits / c.misses if c.misses else 0.0,
            host_cache_slots=host_cache_slots, host_cache_bytes=host_cache_slots * slot_bytes)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in (
            "hit_rate", "prefetch_precision", "prefetch_recall", "bytes_per_token", "stall_s_per_token",
            "predictor_s_per_token", "tokens_per_s", "cache_slots", "cache_fraction", "cache_bytes",
            "tokens", "io_mode", "host_hit_rate", "host_cache_slots", "host_cache_bytes")}
        d.update(self.extra)
        return d

    def line(self) -> str:
        host = (f" | host {self.host_cache_slots} slots ({self.host_cache_bytes / 2**20:.1f} MiB), "
                f"hit {self.host_hit_rate:.1%} of misses" if self.host_cache_slots else "")
        hit = f"{self.hit_rate:.1%}" if self.hit_rate is not None else "n/a (no decode step)"
        return (f"moe: hit {hit} | prefetch precision {self.prefetch_precision:.1%} "
                f"recall {self.prefetch_recall:.1%} | {self.bytes_per_token / 2**20:.2f} MiB/token | "
                f"stall {self.stall_s_per_token * 1e3:.2f} ms/token | predictor "
                f"{self.predictor_s_per_token * 1e3:.2f} ms/token | {self.tokens_per_s:.1f} tok/s | "
                f"cache {self.cache_slots} slots ({self.cache_fraction:.0%}, "
                f"{self.cache_bytes / 2**20:.1f} MiB){host} | {self.io_mode}")
