"""Files written the way ``open()`` creates them: mode ``0o666`` minus the process umask.

safetensors >= 0.8 writes through a temp file created 0600 and renames it into place, whatever the
umask (upstream safetensors#782; a fix is pending there), and ``tempfile.mkstemp`` creates 0600
too. Left so, checkpoints, saved models and adapters, MoE expert stores and cached plans would be
readable by their writer alone: another user serving a fine-tuned adapter, a container running
under another uid or a team's shared ``solver_cache/`` gets "permission denied" or "not found".
Every writer of such files calls :func:`share_like_umask` on what it wrote, before it is renamed
into place.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from pathlib import Path

_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where Linux reports it (``os.umask`` can only
    set it: reading it that way briefly changes it for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file here."""
    return 0o666 & ~current_umask()


def share_like_umask(path: str | os.PathLike) -> None:
    """Give `path` (a file, or every file under a directory) the mode :func:`new_file_mode` says.
    Directories are left alone: ``mkdir`` already honours the umask."""
    mode = new_file_mode()
    p = Path(path)
    if not p.is_dir():
        os.chmod(p, mode)
        return
    for dirpath, _, names in os.walk(p):
        for name in names:
            f = Path(dirpath) / name
            if not f.is_symlink():
                os.chmod(f, mode)


def replace_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temp file in its folder (created with `new_file_mode`, not
    mkstemp's 0600), fsynced and renamed into place: a crash leaves the old file or the new one.
    The temp file is removed if anything fails. (No torch here: the planner writes with it.)"""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def cannot_write_in(folder: str | os.PathLike) -> str | None:
    """Why no file can be created in `folder`, or None: a temporary file is made and removed, since
    permission bits do not say it all (root may "write" /proc; a read-only mount)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def file_in_the_way(path: str | os.PathLike) -> Path | None:
    """The nearest existing one of `path` and its parents when it is not a directory (a dir
    cannot be made there), else None."""
    path = Path(path)
    above = next((a for a in (path, *path.absolute().parents) if a.exists()), None)
    return above if above is not None and not above.is_dir() else None


def hold_flock(path: str | os.PathLike, wait: bool = False) -> int | None:
    """An fd holding an exclusive flock on `path` (created if missing): closing it releases the
    lock, as the kernel does when the process dies, however it dies. If another process holds it,
    BlockingIOError (or, with `wait`, block until it is free). None where the filesystem has no
    flock (the caller goes on unlocked)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:
        os.close(fd)
        return None
    return fd
