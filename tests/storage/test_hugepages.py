"""Long-lived large host buffers get their own mapping advised for transparent huge pages."""

import pytest
import torch

from lazytrain.storage import aligned_io
from lazytrain.storage.aligned_io import ALIGN_BYTES, HUGE_MIN_BYTES, aligned_empty


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping holding `t` (/proc/self/smaps)."""
    ptr = t.data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_a_huge_buffer_is_aligned_writable_and_backed_by_huge_pages():
    if not aligned_io._huge_pages_allowed():
        pytest.skip("transparent huge pages are off here (or LAZYTRAIN_HUGEPAGES=0)")
    n = 3 * HUGE_MIN_BYTES + 123
    t = aligned_empty(n, huge=True)
    assert t.numel() == n and t.data_ptr() % ALIGN_BYTES == 0 and t.dtype == torch.uint8
    t.fill_(7)
    assert int(t[-1]) == 7 and int(t.sum()) == 7 * n
    assert _huge_kib(t) >= 2048, "no huge page backs the buffer"
    small = aligned_empty(HUGE_MIN_BYTES - 1, huge=True)   # below the threshold: the plain allocator
    small.fill_(1)
    assert _huge_kib(small) == 0 or small.untyped_storage().nbytes() > HUGE_MIN_BYTES


def test_huge_pages_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(aligned_io, "_huge_pages_allowed", lambda: False)
    t = aligned_empty(2 * HUGE_MIN_BYTES, huge=True)
    assert t.data_ptr() % ALIGN_BYTES == 0 and t.numel() == 2 * HUGE_MIN_BYTES
    assert aligned_io.huge_empty(HUGE_MIN_BYTES) is None
    # pinned memory never goes through it
    assert aligned_empty(16, pin=False, huge=True).numel() == 16
