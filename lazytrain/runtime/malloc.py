"""Keep freed memory in the process when the CPU is the compute device (glibc malloc settings).

By default glibc serves large allocations (above a threshold that adapts up to 32 MiB) with fresh
mmaps and returns them with munmap when freed, and trims the heap top after frees. A training
step on the CPU allocates and frees the same large tensors every layer (weight gradients, logits,
saved activations, streaming buffers), so every step page-faults them in again, at ~9 GB/s here
(../shared/MACHINE.md). Measured on the 220M-parameter benchmark model (batch 1 x 256): plain
PyTorch 5% faster per step and the streamed executor 9% faster with freed memory kept
(scripts/bench_streaming.py (a) runs both in one process, so both get it).

`keep_freed_memory()` disables mmap'd allocations and heap trimming (mallopt M_MMAP_MAX=0,
M_TRIM_THRESHOLD=1 GiB): freed memory is reused by the next allocation instead of being returned
to the kernel. The process's resident size then stays at its high-water mark, which is what a
caching allocator (jemalloc, tcmalloc, the CUDA caching allocator) does too. It is process-wide,
applied once, on glibc only, and skipped with LAZYTRAIN_KEEP_FREED_MEMORY=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

_LOG = logging.getLogger(__name__)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_lock = threading.Lock()
_state: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        _state = False
        if os.environ.get("LAZYTRAIN_KEEP_FREED_MEMORY", "1") == "0":
            return False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):   # not glibc (musl, macOS): nothing to set
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        ok = mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and mallopt(_M_MMAP_MAX, 0) == 1
        if not ok:
            _LOG.warning("lazytrain: mallopt refused the keep-freed-memory settings; allocations "
                         "will page-fault in every step")
        _state = ok
        return ok
