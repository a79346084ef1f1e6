"""Kill/corrupt/resume review (2026-12-01): lines that are not UTF-8 in metrics/trace files, an
NVMe-too-small message that said "0.0 GiB" twice, a resume that only wrote the final model leaving
a summary without losses, and two runs on one output_dir at once."""

import json
import subprocess
import sys

import pytest

from lazytrain.cli import train as cli
from lazytrain.plan.tracecmp import _read_jsonl
from lazytrain.recipes import train as T
from lazytrain.storage.atomic import keep_jsonl_rows


def _main(args, capsys):
    rc = cli.main(list(args))
    return rc, capsys.readouterr()


def test_a_line_that_is_not_utf8_is_dropped_on_resume_not_a_traceback(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe x\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    rows = keep_jsonl_rows(p, lambda r: r["step"] <= 2)
    assert [r["step"] for r in rows] == [1, 2]
    assert [json.loads(line)["step"] for line in p.read_text().splitlines()] == [1, 2]


def test_keeping_trace_rows_streams_the_file(tmp_path):
    """rows=False (the trace at a resume): the same rewrite, nothing returned, and memory that does
    not grow with the file (it was read whole and parsed into a list, ~13x its size: review)."""
    import tracemalloc

    p = tmp_path / "trace.jsonl"
    line = json.dumps({"op": "h2d", "name": "block.3", "bytes": 123456, "tier": "host", "start_s": 1.0})
    with open(p, "w") as f:
        for step in range(4000):
            for _ in range(10):
                f.write(line[:-1] + f', "step": {step}}}\n')
    size = p.stat().st_size
    tracemalloc.start()
    try:
        assert keep_jsonl_rows(p, lambda r: r["step"] < 3000, rows=False) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 20, (peak, size)
    steps = [json.loads(x)["step"] for x in p.read_text().splitlines()]
    assert len(steps) == 30000 and max(steps) == 2999
    assert not list(tmp_path.glob(".trace.jsonl.*"))


def test_plan_trace_names_a_line_that_is_not_utf8(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_bytes(b'{"step": 0}\n\xff\xfe\n{"step": 1}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:2: not JSON \(not UTF-8\); the file is damaged"):
        _read_jsonl(p, [])
    p.write_bytes(b'{"step": 0}\n{"step": 1}\n\xff\xfe')   # a cut-off last line: a note
    notes = []
    assert _read_jsonl(p, notes) == [{"step": 0}, {"step": 1}] and "cut off" in notes[0]


def test_nvme_dir_too_small_says_how_much_in_mib(tmp_path, monkeypatch):
    class Usage:
        free = 30 << 20
    monkeypatch.setattr(T.shutil, "disk_usage", lambda p: Usage())
    with pytest.raises(T.StorageError, match=r"has 30\.0 MiB free; the plan puts 48\.2 MiB on NVMe"):
        T.check_nvme_dir(tmp_path, 50_555_904, create=False)


def test_a_resume_that_only_writes_the_final_model_keeps_the_runs_losses(base_overrides, tmp_path, capsys):
    """Killed between the final model and summary.json: the resume wrote final/ and a summary
    with no losses, though metrics.jsonl held every step's."""
    out = tmp_path / "run"
    args = [*base_overrides, "job.max_steps=3", f"output_dir={out}"]
    rc, io = _main(args, capsys)
    assert rc == 0, io.err
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = json.loads((out / "summary.json").read_text())
    import shutil
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()
    rc, io = _main([*args, "resume=true"], capsys)
    assert rc == 0, io.err
    s = json.loads((out / "summary.json").read_text())
    assert (out / "final").is_dir() and s["steps"] == 0
    assert s["first_loss"] == losses[0] == want["first_loss"] and s["last_loss"] == losses[-1] == want["last_loss"]
    assert s["last_loss_avg"] == want["last_loss_avg"] and s["loss_from_step"] == 1


def test_a_second_run_on_a_busy_output_dir_is_refused(base_overrides, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(out / T.RUN_LOCK)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        rc, io = _main([*base_overrides, "job.max_steps=2", f"output_dir={out}"], capsys)
        assert rc == 2 and "is in use by another lazytrain run" in io.err, io.err
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    finally:
        p.stdin.close()
        p.wait()
    rc, io = _main([*base_overrides, "job.max_steps=2", f"output_dir={out}"], capsys)   # free again
    assert rc == 0, io.err
