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

import os
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
