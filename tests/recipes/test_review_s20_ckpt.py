"""Checkpoint/storage review (2026-12-01, second): a read-only output_dir was a Hydra traceback, and
the NVMe free-space checks counted the plan's exact bytes while every NVMe file is padded to the
4 KiB O_DIRECT block (a drive that fit the bytes but not the padding failed mid-set-up)."""

import pytest
import torch

from lazytrain.cli import train as cli
from lazytrain.recipes.train import plan_nvme_bytes
from lazytrain.runtime import StreamingExecutor
from lazytrain.runtime import executor as E
from lazytrain.runtime.testing import hand_plan, tiny_model


def test_an_unwritable_output_dir_is_one_line_before_anything_runs(base_overrides, capsys):
    # /proc/self takes no new files, for root too (a read-only mount behaves the same)
    rc = cli.main([*base_overrides, "output_dir=/proc/self/lazytrain_run", "job.max_steps=1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "output_dir /proc/self/lazytrain_run: cannot write in /proc/self" in err and "Traceback" not in err


@pytest.mark.parametrize("params", ["nvme", "host"])
def test_the_executors_nvme_need_covers_its_padded_files(tmp_path, monkeypatch, params):
    seen = []
    real = E.check_nvme_dir

    def spy(root, need):
        seen.append(need)
        return real(root, need)
    monkeypatch.setattr(E, "check_nvme_dir", spy)
    plan = hand_plan(3, param_tier=params, grad_tier="nvme", optimizer_tier="nvme")
    ex = StreamingExecutor(tiny_model("llama"), plan, device="cpu", nvme_dir=tmp_path)
    try:
        files = sum(ex.nvme.sizes.values())
        assert seen and seen[0] >= files, (seen, files)
    finally:
        ex.close()


def test_preflights_nvme_figure_covers_the_files_the_planned_run_makes(base_overrides, tmp_path, monkeypatch):
    """A planned job with parameters, gradients and optimizer state on NVMe: the files its executor
    makes (each padded to 4 KiB) fit in what preflight checks the drive for."""
    from lazytrain.cli.config import load_config
    from lazytrain.recipes.train import build_engine, build_model, preflight

    cfg = load_config([*base_overrides, "engine=lazytrain", "hardware.device_memory_gib=0.002",
                       "hardware.workspace_gib=0.0001", "hardware.host_memory_gib=0.0046",
                       "hardware.host_reserve_gib=0", f"output_dir={tmp_path / 'run'}"], "train")
    pre = preflight(cfg)
    assert any(d.optimizer_tier == "nvme" for d in pre.plan.layers), pre.plan.layers
    model = build_model(pre.model, None, pre.job, 0)
    (tmp_path / "nvme").mkdir()
    eng = build_engine(cfg, model, pre, tmp_path / "run", tmp_path / "nvme")
    try:
        ex = getattr(eng, "ex", None) or getattr(eng, "executor", None)
        files = sum(ex.nvme.sizes.values())
        assert files > pre.plan.predicted.peak_bytes["nvme"]    # the padding the plan does not count
        assert plan_nvme_bytes(pre.plan) >= files, (plan_nvme_bytes(pre.plan), files)
    finally:
        eng.close()
