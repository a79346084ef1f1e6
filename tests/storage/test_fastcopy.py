"""Streaming-store copies (lazytrain.storage.fastcopy) and the first-use C++ builder (lazytrain.cext)."""

from __future__ import annotations

import pytest
import torch

from lazytrain.cext import Extension
from lazytrain.storage import fastcopy
from lazytrain.storage.aligned_io import aligned_empty


def _ext_or_skip():
    if not fastcopy.available():
        pytest.skip(f"streaming-copy kernel unavailable: {fastcopy._EXT.unavailable_reason()}")


@pytest.mark.parametrize("nbytes", [1 << 20, (1 << 20) + 1, (3 << 20) + 255, 5_000_011])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 7), (63, 65)])
def test_stream_copy_equals_the_source_and_touches_nothing_else(nbytes, dst_off, src_off, monkeypatch):
    """Unaligned heads, 256-byte streaming steps and odd tails over several 1 MiB pieces: the
    destination equals the source byte for byte, and the bytes around it are untouched."""
    _ext_or_skip()
    monkeypatch.setattr(fastcopy, "MIN_BYTES", 0)
    g = torch.Generator().manual_seed(nbytes + dst_off)
    src = torch.randint(0, 256, (nbytes + 128,), dtype=torch.uint8, generator=g)
    dst = torch.full((nbytes + 128,), 0xA5, dtype=torch.uint8)
    fastcopy.copy_into(dst[dst_off:dst_off + nbytes], src[src_off:src_off + nbytes])
    assert torch.equal(dst[dst_off:dst_off + nbytes], src[src_off:src_off + nbytes])
    assert dst[:dst_off].eq(0xA5).all() and dst[dst_off + nbytes:].eq(0xA5).all()


def test_typed_views_of_aligned_buffers_copy_as_bytes(monkeypatch):
    """How the streamer calls it: bf16 views of 4 KiB-aligned byte buffers."""
    _ext_or_skip()
    monkeypatch.setattr(fastcopy, "MIN_BYTES", 0)
    n = 700_001
    src = aligned_empty(2 * n + 2).view(torch.bfloat16)[:n]
    src.copy_(torch.randn(n).bfloat16())
    dst = aligned_empty(2 * n + 2).view(torch.bfloat16)[:n]
    fastcopy.copy_into(dst, src)
    assert torch.equal(dst, src)


def test_what_the_kernel_does_not_take_falls_back_to_copy_():
    """A dtype cast, a non-contiguous source and a small copy go through Tensor.copy_ (same values)."""
    src = torch.randn(600_000)
    dst = torch.empty(600_000, dtype=torch.bfloat16)
    fastcopy.copy_into(dst, src)
    assert torch.equal(dst, src.bfloat16())
    m = torch.randn(1024, 600)
    out = torch.empty(600, 1024)
    fastcopy.copy_into(out, m.t())
    assert torch.equal(out, m.t())
    small_src, small_dst = torch.arange(100.0), torch.zeros(100)
    fastcopy.copy_into(small_dst, small_src)
    assert torch.equal(small_dst, small_src)


def test_only_large_same_dtype_contiguous_cpu_copies_take_the_kernel(monkeypatch):
    """The dispatch: at and above MIN_BYTES the kernel runs; below it, for a cast or for a
    non-contiguous source, copy_ does (and no build is triggered)."""
    calls = []

    class _Ext:
        def load(self):
            class _Mod:
                @staticmethod
                def stream_copy(dst, src):
                    calls.append(dst.numel())
                    dst.copy_(src)
            return _Mod

    monkeypatch.setattr(fastcopy, "_EXT", _Ext())
    n = fastcopy.MIN_BYTES // 4
    fastcopy.copy_into(torch.empty(n), torch.randn(n))
    assert calls == [fastcopy.MIN_BYTES]
    fastcopy.copy_into(torch.empty(n - 1), torch.randn(n - 1))
    fastcopy.copy_into(torch.empty(n, dtype=torch.bfloat16), torch.randn(n))
    fastcopy.copy_into(torch.empty(2, n // 2), torch.randn(n // 2, 2).t())
    same = torch.randn(n)
    fastcopy.copy_into(same, same)                          # onto itself: copy_ does nothing
    z = torch.randn(n // 2, dtype=torch.complex64)
    out = torch.empty_like(z)
    fastcopy.copy_into(out, z.conj())                       # a lazy conjugate: copy_ resolves it
    assert torch.equal(out, z.conj().resolve_conj())
    leaf = torch.zeros(n, requires_grad=True)
    with pytest.raises(RuntimeError):                       # copy_ refuses an in-place write to a leaf
        fastcopy.copy_into(leaf, torch.randn(n))
    a = torch.empty(n)
    fastcopy.copy_into(a, leaf * 1)                         # autograd records the copy
    assert a.requires_grad
    assert calls == [fastcopy.MIN_BYTES]


def test_the_kernel_rejects_overlap_and_size_mismatch():
    _ext_or_skip()
    mod = fastcopy._EXT.load()
    buf = torch.zeros(4 << 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="overlap"):
        mod.stream_copy(buf[1 << 20:3 << 20], buf[:2 << 20])
    with pytest.raises(RuntimeError, match="sizes differ"):
        mod.stream_copy(buf[:2 << 20], buf[2 << 20:(4 << 20) - 1])


def test_extension_disabled_by_env_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("LAZYTRAIN_NO_CPP", "1")
    ext = Extension("lazytrain_never_built", tmp_path / "missing.cpp", "test kernel", "the fallback")
    assert ext.load() is None
    assert "LAZYTRAIN_NO_CPP" in ext.unavailable_reason()


def test_extension_without_compiler_says_why(monkeypatch, tmp_path):
    monkeypatch.delenv("LAZYTRAIN_NO_CPP", raising=False)
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    ext = Extension("lazytrain_never_built", tmp_path / "missing.cpp", "test kernel", "the fallback")
    assert ext.load() is None
    assert "no-such-compiler-xyz" in ext.unavailable_reason() and "test kernel" in ext.unavailable_reason()


def test_build_dir_is_per_torch_and_python_version(monkeypatch, tmp_path):
    """Two environments with different torch versions must not share (and rebuild over) one build."""
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LAZYTRAIN_CPP_MARCH", raising=False)   # (=none: no CPU features in the key)
    ext = Extension("lazytrain_never_built", tmp_path / "missing.cpp", "test kernel", "the fallback")
    here = ext.build_dir()
    assert here.parent == tmp_path and here.name.startswith("lazytrain_never_built-")
    monkeypatch.setattr(torch, "__version__", "0.0.1+other")
    other_torch = ext.build_dir()
    assert other_torch != here
    monkeypatch.setattr("lazytrain.cext._cpu_features", lambda: "fpu sse2")   # another CPU
    assert ext.build_dir() != other_torch


def test_stream_copy_releases_the_gil(main_thread_stall):
    """The copy runs on the streamer's I/O threads: holding the GIL would stall the thread that
    launches the compute for the copy's whole length."""
    _ext_or_skip()
    src = torch.arange(256 << 17, dtype=torch.int64).view(torch.uint8)   # 256 MiB
    dst = torch.empty_like(src)
    mod = fastcopy._EXT.load()
    stall, secs = main_thread_stall(lambda: mod.stream_copy(dst, src))
    assert torch.equal(dst, src)
    assert stall < 0.3 * secs, f"the main thread stalled {stall * 1e3:.0f} ms of a {secs * 1e3:.0f} ms copy"


def test_a_killed_loaders_torch_lock_is_removed_not_waited_for(tmp_path):
    """torch's build lock (`<build dir>/lock`, O_EXCL, removed when done) is taken by every
    process's first load; one killed meanwhile left it, and every later load waited forever. Under
    lazytrain's flock (released by the kernel with its process) a `lock` file is a dead one's."""
    from lazytrain.cext import _build_lock

    (tmp_path / "lock").write_text("")
    with _build_lock(tmp_path) as stale:
        assert stale == tmp_path / "lock" and not stale.exists()
    with _build_lock(tmp_path) as stale:
        assert stale is None


def test_a_live_loader_is_waited_for(tmp_path, capfd):
    """While another process holds the flock (it is building or loading), its torch lock is live:
    the second waits, saying so, and finds the lock gone when it gets in."""
    import subprocess
    import sys
    import time

    from lazytrain.cext import _build_lock

    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX); open(sys.argv[2], 'w').close(); print('held', flush=True); "
            "time.sleep(1.0); os.unlink(sys.argv[2])")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / ".lazytrain-build.lock"),
                          str(tmp_path / "lock")], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    t = time.perf_counter()
    with _build_lock(tmp_path) as stale:
        waited = time.perf_counter() - t
        assert stale is None and not (tmp_path / "lock").exists()
    p.wait()
    assert waited > 0.3
    assert "waiting for another process" in capfd.readouterr().err
