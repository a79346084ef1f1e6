"""storage.nvme_dir on a filesystem held in RAM (tmpfs, ramfs) is warned about: what the plan puts
there takes host memory the plan does not count, at other rates than the NVMe's it assumed."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest

from lazytrain.storage import tiers
from lazytrain.storage.tiers import check_nvme_dir, memory_backed

SHM = Path("/dev/shm")


def _tmpfs_dir():
    if not SHM.is_dir() or memory_backed(SHM) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    return Path(tempfile.mkdtemp(dir=SHM))


def test_memory_backed_tells_tmpfs_from_a_disk(tmp_path):
    d = _tmpfs_dir()
    try:
        assert memory_backed(d) == "tmpfs"
        assert memory_backed(d / "not-yet-made") == "tmpfs"   # judged by its mount
    finally:
        d.rmdir()
    if memory_backed(tmp_path) is None:   # (pytest's tmp dir may itself be on tmpfs)
        assert memory_backed(tmp_path / "x") is None


def test_nvme_dir_in_ram_is_warned_once(caplog, monkeypatch):
    monkeypatch.setattr(tiers, "_WARNED_MEMORY_FS", set())
    d = _tmpfs_dir()
    try:
        with caplog.at_level(logging.WARNING, logger="lazytrain.storage.tiers"):
            assert check_nvme_dir(d, 0) == d   # nothing planned there: nothing to say
            assert not caplog.records
            check_nvme_dir(d, 3 << 29)
            check_nvme_dir(d, 3 << 29)   # (train's preflight, then the executor: said once)
        msgs = [r.getMessage() for r in caplog.records]
        assert len(msgs) == 1
        assert "tmpfs" in msgs[0] and "1.50 GiB" in msgs[0] and "SSD" in msgs[0]
    finally:
        d.rmdir()


def test_nvme_dir_on_a_disk_is_not_warned(tmp_path, caplog, monkeypatch):
    if memory_backed(tmp_path):
        pytest.skip("pytest's tmp dir is on tmpfs here")
    monkeypatch.setattr(tiers, "_WARNED_MEMORY_FS", set())
    with caplog.at_level(logging.WARNING, logger="lazytrain.storage.tiers"):
        check_nvme_dir(tmp_path, 1 << 20)
    assert not caplog.records


def test_small_amounts_are_said_in_mib(caplog, monkeypatch):
    monkeypatch.setattr(tiers, "_WARNED_MEMORY_FS", set())
    d = _tmpfs_dir()
    try:
        with caplog.at_level(logging.WARNING, logger="lazytrain.storage.tiers"):
            tiers.warn_if_memory_backed(d, 3 << 20)
        assert "the 3.0 MiB the plan puts on NVMe" in caplog.records[0].getMessage()
    finally:
        d.rmdir()
