"""The optional host-RAM tier of the expert cache: slots between the device slots and the NVMe store.

Design: an *exclusive* victim cache. An expert evicted from a device slot is copied here; a device
miss that finds the expert here copies it back (a memcpy / host->device `copy_` instead of a disk read)
and frees its host slot (a full tier swaps: the device slot's evicted expert takes that host slot).
Why exclusive rather than inclusive: on a CPU device "device" and "host" are the same RAM, so an
inclusive tier would hold copies of experts the device slots already have and add no capacity;
exclusive, device + host slots hold that many *distinct* experts, which is what cuts NVMe reads.
On CUDA the price is one device->host copy per eviction (PCIe, far faster than the NVMe read it
saves later). NVMe reads land in the device slot (through the I/O worker's pinned staging buffer on
CUDA) and reach this tier when they are evicted.

Buffers: one block of `slots * slot_bytes`, page-aligned, pinned (`pin_memory=True`) when the device is
CUDA so host->device copies are DMA from page-locked memory; plain aligned CPU memory otherwise.
Threading: only the forward thread uses this tier (the I/O threads never touch it).
"""

from __future__ import annotations

import torch

from ..storage.aligned_io import aligned_empty
from .policies import LFU, LRU, EvictionPolicy, Key


def host_policy_for(device_policy: EvictionPolicy) -> EvictionPolicy:
    """The host tier's eviction policy, of the same kind as the device slots'. Recency/frequency
    policies get their own instance (the device policy forgets a key once it leaves the device);
    forecast and Belady rank any key from shared state, so the host tier uses the same object."""
    if isinstance(device_policy, LRU):
        return LRU()
    if isinstance(device_policy, LFU):
        return LFU(device_policy.decay_steps)
    return device_policy


class HostTier:
    """`slots` host buffers of `slot_bytes`, keyed by (moe_layer, expert), evicting by `policy`."""

    def __init__(self, slots: int, slot_bytes: int, policy: EvictionPolicy,
                 device: torch.device | str = "cpu") -> None:
        if slots < 0:
            raise ValueError(f"moe.host_cache_slots must be >= 0, got {slots}")
        self.num_slots, self.slot_bytes, self.policy = slots, slot_bytes, policy
        pin = torch.device(device).type == "cuda"
        self.pinned_memory = pin
        self.pool = aligned_empty(max(slots, 1) * slot_bytes, pin=pin, huge=True).view(max(slots, 1), slot_bytes)
        self.slot_of: dict[Key, int] = {}
        self.free = list(range(slots - 1, -1, -1))
        self.spills = 0                 # experts copied in from evicted device slots
        self.dropped = 0                # ... of which later evicted from here (back to NVMe only)
        # A full tier asked to keep `keep` (the expert about to be taken from here): `keep` moves
        # to this buffer and the spill takes its slot (see put)
        self._staging: torch.Tensor | None = None
        self._staged: Key | None = None

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of or key == self._staged

    def __len__(self) -> int:
        return len(self.slot_of)

    def put(self, key: Key, src: torch.Tensor, now: int, keep: Key | None = None) -> None:
        """Keep a copy of `src` (an evicted device slot, fully loaded) for `key`; `keep` is never
        evicted for it (the expert this eviction makes room for, about to be taken from here)."""
        if self.num_slots == 0:
            return
        slot = self.slot_of.get(key)
        if slot is None:
            if self.free:
                slot = self.free.pop()
            elif keep is not None and keep in self.slot_of:
                # A swap: `keep` leaves this tier for the device slot `src` is leaving, so the
                # spill takes `keep`'s host slot (through one staging copy) and nothing drops back
                # to NVMe-only. (Until 2026-12-02 a full tier evicted another expert for the
                # spill first: every host hit that found the tier full lost one expert to NVMe;
                # a review's 8 device + 24 host slots holding all 32 experts still read the disk.)
                if self._staging is None:   # (before anything moves: a failed allocation loses nothing)
                    self._staging = aligned_empty(self.slot_bytes, pin=self.pinned_memory)
                slot = self.slot_of.pop(keep)
                self._staging.copy_(self.pool[slot])
                self._staged = keep
                self.policy.forget(keep)
            else:
                cand = [k for k in self.slot_of if k != keep]
                if not cand:                 # (no slots at all is handled above)
                    return
                victim = self.policy.victim(cand, now)
                slot = self.slot_of.pop(victim)
                self.policy.forget(victim)
                self.dropped += 1
            self.slot_of[key] = slot
        # Blocking copy: the device slot is handed to a new read right after this returns, and the
        # I/O worker writes it on its own stream, which is not ordered after ours.
        self.pool[slot].copy_(src)
        self.policy.touch(key, now)
        self.spills += 1

    def take(self, key: Key, dst: torch.Tensor) -> bool:
        """Copy `key` into `dst` and free its host slot (exclusive tier); False if not here."""
        if key == self._staged:          # swapped out of its slot by the put that made room for it
            self._staged = None
            dst.copy_(self._staging)
            return True
        slot = self.slot_of.pop(key, None)
        if slot is None:
            return False
        # Blocking: the host slot may be refilled by the next eviction as soon as we return.
        dst.copy_(self.pool[slot])
        self.policy.forget(key)
        self.free.append(slot)
        return True
