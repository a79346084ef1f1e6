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
