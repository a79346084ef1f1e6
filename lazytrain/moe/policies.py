"""Eviction policies for the expert cache: LRU, LFU, forecast-driven and offline Belady.

A policy sees uses (`touch`) and picks a victim among evictable keys (`victim`). Keys are
(moe_layer, expert); `now` is the global layer-step counter (one step per MoE layer call).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Iterable, Protocol

Key = tuple[int, int]


class EvictionPolicy(Protocol):
    name: str

    def touch(self, key: Key, now: int) -> None: ...
    def forget(self, key: Key) -> None: ...
    def victim(self, candidates: Iterable[Key], now: int) -> Key: ...


class LRU:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key, now: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def forget(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        cand = set(candidates)
        for k in self._order:           # oldest first
            if k in cand:
                return k
        return next(iter(cand))


class LFU:
    """Least frequently used, with halving every `decay_steps` so old popularity fades."""

    name = "lfu"

    def __init__(self, decay_steps: int = 4096) -> None:
        self.count: dict[Key, float] = {}
        self.last: dict[Key, int] = {}
        self.decay_steps, self._next_decay = decay_steps, decay_steps

    def touch(self, key: Key, now: int) -> None:
        if now >= self._next_decay:
            self.count = {k: v / 2 for k, v in self.count.items()}
            self._next_decay = now + self.decay_steps
        self.count[key] = self.count.get(key, 0.0) + 1.0
        self.last[key] = now

    def forget(self, key: Key) -> None:
        self.last.pop(key, None)        # keep the count: frequency survives eviction

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        return min(candidates, key=lambda k: (self.count.get(k, 0.0), self.last.get(k, -1)))


class Forecast:
    """Probabilistic Belady (SeqMoE): evict the expert whose expected next use is furthest away.

    Expected steps to next use of (l', e) = steps until layer l' runs again + L * (1 - p) / p, with p an
    EMA of how often e is routed at layer l'; experts the predictor just asked for count as used at
    their target layer.
    """

    name = "forecast"

    def __init__(self, num_layers: int, ema: float = 0.05) -> None:
        self.L, self.ema = num_layers, ema
        self.p: dict[Key, float] = {}
        self.predicted: dict[Key, int] = {}   # key -> step it is predicted for

    def observe_layer(self, layer: int, used: Iterable[int], num_experts: int) -> None:
        used = set(used)
        for e in range(num_experts):
            k = (layer, e)
            self.p[k] = (1 - self.ema) * self.p.get(k, 0.1) + self.ema * (e in used)

    def predict(self, key: Key, step: int) -> None:
        self.predicted[key] = step

    def touch(self, key: Key, now: int) -> None:
        pass

    def forget(self, key: Key) -> None:
        self.predicted.pop(key, None)

    def _distance(self, key: Key, now: int) -> float:
        at = self.predicted.get(key)
        if at is not None and at >= now:
            return float(at - now)
        cur = now % self.L
        d0 = (key[0] - cur) % self.L or self.L
        p = max(self.p.get(key, 0.1), 1e-3)
        return d0 + self.L * (1 - p) / p

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        return max(candidates, key=lambda k: self._distance(k, now))


class Belady:
    """Offline optimum for a known future (the bound in the benchmark): evict the key used furthest
    in the future. `future[step]` is the set of experts the layer call at `step` needs."""

    name = "belady"

    def __init__(self, future: list[tuple[int, tuple[int, ...]]]) -> None:
        self.uses: dict[Key, list[int]] = {}
        for step, (layer, ids) in enumerate(future):
            for e in ids:
                self.uses.setdefault((layer, e), []).append(step)

    def next_use(self, key: Key, now: int) -> float:
        u = self.uses.get(key)
        if not u:
            return float("inf")
        i = bisect.bisect_left(u, now)
        return u[i] if i < len(u) else float("inf")

    def touch(self, key: Key, now: int) -> None:
        pass

    def forget(self, key: Key) -> None:
        pass

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        return max(candidates, key=lambda k: self.next_use(k, now))


def make_policy(name: str, num_layers: int, future: list | None = None) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "forecast":
        return Forecast(num_layers)
    if name == "belady":
        if future is None:
            raise ValueError("eviction=belady needs the recorded future routing (benchmark only)")
        return Belady(future)
    raise ValueError(f"unknown eviction policy {name!r}; valid: lru, lfu, forecast")
