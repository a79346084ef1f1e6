"""Checkpoint / resume: the per-step losses after resuming equal an uninterrupted run's."""

import json

import pytest
import torch

from lazytrain.cli.config import load_config
from lazytrain.recipes import checkpoint as ckpt
from lazytrain.recipes.train import lr_at, run


def _losses(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def _run(overrides, out, *extra):
    cfg = load_config([*overrides, f"output_dir={out}", *extra], config_name="train")
    return run(cfg, out, echo=lambda *_: None)


# lazytrain at a budget below the model's training state: the plan streams / offloads / recomputes.
SMALL_BUDGET = ["hardware.device_memory_gib=0.002", "hardware.workspace_gib=0.0001"]


@pytest.mark.parametrize("engine,mode", [("torch", "full"), ("torch", "lora"),
                                         ("lazytrain", "full"), ("lazytrain", "lora")])
def test_resume_equals_uninterrupted(base_overrides, tmp_path, engine, mode):
    ov = [*base_overrides, f"job.mode={mode}", "job.max_steps=7", "job.grad_accum=2", "save_every=0",
          f"engine={engine}", *(SMALL_BUDGET if engine == "lazytrain" else [])]
    a, b = tmp_path / "a", tmp_path / "b"
    _run(ov, a)
    _run(ov, b, "stop_at_step=3")
    assert [r["step"] for r in _losses(b)] == [1, 2, 3]
    assert ckpt.latest_checkpoint(b / "checkpoints").name == "step_000003"
    assert not (b / "final").exists()                 # stopped, not finished
    torch.manual_seed(1234)                           # resume must not depend on the caller's RNG
    s = _run(ov, b, "resume=true")
    assert s["start_step"] == 3 and s["end_step"] == 7
    la, lb = _losses(a), _losses(b)
    assert [r["step"] for r in lb] == list(range(1, 8))
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]          # exact, every step
    assert [r["data_position"] for r in la] == [r["data_position"] for r in lb]
    assert la[-1]["loss"] < la[0]["loss"]
    if engine == "lazytrain":
        plan = json.loads((a / "plan.json").read_text())
        assert any(d["param_tier"] != "device" for d in plan["layers"])  # it really streams
        # the executor's state is written one layer per shard (RAM holds one layer's state)
        last = ckpt.latest_checkpoint(b / "checkpoints")
        shards = sorted(p.name for p in last.glob("engine-*.safetensors"))
        assert not (last / "engine.safetensors").exists()
        assert len(shards) == (1 if mode == "lora" else len(plan["layers"]) + 1)


def test_corrupt_checkpoint_shard_is_detected(base_overrides, tmp_path):
    ov = [*base_overrides, "job.max_steps=2", "save_every=0", "engine=lazytrain", *SMALL_BUDGET]
    _run(ov, tmp_path / "a")
    last = ckpt.latest_checkpoint(tmp_path / "a" / "checkpoints")
    shard = sorted(last.glob("engine-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])   # truncated
    with pytest.raises(OSError, match=shard.name):
        ckpt.load_checkpoint(last)


def test_resume_without_checkpoint_starts_fresh(base_overrides, tmp_path):
    s = _run([*base_overrides, "job.max_steps=2", "resume=true"], tmp_path / "c")
    assert s["start_step"] == 0 and s["end_step"] == 2


def test_lr_schedule_warmup_then_cosine():
    lrs = [lr_at(s, 1.0, 4, 20, 0.1) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(x >= y for x, y in zip(lrs[3:], lrs[4:]))
    assert abs(lr_at(20, 1.0, 4, 20, 0.1) - 0.1) < 1e-12


def test_failed_checkpoint_write_keeps_last(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    ckpt.save_checkpoint(root, 1, {"data_position": 5}, engine_tensors={"w": torch.ones(3)})
    import lazytrain.recipes.checkpoint as C

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(C, "save_file", boom)
    with pytest.raises(OSError, match=r"write checkpoint .*step_000002.*the last checkpoint, step_000001, is intact"):
        ckpt.save_checkpoint(root, 2, {"data_position": 9}, engine_tensors={"w": torch.zeros(3)})
    # the first checkpoint failing says there is none (it said "the last checkpoint is intact": review)
    with pytest.raises(OSError, match=r"write checkpoint .*; no checkpoint was written before it"):
        ckpt.save_checkpoint(tmp_path / "ck2", 1, {"data_position": 9}, engine_tensors={"w": torch.zeros(3)})
    monkeypatch.undo()
    last = ckpt.latest_checkpoint(root)
    assert last.name == "step_000001" and not list(root.glob(".step_*"))
    state, t = ckpt.load_checkpoint(last)
    assert state["data_position"] == 5 and torch.equal(t["w"], torch.ones(3))


def test_checkpoint_restores_rng_and_prunes(tmp_path):
    import random
    root = tmp_path / "ck"
    torch.manual_seed(7)
    random.seed(7)
    for s in (1, 2, 3):
        ckpt.save_checkpoint(root, s, {"data_position": s}, engine_tensors={"w": torch.full((2,), s)},
                             keep_last=2)
    expect = (torch.rand(3), random.random())
    torch.manual_seed(0)
    random.seed(0)
    state, t = ckpt.load_checkpoint(ckpt.latest_checkpoint(root))
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000003"]


def test_resume_refuses_a_different_job(base_overrides, tmp_path):
    from lazytrain.cli.config import ConfigError
    out = tmp_path / "r"
    _run([*base_overrides, "job.max_steps=3"], out, "stop_at_step=1")
    with pytest.raises(ConfigError, match="cannot resume: the checkpoint was written with dataset="):
        _run([*base_overrides, "job.max_steps=3", "job.seq_len=16"], out, "resume=true")


def test_prune_keeps_the_new_checkpoint_and_orders_by_step_number(tmp_path):
    """The newest `keep_last` by step number are kept (names sort wrongly past step 999999), and
    never is the one just written removed, whatever older dirs lie around."""
    root = tmp_path / "ck"
    for s in (999998, 999999, 1000000):
        ckpt.save_checkpoint(root, s, {"data_position": s}, engine_tensors={"w": torch.ones(1)}, keep_last=2)
    assert [p.name for p in ckpt.step_dirs(root)] == ["step_999999", "step_1000000"]
    assert ckpt.latest_checkpoint(root).name == "step_1000000"
    other = tmp_path / "other"
    for s in (5, 6, 2):   # step 2 written after higher-numbered ones
        ckpt.save_checkpoint(other, s, {"data_position": s}, engine_tensors={"w": torch.ones(1)}, keep_last=2)
    assert ckpt.latest_checkpoint(other).name == "step_000002"
    assert (other / "step_000002" / "state.json").is_file()


@pytest.mark.parametrize("latest", [None, "step_000009\n", b"\xff\xfe", "../elsewhere\n"])
def test_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path, latest):
    """A missing, dangling or garbled `latest` does not send a resume back to step 0 while
    complete checkpoints exist: the highest-numbered dir with its state.json is used."""
    root = tmp_path / "ck"
    for s in (1, 2):
        ckpt.save_checkpoint(root, s, {"data_position": s}, engine_tensors={"w": torch.ones(1)})
    (root / ".step_000003.tmp").mkdir()           # an interrupted write: not a checkpoint
    (root / "step_000004").mkdir()                # no state.json: not complete
    ptr = root / "latest"
    if latest is None:
        ptr.unlink()
    else:
        ptr.write_bytes(latest if isinstance(latest, bytes) else latest.encode())
    assert ckpt.latest_checkpoint(root).name == "step_000002"
    assert ckpt.latest_checkpoint(tmp_path / "none") is None


@pytest.mark.parametrize("damage", ["state.json", "rng.safetensors", "engine.safetensors"])
def test_damaged_checkpoint_file_is_named_and_rng_is_untouched(tmp_path, damage):
    root = tmp_path / "ck"
    last = ckpt.save_checkpoint(root, 1, {"data_position": 1}, engine_tensors={"w": torch.ones(4)})
    f = last / damage
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])   # truncated
    torch.manual_seed(5)
    expect = torch.get_rng_state()
    with pytest.raises(OSError, match=rf"read checkpoint file .*{damage}.*damaged"):
        ckpt.load_checkpoint(last)
    assert torch.equal(torch.get_rng_state(), expect)


def test_fresh_run_refuses_a_dir_with_checkpoints(base_overrides, tmp_path):
    """Without resume=true a new run in an output_dir that holds another run's checkpoints would
    overwrite its metrics and prune its checkpoints: it is refused, and nothing there changes."""
    from lazytrain.cli.config import ConfigError
    out = tmp_path / "r"
    _run([*base_overrides, "job.max_steps=3"], out, "stop_at_step=2")
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run.*step_000002.*resume=true"):
        _run([*base_overrides, "job.max_steps=3"], out)
    assert (out / "metrics.jsonl").read_text() == before
    assert ckpt.latest_checkpoint(out / "checkpoints").name == "step_000002"


def test_resume_refuses_another_optimizer_precision(base_overrides, tmp_path):
    """The engine's state layout follows the optimizer-state precision: a run with another one is
    refused with the reason, before any state is loaded."""
    from lazytrain.cli.config import ConfigError
    ov = [*base_overrides, "job.max_steps=3", "engine=lazytrain", *SMALL_BUDGET]
    out = tmp_path / "r"
    _run(ov, out, "stop_at_step=1")
    with pytest.raises(ConfigError, match="cannot resume: the checkpoint was written with optimizer_state_bits=32"):
        _run([*ov, "job.optimizer_state_bits=8"], out, "resume=true")


def test_resume_refuses_another_model_and_names_what_differs(base_overrides, tmp_path):
    from lazytrain.cli.config import ConfigError
    out = tmp_path / "r"
    _run([*base_overrides, "job.max_steps=3"], out, "stop_at_step=1")
    with pytest.raises(ConfigError, match=r"written for another model \(intermediate_size \d+ -> 96\)"):
        _run([*base_overrides, "job.max_steps=3", "model.hf_config.intermediate_size=96"], out, "resume=true")


def test_run_log_writes_name_their_file_on_disk_errors(tmp_path):
    """metrics.jsonl and trace.jsonl failing to write (a full disk) raise DiskIOError naming the
    file, which the CLI reports as one line, not a traceback."""
    from lazytrain.recipes.train import MetricsLog
    from lazytrain.runtime.trace import Trace
    from lazytrain.storage.aligned_io import DiskIOError

    m = MetricsLog(tmp_path, 0)

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def close(self):
            pass
    m.f = Full()
    with pytest.raises(DiskIOError, match=r"write .*metrics\.jsonl: No space left on device"):
        m.write({"step": 1, "loss": 1.0})
    m.close()
    t = Trace(tmp_path / "trace.jsonl")
    (tmp_path / "trace.jsonl").unlink()
    (tmp_path / "trace.jsonl").mkdir()   # no longer writable as a file
    t.add("h2d", "block.0", 0.0, 1.0, 8, "host", "params")
    with pytest.raises(DiskIOError, match=r"write trace .*trace\.jsonl"):
        t.flush()
