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


def keep_jsonl_rows(path: Path, keep: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """Rewrite JSONL `path` with the rows `keep` accepts (a resume drops those of the steps a killed
    run wrote past its checkpoint; a line cut short by the kill goes too, as does one that is not
    UTF-8, which ended a resume with a UnicodeDecodeError) and return them."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise DiskIOError(e.errno, f"read {path}: {e.strerror}") from e
    kept, rows = [], []
    for raw in lines:
        try:
            ln = raw.decode("utf-8")
            rec = json.loads(ln)
            if keep(rec):
                kept.append(ln)
                rows.append(rec)
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            pass
    atomic_write_text(path, "".join(ln + "\n" for ln in kept))
    return rows
