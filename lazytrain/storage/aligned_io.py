"""Aligned, optionally O_DIRECT, file I/O into torch buffers, with a thread pool for overlap.

O_DIRECT needs the buffer address, file offset and length 512-byte aligned (../shared/MACHINE.md);
a plain torch.empty is only 64-byte aligned, so `aligned_empty` over-allocates and slices.
Where the filesystem refuses O_DIRECT (tmpfs, some overlayfs), files fall back to buffered I/O and
say so in `DirectFile.direct` / `.reason`, so benchmarks can report that reads were cached.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ALIGN_BYTES = 4096


def round_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


HUGE_MIN_BYTES = 4 << 20   # below this a buffer holds at most one aligned 2 MiB page


def aligned_empty(nbytes: int, align: int = ALIGN_BYTES, pin: bool = False, huge: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose data pointer is `align`-aligned.

    `huge`: for long-lived large buffers (a layer's weights on the host tier, the streaming and
    resident buffers, an expert cache's pool): its own anonymous mapping, advised for transparent
    huge pages (`huge_empty`), where the system allows them; not for pinned memory."""
    if huge and not pin and nbytes >= HUGE_MIN_BYTES and align <= mmap.PAGESIZE:
        t = huge_empty(nbytes)
        if t is not None:
            return t
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % align
    return raw[shift:shift + nbytes]


def huge_empty(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of fresh anonymous memory (page-aligned, untouched) advised MADV_HUGEPAGE, as a
    uint8 tensor that owns the mapping (unmapped when the tensor goes); None where transparent huge
    pages cannot be asked for (not Linux, THP "never", LAZYTRAIN_HUGEPAGES=0).

    Why: on this machine (THP "madvise") a 14 MiB layer copy runs 15-25% faster between huge-page
    buffers, and matmuls reading their weights from them ~6% faster (fewer TLB misses; measured
    2026-12-02, scratch microbenchmarks). glibc's heap does not give huge pages (and with
    runtime/malloc.py's settings reuses memory already faulted in 4 KiB pages), so the buffer gets a
    mapping of its own. Only for buffers allocated once and kept: a fresh mapping faults in again."""
    if not _huge_pages_allowed():
        return None
    try:
        mm = mmap.mmap(-1, round_up(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return None
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):   # (an old kernel or Python: plain pages, still fine)
        pass
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]


@functools.cache
def _huge_pages_allowed() -> bool:
    if not hasattr(mmap, "MADV_HUGEPAGE") or os.environ.get("LAZYTRAIN_HUGEPAGES", "1") == "0":
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def is_aligned(t: torch.Tensor, align: int = ALIGN_BYTES) -> bool:
    return t.data_ptr() % align == 0


class DiskIOError(OSError):
    """An I/O failure that names the file and the operation. Errno 0 (a damaged file, not a
    failed system call) is left out of the message."""

    def __str__(self) -> str:
        if self.errno == 0 and self.strerror:
            return self.strerror
        return super().__str__()

    @staticmethod
    def reason(e: BaseException) -> tuple[int, str]:
        """(errno, why) of a failed I/O call: an OSError's, or the text of another library's error
        (safetensors reports a full disk as its own SafetensorError), with errno 0."""
        if isinstance(e, OSError) and e.strerror:
            return e.errno or 0, e.strerror
        return getattr(e, "errno", 0) or 0, str(e).strip()


class DirectFile:
    """One file opened for aligned positional reads/writes; O_DIRECT when the filesystem allows."""

    def __init__(self, path: str | os.PathLike, mode: str = "r", direct: bool = True,
                 size_bytes: int | None = None) -> None:
        self.path = Path(path)
        flags = {"r": os.O_RDONLY, "w": os.O_RDWR | os.O_CREAT, "rw": os.O_RDWR}[mode]
        self.direct, self.reason = False, "direct I/O not requested"
        fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
                self.direct, self.reason = True, "O_DIRECT"
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise DiskIOError(e.errno, f"open {self.path} ({mode}): {e.strerror}") from e
                self.reason = f"O_DIRECT refused by the filesystem ({e.strerror}); buffered I/O"
        if fd < 0:
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                raise DiskIOError(e.errno, f"open {self.path} ({mode}): {e.strerror}") from e
        self.fd = fd
        # closed with the object if nobody calls close() (an engine dropped without it)
        self._closer = weakref.finalize(self, os.close, fd)
        if size_bytes is not None and mode != "r":
            try:
                os.ftruncate(fd, size_bytes)
            except OSError as e:
                self.close()
                raise DiskIOError(e.errno, f"size {self.path} to {size_bytes} bytes: {e.strerror}") from e

    def _check(self, buf: torch.Tensor, offset: int) -> None:
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("I/O buffers must be contiguous CPU tensors")
        if self.direct and (buf.data_ptr() % 512 or offset % 512 or buf.nbytes % 512):
            raise ValueError(f"{self.path}: O_DIRECT needs 512-byte aligned address, offset and "
                             f"length (got ptr%512={buf.data_ptr() % 512}, offset={offset}, "
                             f"len={buf.nbytes}); use aligned_empty/round_up")

    def read_into(self, buf: torch.Tensor, offset: int) -> int:
        """Fill `buf` (all of it) from `offset`; returns bytes read."""
        self._check(buf, offset)
        mv = memoryview(buf.view(torch.uint8).numpy()).cast("B")
        done = 0
        try:
            while done < len(mv):
                n = os.preadv(self.fd, [mv[done:]], offset + done)
                if n == 0:
                    raise DiskIOError(errno.EIO, f"read {self.path}: unexpected end of file at "
                                                 f"offset {offset + done} (file truncated?)")
                done += n
        except OSError as e:
            if isinstance(e, DiskIOError):
                raise
            raise DiskIOError(e.errno, f"read {self.path} @ {offset}+{len(mv)}: {e.strerror}") from e
        return done

    def write_from(self, buf: torch.Tensor, offset: int) -> int:
        self._check(buf, offset)
        mv = memoryview(buf.view(torch.uint8).numpy()).cast("B")
        done = 0
        try:
            while done < len(mv):
                done += os.pwritev(self.fd, [mv[done:]], offset + done)
        except OSError as e:
            raise DiskIOError(e.errno, f"write {self.path} @ {offset}+{len(mv)}: {e.strerror}") from e
        return done

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            self.fd = -1
            self._closer()   # os.close, once

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class IOPool:
    """A small thread pool for asynchronous reads/writes (os.preadv releases the GIL)."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lazytrain-io")

    def read(self, f: DirectFile, buf: torch.Tensor, offset: int) -> Future:
        return self._pool.submit(f.read_into, buf, offset)

    def write(self, f: DirectFile, buf: torch.Tensor, offset: int) -> Future:
        return self._pool.submit(f.write_from, buf, offset)

    def submit(self, fn, *args, **kwargs) -> Future:
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class InlinePool:
    """A ThreadPoolExecutor stand-in that runs each job at submit time (same order, same thread);
    a job's exception is held in its future, as from a worker thread."""

    def submit(self, fn, *args, **kwargs) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # surfaced by .result()
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


def drop_page_cache(path: str | os.PathLike | None = None) -> bool:
    """Best effort: evict cached pages (of one file via fadvise, or all as root). True if done."""
    if path is not None:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            return True
        except OSError:
            return False
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False
