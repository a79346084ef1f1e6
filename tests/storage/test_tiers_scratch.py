"""NVMe scratch directories: a killed run's are removed by the next run, a live one's never."""

import os
import signal
import subprocess
import sys
import textwrap

from lazytrain.storage.tiers import SCRATCH_PREFIX, ScratchDir, sweep_stale_scratch


def test_live_scratch_is_kept_and_a_dead_processes_is_swept(tmp_path):
    live = ScratchDir(tmp_path)
    (live.path / "params.bin").write_bytes(b"x" * 4096)
    # a process that made its scratch dir and was killed (SIGKILL: no cleanup of any kind)
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from pathlib import Path
        from lazytrain.storage.tiers import ScratchDir
        d = ScratchDir(Path({str(tmp_path)!r}))
        (d.path / "acts.bin").write_bytes(b"y" * 4096)
        print(d.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    dead = tmp_path / os.path.basename(r.stdout.strip())
    assert dead.is_dir() and dead.name.startswith(SCRATCH_PREFIX)
    other = tmp_path / f"{SCRATCH_PREFIX}not-a-scratch-dir"   # no lock file: not ours to judge
    other.mkdir()
    assert sweep_stale_scratch(tmp_path) == [dead]
    assert not dead.exists() and live.path.is_dir() and other.is_dir()
    again = ScratchDir(tmp_path)            # a second live one in this process: both kept
    assert sweep_stale_scratch(tmp_path) == [] and live.path.is_dir() and again.path.is_dir()
    live.close()
    again.close()
    assert not live.path.exists() and not again.path.exists()


def test_executor_removes_a_killed_runs_scratch_before_checking_space(tmp_path):
    import pytest

    from lazytrain.runtime import StreamingExecutor
    from lazytrain.runtime.testing import hand_plan, tiny_model

    dead = tmp_path / f"{SCRATCH_PREFIX}12345-abcd"   # as a SIGKILLed run leaves it: lock file, no lock
    dead.mkdir()
    (dead / ".owner.lock").touch()
    (dead / "block.0.param").write_bytes(b"z" * 8192)
    model = tiny_model("llama", dtype="float32")
    with pytest.warns(UserWarning, match=f"removed {dead}"):
        ex = StreamingExecutor(model, hand_plan(3, param_tier="nvme"), device="cpu", nvme_dir=tmp_path)
    try:
        assert not dead.exists()
        assert ex.nvme_root.parent == tmp_path and ex.nvme_root.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
    finally:
        ex.close()
    assert not ex.nvme_root.exists()


def test_a_sweep_while_a_scratch_dir_is_being_made_does_not_remove_it(tmp_path, monkeypatch):
    """Another process sweeping between the lock file's creation and its flock (ranks started
    together on one shared nvme_dir) used to take the unlocked lock and remove the brand-new dir.
    The dir is now made and locked under a dot-name the sweep ignores, then renamed into place."""
    import fcntl
    import lazytrain.storage.tiers as tiers

    swept = []

    class RacingFcntl:   # the first flock lets a sweep in another process run first
        LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

        @staticmethod
        def flock(fd, op):
            if not swept:
                code = ("import sys; sys.path.insert(0, %r); from pathlib import Path; "
                        "from lazytrain.storage.tiers import sweep_stale_scratch; "
                        "print(len(sweep_stale_scratch(Path(%r))))" % (os.getcwd(), str(tmp_path)))
                r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
                swept.append(r.stdout.strip() or r.stderr)
            return fcntl.flock(fd, op)
    monkeypatch.setattr(tiers, "fcntl", RacingFcntl)
    d = ScratchDir(tmp_path)
    assert swept == ["0"], swept
    assert d.path.is_dir() and d.path.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
    (d.path / "block.0.param").write_bytes(b"x")
    assert not list(tmp_path.glob(f".{SCRATCH_PREFIX}*"))
    d.close()


def test_train_removes_a_killed_runs_scratch_before_judging_free_space(tmp_path, monkeypatch):
    """`lazytrain train` checks the NVMe dir's free space before the executor exists: a killed
    run's scratch there must be removed first, or its resume is refused for want of the very space
    those files hold."""
    import shutil
    import warnings
    from pathlib import Path

    import lazytrain.recipes.train as T

    nvme = tmp_path / "nvme"
    dead = nvme / f"{SCRATCH_PREFIX}99999-abcd"
    dead.mkdir(parents=True)
    (dead / ".owner.lock").touch()
    (dead / "block.0.param").write_bytes(b"z" * (3 << 20))
    disk = 4 << 20
    real = shutil.disk_usage

    def small_disk(p):
        used = sum(f.stat().st_size for f in Path(nvme).rglob("*") if f.is_file())
        return type(real(p))(disk, used, disk - used)
    monkeypatch.setattr(T.shutil, "disk_usage", small_disk)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        T.check_nvme_dir(nvme, 2 << 20, create=False)   # 2 MiB needed: fits once the dead files go
    assert not dead.exists() and any(f"removed {dead}" in str(x.message) for x in w)
