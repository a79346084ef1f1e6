"""A real `lazytrain train` process killed with SIGKILL mid-run resumes to the uninterrupted losses."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lazytrain.cli.config import load_config
from lazytrain.recipes.train import run


@pytest.mark.slow  # two process start-ups (~10 s each) and a reference run
def test_sigkill_then_resume_matches_uninterrupted(base_overrides, tmp_path):
    ov = [*base_overrides, "engine=lazytrain", "hardware.device_memory_gib=0.002",
          "hardware.workspace_gib=0.0001", "job.max_steps=16", "save_every=1", "save_final_model=false"]
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lazytrain.cli.main", "train", *ov,
                             f"output_dir={killed}"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "step_000002":
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = [json.loads(l)["step"] for l in (killed / "metrics.jsonl").read_text().splitlines()
            if l.endswith("}")]
    assert 2 <= len(done) < 16  # killed mid-run
    rc = subprocess.run([sys.executable, "-m", "lazytrain.cli.main", "train", *ov, f"output_dir={killed}",
                         "resume=true"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr[-2000:]
    assert "resumed from" in rc.stdout
    ref = tmp_path / "ref"
    run(load_config([*ov, f"output_dir={ref}"], config_name="train"), ref, echo=lambda *_: None)
    la = [json.loads(l) for l in (ref / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(l) for l in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lb] == list(range(1, 17))
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]
