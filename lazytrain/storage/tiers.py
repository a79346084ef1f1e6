"""Tier stores behind one interface: a store holds named flat byte regions on host RAM or in files.

`HostStore` keeps one (pinned, when CUDA is the device) aligned buffer per key. `NvmeStore` keeps
one file per key in `nvme_dir`, read and written with O_DIRECT where the filesystem allows (see
aligned_io.DirectFile) on an IOPool so transfers overlap compute. Buffers handed to an NVMe store
must come from `aligned_empty` and have `round_up`-ed lengths.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

from .aligned_io import DirectFile, IOPool, aligned_empty, round_up
from .filemode import cannot_write_in

log = logging.getLogger(__name__)


class FlatStore(Protocol):
    tier: str

    def allocate(self, key: str, nbytes: int) -> None: ...
    def read_into(self, key: str, buf: torch.Tensor) -> Future: ...
    def write_from(self, key: str, buf: torch.Tensor) -> Future: ...
    def close(self) -> None: ...


class _Done(Future):
    def __init__(self, value: object = None) -> None:
        super().__init__()
        self.set_result(value)


class HostStore:
    """Flat buffers in host RAM (pinned for fast, asynchronous copies when `pin`)."""
    tier = "host"

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self.bufs: dict[str, torch.Tensor] = {}

    def allocate(self, key: str, nbytes: int) -> torch.Tensor:
        # (kept for the run: huge pages where the system gives them, aligned_io.huge_empty)
        buf = aligned_empty(round_up(max(nbytes, 1)), pin=self.pin, huge=True)
        self.bufs[key] = buf
        return buf

    def get(self, key: str) -> torch.Tensor:
        return self.bufs[key]

    def read_into(self, key: str, buf: torch.Tensor) -> Future:
        src = self.bufs[key]
        n = min(src.numel(), buf.numel())
        buf[:n].copy_(src[:n])
        return _Done(n)

    def write_from(self, key: str, buf: torch.Tensor) -> Future:
        dst = self.bufs[key]
        n = min(dst.numel(), buf.numel())
        dst[:n].copy_(buf[:n])
        return _Done(n)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs.values())

    def close(self) -> None:
        self.bufs.clear()


class NvmeStore:
    """Flat regions in files under `root` (one file per key); async aligned I/O on `pool`."""
    tier = "nvme"

    def __init__(self, root: str | os.PathLike, pool: IOPool, direct: bool = True) -> None:
        self.root = Path(root)
        self.pool = pool
        self.direct = direct
        self.files: dict[str, DirectFile] = {}
        self.sizes: dict[str, int] = {}

    def allocate(self, key: str, nbytes: int) -> None:
        size = round_up(max(nbytes, 1))
        path = self.root / (key.replace("/", "_") + ".bin")
        self.files[key] = DirectFile(path, "w", direct=self.direct, size_bytes=size)
        self.sizes[key] = size

    def read_into(self, key: str, buf: torch.Tensor, pool: IOPool | None = None) -> Future:
        return (pool or self.pool).read(self.files[key], buf[:self.sizes[key]], 0)

    def write_from(self, key: str, buf: torch.Tensor, pool: IOPool | None = None) -> Future:
        return (pool or self.pool).write(self.files[key], buf[:self.sizes[key]], 0)

    def read_sync(self, key: str, buf: torch.Tensor) -> None:
        self.files[key].read_into(buf[:self.sizes[key]], 0)

    def write_sync(self, key: str, buf: torch.Tensor) -> None:
        self.files[key].write_from(buf[:self.sizes[key]], 0)

    @property
    def direct_io(self) -> bool:
        return all(f.direct for f in self.files.values())

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
_WARNED_MEMORY_FS: set[tuple[str, str]] = set()


def memory_backed(path: str | os.PathLike) -> str | None:
    """The filesystem type when `path` lies on one held in RAM (tmpfs, ramfs; /dev/shm, and /tmp
    on some distributions), else None (also where /proc/self/mounts cannot be read)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, fstype = "", None
    for line in mounts:
        f = line.split()
        if len(f) < 3:
            continue
        mnt = f[1].replace("\\040", " ")
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, fstype = mnt, f[2]
    return fstype if fstype in MEMORY_FILESYSTEMS else None


def _size(n: int) -> str:
    """Bytes in GiB to 0.01, or in MiB below 1 GiB ("0.00 GiB" says nothing)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def warn_if_memory_backed(nvme_dir: Path, need_bytes: int) -> None:
    """Warn (once per directory) when the NVMe tier's directory is held in RAM and the plan puts
    bytes there: they take host memory the plan does not count (a host peak planned to fit may
    not), and the plan's NVMe rates do not apply."""
    fs = memory_backed(nvme_dir) if need_bytes > 0 else None
    key = (os.path.realpath(nvme_dir), fs or "")
    if fs and key not in _WARNED_MEMORY_FS:   # (train's preflight checks it, then the executor)
        _WARNED_MEMORY_FS.add(key)
        log.warning("storage.nvme_dir %s is on %s (RAM): the %s the plan puts on NVMe will take "
                    "host memory on top of the plan's host peak, at memory speed, not the NVMe rates "
                    "planned; point storage.nvme_dir at a directory on an SSD", nvme_dir, fs, _size(need_bytes))


def check_nvme_dir(nvme_dir: str | os.PathLike | None, need_bytes: int) -> Path:
    """The directory for NVMe-tier files, checked before training: exists, writable, big enough
    (and warn_if_memory_backed)."""
    if nvme_dir is None:
        raise ValueError("the plan puts data on the nvme tier but no nvme_dir was given "
                         "(set storage.nvme_dir=DIR)")
    p = Path(nvme_dir)
    if not p.is_dir():
        raise ValueError(f"storage.nvme_dir {p} does not exist (create it or point to a local SSD)")
    why = cannot_write_in(p)
    if why:
        raise ValueError(f"storage.nvme_dir {p} is not writable ({why})")
    free = shutil.disk_usage(p).free
    if free < need_bytes:
        raise ValueError(f"storage.nvme_dir {p} has {_size(free)} free but the plan needs "
                         f"{_size(need_bytes)} there")
    warn_if_memory_backed(p, need_bytes)
    return p


SCRATCH_PREFIX = "lazytrain-"
_SCRATCH_LOCK = ".owner.lock"


class ScratchDir:
    """A process's own subdirectory of nvme_dir for NVMe-tier files (`<nvme_dir>/lazytrain-<pid>-<n>`).

    It holds an exclusive flock on its lock file for as long as it lives; the kernel drops the lock
    when the process dies, however it dies. A killed run never removes its directory, so a new run
    first removes every such directory whose lock it can take (`sweep_stale_scratch`: their
    owners are gone), so that repeated kill-and-resume cycles do not fill the drive. The directory
    is made and locked under a name the sweep ignores, then renamed into place: a sweep by another
    process can never see it unlocked. On a filesystem without flock it works unlocked (warned),
    and sweeps there remove nothing.
    """

    def __init__(self, nvme_dir: Path) -> None:
        pid = os.getpid()
        tmp = Path(tempfile.mkdtemp(prefix=f".{SCRATCH_PREFIX}{pid}-", dir=nvme_dir))
        self._fd: int | None = os.open(tmp / _SCRATCH_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            log.warning("cannot lock NVMe scratch dir %s (%s): a killed run's files there will not "
                        "be cleaned up automatically", tmp, e.strerror or e)
        self.path = Path(nvme_dir) / f"{SCRATCH_PREFIX}{pid}-{tmp.name.rsplit('-', 1)[-1]}"
        os.rename(tmp, self.path)

    def close(self) -> None:
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)   # (the lock goes with it)
        self._fd = None


def remove_dead_scratch(nvme_dir: Path) -> None:
    """`sweep_stale_scratch`, warning about each dir removed; nothing if `nvme_dir` is no dir.
    Called before free space is judged: a killed run's files are what fills the drive."""
    if Path(nvme_dir).is_dir():
        for d in sweep_stale_scratch(Path(nvme_dir)):
            warnings.warn(f"removed {d}: NVMe scratch files of a run that ended without cleaning up "
                          f"(killed)", stacklevel=3)


def sweep_stale_scratch(nvme_dir: Path) -> list[Path]:
    """Remove the scratch directories of processes that are gone (see ScratchDir); the removed.
    This process's own are never touched: where flock is emulated with per-process POSIX locks
    (NFS), its own live lock would not stop it."""
    removed = []
    try:
        entries = list(Path(nvme_dir).glob(f"{SCRATCH_PREFIX}*"))
    except OSError:
        return removed
    mine = f"{SCRATCH_PREFIX}{os.getpid()}-"
    for d in entries:
        if d.name.startswith(mine):
            continue
        lock = d / _SCRATCH_LOCK
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:   # no lock file: not ours to judge (or not a scratch dir at all)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # held (its process is alive), or no flock here: left alone
            os.close(fd)
            continue
        try:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        finally:
            os.close(fd)
    return removed


def staging_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An aligned host buffer usable for O_DIRECT transfers of `nbytes` (rounded up)."""
    return aligned_empty(round_up(max(nbytes, 1)), pin=pin)


class StagingSets:
    """A bounded pool of host staging buffers for NVMe-tier optimizer state, in sets of `width`.

    One set holds one layer's master and moments while they are read ahead, updated and written
    back. `count` sets bound the host bytes (the planner counts `count` x the largest layer's
    optimizer bytes); `acquire` blocks until a set is free, i.e. until an earlier layer's write-back
    finished: back-pressure instead of unbounded staging. Buffers are allocated once, at the
    largest size asked for, and reused (fresh allocations page-fault at a fraction of copy speed).
    """

    def __init__(self, count: int, width: int = 3) -> None:
        if count < 1:
            raise ValueError(f"StagingSets: count must be >= 1, got {count}")
        self.count, self.width = count, width
        self._free: list[list[torch.Tensor]] = []
        self._made = 0
        self._cv = threading.Condition()

    def acquire(self, nbytes: int) -> list[torch.Tensor]:
        with self._cv:
            while True:
                for k, bufs in enumerate(self._free):
                    if bufs[0].numel() >= nbytes:
                        return self._free.pop(k)
                if self._made < self.count:
                    self._made += 1
                    break
                if self._free:   # a free set that is too small: replace it by a larger one
                    self._free.pop()
                    break
                self._cv.wait()
        return [staging_buffer(nbytes) for _ in range(self.width)]

    def release(self, bufs: list[torch.Tensor]) -> None:
        with self._cv:
            self._free.append(bufs)
            self._cv.notify_all()
