"""Small files written so that a crash leaves the old content or the new, never half of either."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from .aligned_io import DiskIOError
from .filemode import replace_text


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:   # (fsync's error names no file: the caller's message then named none)
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temp file, fsync and rename (filemode.replace_text), then fsync
    the folder; a failure is a DiskIOError naming the file."""
    try:
        replace_text(path, text)
        fsync_path(path.parent)
    except OSError as e:
        raise DiskIOError(e.errno, f"write {path}: {e.strerror}") from e


def jsonl_temps(folder: Path) -> list[Path]:
    """The temp copies `keep_jsonl_rows` rewrites through (`.NAME.*.tmp`) in `folder`, left behind
    by a process killed while it ran."""
    return sorted(folder.glob(".*.jsonl.*.tmp"))


def keep_jsonl_rows(path: Path, keep: Callable[[dict[str, Any]], bool], rows: bool = True) -> list[dict[str, Any]]:
    """Rewrite JSONL `path` with the rows `keep` accepts (a resume drops those of the steps a killed
    run wrote past its checkpoint; a line cut short by the kill goes too, as does one that is not
    UTF-8, which ended a resume with a UnicodeDecodeError) and return them (`rows=False`: none).
    Streamed line by line through a temp file (fsync, rename): a long run's trace was read whole
    and parsed into a list, ~13x its size in RAM (review: 1.8 GiB for a 138 MiB trace)."""
    import tempfile

    from .filemode import new_file_mode

    out: list[dict[str, Any]] = []
    try:
        src = open(path, "rb")
    except FileNotFoundError:
        return out
    except OSError as e:
        raise DiskIOError(e.errno, f"read {path}: {e.strerror}") from e
    tmp = None
    try:
        with src:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.fchmod(fd, new_file_mode())
            with os.fdopen(fd, "wb") as dst:
                for raw in src:
                    try:
                        line = raw.rstrip(b"\r\n")
                        rec = json.loads(line.decode("utf-8"))
                        if not keep(rec):
                            continue
                    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
                        continue
                    dst.write(line + b"\n")
                    if rows:
                        out.append(rec)
                dst.flush()
                os.fsync(dst.fileno())
        os.replace(tmp, path)
        tmp = None
        fsync_path(path.parent)
    except OSError as e:
        raise DiskIOError(e.errno, f"rewrite {path}: {e.strerror}") from e
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return out
