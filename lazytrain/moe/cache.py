"""The expert cache: a fixed pool of device slots, one expert record per slot, filled from the store
by a deadline-ordered, bounded read queue served by a few I/O threads.

Threading: only the forward thread allocates/evicts slots and changes the key->slot map; I/O threads
only fill a slot they were handed and then set the request's event. A slot is freed only after its
request's event is set (cancelling just marks the request), so a read never lands in a reused slot,
and the forward never computes on a slot whose read has not finished (it waits on the event: that wait
is the stall we report). The heap is pushed/popped under the GIL (heapq is C, keys are ints) and
workers are woken through a C SimpleQueue: the forward thread never waits on a Python lock that a
descheduled I/O thread holds (that cost ~2.5 ms per read on the loaded 2-vCPU machines).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from ..storage.aligned_io import aligned_empty
from .host_tier import HostTier, host_policy_for
from .policies import EvictionPolicy, Key
from .stats import MoeCounters
from .store import ExpertStore, StoreError


class CacheTooSmallError(ValueError):
    """The cache cannot hold one layer's routed experts."""


@dataclass
class ReadRequest:
    key: Key
    slot: int
    deadline: int
    prefetch: bool
    state: str = "queued"            # queued | reading | done | failed | skipped
    cancelled: bool = False          # set by the forward thread; the worker then skips the read
    event: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class ExpertCache:
    """Slots + eviction + reads. `acquire` is the demand path, `prefetch` the speculative one."""

    def __init__(self, store: ExpertStore, num_slots: int, policy: EvictionPolicy,
                 device: torch.device | str = "cpu", io_workers: int = 2, queue_depth: int = 16,
                 verify: str = "first", host_slots: int = 0) -> None:
        min_slots = max(lr.num_experts for lr in store.layers)
        if num_slots < min_slots:
            raise CacheTooSmallError(
                f"expert cache of {num_slots} slots cannot hold one layer's routed experts; the minimum "
                f"is {min_slots} slots (a prompt can route to all {min_slots} experts of a layer): set "
                f"moe.cache_slots>={min_slots}, or leave it unset (moe.cache_fraction is raised to the minimum)")
        if verify not in ("first", "always", "never"):
            raise ValueError(f"moe.verify must be first|always|never, got {verify!r}")
        self.store, self.policy, self.verify = store, policy, verify
        self.device = torch.device(device)
        self.num_slots, self.slot_bytes = num_slots, store.record_bytes
        if self.device.type == "cpu":
            # One aligned block so every slot is 4096-aligned for O_DIRECT reads straight into it.
            self.pool = aligned_empty(num_slots * self.slot_bytes, huge=True).view(num_slots, self.slot_bytes)
        else:
            self.pool = torch.empty((num_slots, self.slot_bytes), dtype=torch.uint8, device=self.device)
        self.slot_of: dict[Key, int] = {}
        self.free = list(range(num_slots - 1, -1, -1))
        self.pending: dict[Key, ReadRequest] = {}     # queued or reading
        # Loaded by prefetch, not yet demanded: deadline, and the counters of the phase that issued it
        # (its use counts there: a prefill prefetch used in the decode is no decode prefetch).
        self.prefetched: dict[Key, tuple[int, MoeCounters]] = {}
        self.pinned: set[int] = set()
        self.verified: set[Key] = set()
        self.counters = MoeCounters()
        # Optional host-RAM tier between the device slots and NVMe (exclusive victim cache, see
        # host_tier.py); None keeps the original two-level behaviour exactly.
        self.host: HostTier | None = (HostTier(host_slots, self.slot_bytes, host_policy_for(policy),
                                               self.device) if host_slots > 0 else None)
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        import queue

        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self._heap: list[tuple[int, int, ReadRequest]] = []
        self._seq = itertools.count()
        self.queue_depth = queue_depth
        self.io_workers = max(1, io_workers)
        self.read_s_ema = 0.0                          # seconds per expert read (for lookahead=auto)
        self._closed = False
        # The workers hold the cache weakly: one dropped without close() (an engine forgotten in a
        # notebook) is collected, its pool freed, and the finalizer wakes them to exit.
        ref = weakref.ref(self)
        self._threads = [threading.Thread(target=_io_worker, args=(ref, self._wake),
                                          name=f"lazytrain-moe-io{i}", daemon=True)
                         for i in range(max(1, io_workers))]
        self._stop = weakref.finalize(self, _wake_all, self._wake, len(self._threads))
        for t in self._threads:
            t.start()

    # ---- views: the pool seen as the model's fused expert tensors, slot-indexed -----------------
    def layer_views(self, layer: int) -> dict[str, torch.Tensor]:
        """{param name: tensor [num_slots, *per-expert shape]} strided views into the pool."""
        v = self._views.get(layer)
        if v is None:
            lr = self.store.layers[layer]
            v = {}
            for spec, off in zip(lr.tensors, lr.offsets):
                dt = getattr(torch, spec.dtype)
                flat = self.pool[:, off:off + spec.nbytes].view(dt)
                v[spec.name] = flat.view(self.num_slots, *spec.shape)
            self._views[layer] = v
        return v

    # ---- slot allocation (forward thread only) ------------------------------------------------
    def _evictable(self, now: int | None = None, before: int | None = None) -> list[Key]:
        """Keys whose slots may be reused; with `before` (a prefetch's deadline), not those
        prefetched for a deadline from `now` to `before`: a prefetch must not evict one that is
        needed sooner (served from the host tier, prefetches are instant and unbounded by
        queue_depth, and with a tiny cache they evicted each other: hit rate 0.51 -> 0.23,
        measured). One whose deadline has passed was mispredicted: fair game."""
        def protected(k: Key) -> bool:
            d = self.prefetched.get(k)
            return d is not None and now <= d[0] <= before
        return [k for k, s in self.slot_of.items() if s not in self.pinned and k not in self.pending
                and (before is None or not protected(k))]

    def _alloc(self, now: int, keep: Key | None = None, before: int | None = None) -> int | None:
        if self.free:
            return self.free.pop()
        cand = self._evictable(now, before)
        if not cand:
            return None
        victim = self.policy.victim(cand, now)
        slot = self.slot_of.pop(victim)
        if self.host is not None:
            # Evictable means not pending: the slot holds the complete record, so it can spill.
            self.host.put(victim, self.pool[slot], now, keep=keep)
        self.policy.forget(victim)
        self.prefetched.pop(victim, None)
        return slot

    def _enqueue(self, key: Key, slot: int, deadline: int, prefetch: bool) -> ReadRequest:
        req = ReadRequest(key, slot, deadline, prefetch)
        self.slot_of[key] = slot
        self.pending[key] = req
        self._push(deadline, req)
        return req

    def _push(self, deadline: int, req: ReadRequest) -> None:
        heapq.heappush(self._heap, (deadline, next(self._seq), req))
        self._wake.put(True)

    def _cancel_queued(self, keep: set[Key]) -> int:
        """Cancel queued (not started) prefetches not in `keep`; their slots are freed by `_reap`
        once the worker has skipped them."""
        n = 0
        for key, req in self.pending.items():
            if req.prefetch and req.state == "queued" and key not in keep and not req.cancelled:
                req.cancelled = True
                n += 1
        return n

    def _reap(self) -> None:
        """Drop finished requests from `pending`; free slots of cancelled or failed reads (a failed
        demand read is raised by the first one waited on; the others' stayed, holding their slots,
        and raised their old error again instead of reading again: a review)."""
        for key, req in list(self.pending.items()):
            if req.event.is_set():
                if req.cancelled or req.error is not None:
                    self._release(key)
                elif req.state == "skipped":     # un-cancelled after the skip: wait() re-reads it
                    continue
                elif req.error is None:
                    del self.pending[key]

    def _release(self, key: Key) -> None:
        slot = self.slot_of.pop(key, None)
        self.pending.pop(key, None)
        self.prefetched.pop(key, None)
        if slot is not None:
            self.free.append(slot)

    # ---- demand path --------------------------------------------------------------------------
    def _check_open(self) -> None:
        # After close() no worker serves the queue: a read issued now would be waited on forever.
        if self._closed:
            raise RuntimeError("the expert cache is closed (its engine's close() was called); "
                               "load the store again with load_streamed")

    def acquire(self, layer: int, experts: list[int], now: int, c: MoeCounters) -> list[ReadRequest]:
        """Pin `experts` of `layer`, start demand reads for misses; returns requests to wait on."""
        self._check_open()
        keys = [(layer, e) for e in experts]
        waits: list[ReadRequest] = []
        self._reap()
        # Prefetches queued for this layer that routing did not pick are now useless.
        self._cancel_queued(keep=set(keys) | {k for k in self.pending if k[0] != layer})
        # Every routed expert already resident is pinned first: a miss earlier in this loop must not
        # evict one routed later in the same call (it was then read back from disk: review)
        for key in keys:
            if (slot := self.slot_of.get(key)) is not None:
                self.pinned.add(slot)
        for key in keys:
            c.demand += 1
            slot = self.slot_of.get(key)
            if slot is not None:
                self.pinned.add(slot)
                req = self.pending.get(key)
                if req is not None and req.cancelled:
                    req.cancelled = False            # wanted after all: un-cancel (maybe already skipped)
                    if req.event.is_set() and req.state != "done":
                        req = self._reissue(req, now)
                # A hit only if the read is done: the worker may have skipped the request (cancelled
                # when it looked) since the check above; then the slot is empty and wait() re-reads it.
                if req is not None and req.event.is_set() and req.state == "done":
                    self._finish(req)            # finished in the background: a hit
                    req = None
                if req is not None:
                    c.late += 1
                    if req.deadline > now:       # promote: the forward needs it now
                        req.deadline = now
                        self._push(now, req)
                    waits.append(req)
                else:
                    c.hits += 1
                if key in self.prefetched:
                    c.prefetch_served += 1
                    self.prefetched.pop(key)[1].prefetch_used += 1
            else:
                c.misses += 1
                in_host = self.host is not None and key in self.host
                slot = self._alloc(now, keep=key if in_host else None)
                while slot is None:              # every slot pinned or in flight: wait for one read
                    self._reap()
                    slot = self._alloc(now, keep=key if in_host else None)
                    if slot is not None:
                        break
                    busy = [r for r in self.pending.values()
                            if not r.event.is_set() and r.slot not in self.pinned]
                    if not busy:
                        raise CacheTooSmallError(
                            f"no free expert slot for layer {layer} ({self.num_slots} slots, "
                            f"{len(self.pinned)} pinned); raise moe.cache_slots")
                    t0 = time.perf_counter()
                    busy[0].event.wait()
                    c.stall_s += time.perf_counter() - t0
                self.pinned.add(slot)
                if in_host and self._from_host(key, slot, c):
                    c.host_hits += 1             # a memcpy instead of a disk read: no wait
                else:
                    waits.append(self._enqueue(key, slot, now, prefetch=False))
            self.policy.touch(key, now)
        return waits

    def _from_host(self, key: Key, slot: int, c: MoeCounters) -> bool:
        """Fill device `slot` with `key` from the host tier (forward thread; synchronous copy)."""
        if not self.host.take(key, self.pool[slot]):
            return False
        self.slot_of[key] = slot
        c.host_bytes += self.slot_bytes
        return True

    def wait(self, waits: list[ReadRequest], c: MoeCounters) -> None:
        for req in waits:
            self._wait(req, c)
            if req.state == "skipped":           # skipped as cancelled while being demanded again
                req = self._reissue(req, req.deadline)
                self._wait(req, c)
            self._finish(req)

    def _wait(self, req: ReadRequest, c: MoeCounters) -> None:
        if not req.event.is_set():
            t0 = time.perf_counter()
            req.event.wait()
            c.stall_s += time.perf_counter() - t0
        if req.error is not None:
            err = req.error
            self._release(req.key)
            raise err

    def _reissue(self, req: ReadRequest, now: int) -> ReadRequest:
        """A cancelled prefetch the worker already skipped, demanded after all: read it again."""
        new = ReadRequest(req.key, req.slot, now, prefetch=req.prefetch)
        self.pending[req.key] = new
        self._push(now, new)
        return new

    def _finish(self, req: ReadRequest) -> None:
        if self.pending.get(req.key) is req:
            del self.pending[req.key]

    def slots(self, layer: int, experts: list[int]) -> list[int]:
        return [self.slot_of[(layer, e)] for e in experts]

    def unpin(self) -> None:
        self.pinned.clear()

    # ---- prefetch path ------------------------------------------------------------------------
    def prefetch(self, layer: int, experts: list[int], deadline: int, now: int, c: MoeCounters) -> None:
        self._check_open()
        self._reap()     # so `pending` only holds reads still queued or on the disk
        for e in experts:
            key = (layer, e)
            if key in self.slot_of:
                continue
            in_host = self.host is not None and key in self.host
            if not in_host and len(self.pending) >= self.queue_depth:   # the bound is on disk reads
                c.prefetch_dropped += 1
                continue
            slot = self._alloc(now, keep=key if in_host else None, before=deadline)
            if slot is None:
                c.prefetch_dropped += 1
                continue
            if in_host and self._from_host(key, slot, c):
                c.host_prefetches += 1           # served from host RAM at once, no disk read
            else:
                self._enqueue(key, slot, deadline, prefetch=True)
            self.prefetched[key] = (deadline, c)
            self.policy.touch(key, now)
            c.prefetch_issued += 1


    # ---- I/O threads --------------------------------------------------------------------------
    def _serve_one(self, staging: torch.Tensor | None, stream) -> None:
        """One wake-up of an I/O worker: the most urgent queued request, if any."""
        try:
            _, _, req = heapq.heappop(self._heap)
        except IndexError:
            return
        if req.state != "queued":                # stale duplicate of a promoted request
            return
        if req.cancelled:                        # the forward no longer wants it: skip the read
            req.state = "skipped"
            req.event.set()
            return
        req.state = "reading"
        try:
            layer, expert = req.key
            buf = staging if staging is not None else self.pool[req.slot]
            t0 = time.perf_counter()
            n = self.store.read_into(layer, expert, buf)
            dt = time.perf_counter() - t0
            self.read_s_ema = dt if self.read_s_ema == 0 else 0.9 * self.read_s_ema + 0.1 * dt
            if self.verify == "always" or (self.verify == "first" and req.key not in self.verified):
                self.store.verify(layer, expert, buf)
                self.verified.add(req.key)
            if staging is not None:
                # Copy on a side stream and wait for it here, so the event means "on device".
                with torch.cuda.stream(stream):
                    self.pool[req.slot].copy_(staging, non_blocking=True)
                stream.synchronize()
            self.counters.bytes_read += n
            self.counters.reads += 1
            req.state = "done"
        except (OSError, StoreError) as e:
            req.error, req.state = e, "failed"
        except BaseException as e:  # never leave the forward waiting forever
            req.error, req.state = e, "failed"
        req.event.set()

    def close(self) -> None:
        self._closed = True
        self._stop()   # wakes every worker to exit (at most once, here or when collected)
        for t in self._threads:
            t.join(timeout=5)


def _io_worker(ref: "weakref.ReferenceType[ExpertCache]", wake) -> None:
    """An I/O thread of `ref`'s cache. It holds the cache only while serving a wake-up (one token
    per queued read, False to stop), so a cache nobody references any more is collected."""
    cache = ref()
    if cache is None:
        return
    staging = stream = None
    if cache.device.type == "cuda":
        staging = aligned_empty(cache.slot_bytes, pin=True)
        stream = torch.cuda.Stream(cache.device)
    del cache
    while True:
        token = wake.get()
        cache = ref()
        if cache is None or cache._closed or token is False:
            return
        cache._serve_one(staging, stream)
        del cache


def _wake_all(wake, n: int) -> None:
    for _ in range(n):
        wake.put(False)
