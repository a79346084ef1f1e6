import pytest
import torch

from lazytrain.storage.aligned_io import (DirectFile, DiskIOError, aligned_empty, is_aligned,
                                          round_up)


def test_aligned_empty_is_aligned():
    for n in (1, 513, 4096, 10_000):
        t = aligned_empty(n)
        assert t.numel() == n and is_aligned(t)


def test_roundtrip(tmp_path):
    n = round_up(10_000)
    src = aligned_empty(n)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    with DirectFile(tmp_path / "f.bin", "w", size_bytes=2 * n) as f:
        f.write_from(src, n)
        f.fsync()
    dst = aligned_empty(n)
    with DirectFile(tmp_path / "f.bin", "r") as f:
        assert f.read_into(dst, n) == n
    assert torch.equal(src, dst)


def test_unaligned_direct_is_refused(tmp_path):
    f = DirectFile(tmp_path / "g.bin", "w", size_bytes=8192)
    if not f.direct:
        pytest.skip(f.reason)
    with pytest.raises(ValueError, match="aligned"):
        f.read_into(aligned_empty(4096), 100)


def test_short_file_names_file(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(b"x" * 4096)
    with DirectFile(p, "r") as f, pytest.raises(DiskIOError, match="short.bin"):
        f.read_into(aligned_empty(8192), 0)
