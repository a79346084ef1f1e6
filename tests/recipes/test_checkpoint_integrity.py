"""Checkpoint integrity: every file resume reads carries its size and crc32 in state.json, and a
damaged one (even in the tensor data, behind an intact header) is reported naming the file."""

import json

import pytest
import torch

from lazytrain.cli.config import load_config
from lazytrain.recipes import checkpoint as ckpt
from lazytrain.recipes.train import run
from lazytrain.storage.aligned_io import DiskIOError

SMALL_BUDGET = ["hardware.device_memory_gib=0.002", "hardware.workspace_gib=0.0001"]


def _run(overrides, out, *extra):
    cfg = load_config([*overrides, f"output_dir={out}", *extra], config_name="train")
    return run(cfg, out, echo=lambda *_: None)


def _losses(out):
    return [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]


def _data_offset(path):
    """Where a safetensors file's tensor data starts (after the 8-byte length and the header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _stopped_run(base_overrides, out, max_steps=4, stop=2):
    ov = [*base_overrides, f"job.max_steps={max_steps}", "save_every=0", "engine=lazytrain",
          "save_final_model=false", *SMALL_BUDGET]
    _run(ov, out, f"stop_at_step={stop}")
    return ov, ckpt.latest_checkpoint(out / "checkpoints")


def test_manifest_records_every_file_resume_reads(tmp_path):
    root = tmp_path / "ck"
    last = ckpt.save_checkpoint(root, 1, {"data_position": 1},
                                engine_tensors=iter([{"a": torch.ones(4)}, {"b": torch.zeros(8)}]))
    state = ckpt.read_state(last)
    sums = state[ckpt.FILE_SUMS]
    assert sorted(sums) == ["engine-00000.safetensors", "engine-00001.safetensors", "rng.safetensors"]
    for name, rec in sums.items():
        assert rec == ckpt.file_digest(last / name) and rec["bytes"] == (last / name).stat().st_size
    assert isinstance(state[ckpt.STATE_SUM], int)


def test_damaged_data_bytes_in_a_shard_stop_the_resume_naming_the_shard(base_overrides, tmp_path):
    """64 bytes overwritten in a shard's tensor data, header intact: the resume fails naming the
    shard (it used to resume on garbage weights), and the checkpoint and `latest` stay as they were."""
    out = tmp_path / "r"
    ov, last = _stopped_run(base_overrides, out)
    shard = sorted(last.glob("engine-*.safetensors"))[3]
    raw = bytearray(shard.read_bytes())
    at = _data_offset(shard) + 16
    assert len(raw) >= at + 64
    raw[at:at + 64] = bytes(64)
    shard.write_bytes(bytes(raw))
    before = {p.name: p.read_bytes() for p in last.iterdir()}
    with pytest.raises(DiskIOError, match=rf"read checkpoint file .*{last.name}/{shard.name}: checksum "
                                          rf"mismatch .*damaged \(remove .*{last.name} to resume"):
        _run(ov, out, "resume=true")
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with pytest.raises(DiskIOError) as e:
        ckpt.load_checkpoint(last)
    assert "\n" not in str(e.value)                       # one line
    assert torch.equal(torch.get_rng_state(), rng)        # nothing restored from a damaged checkpoint
    assert ckpt.latest_checkpoint(out / "checkpoints") == last
    assert {p.name: p.read_bytes() for p in last.iterdir()} == before
    assert len(_losses(out)) == 2                          # no step ran on the damaged state


@pytest.mark.parametrize("name", ["engine-00001.safetensors", "rng.safetensors"])
def test_truncated_file_is_reported(tmp_path, name):
    root = tmp_path / "ck"
    last = ckpt.save_checkpoint(root, 1, {"data_position": 1},
                                engine_tensors=iter([{"a": torch.ones(64)}, {"b": torch.zeros(64)}]))
    f = last / name
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(DiskIOError, match=rf"read checkpoint file .*{name}: \d+ bytes, \d+ when written; "
                                          r"the checkpoint is damaged"):
        ckpt.load_checkpoint(last)


def test_missing_shard_is_reported(tmp_path):
    root = tmp_path / "ck"
    last = ckpt.save_checkpoint(root, 1, {"data_position": 1},
                                engine_tensors=iter([{"a": torch.ones(4)}, {"b": torch.zeros(4)}]))
    (last / "engine-00001.safetensors").unlink()
    with pytest.raises(DiskIOError, match=r"engine-00001\.safetensors.*damaged"):
        ckpt.load_checkpoint(last)


def test_damaged_state_json_value_is_reported(tmp_path):
    """A changed value that still parses (data position 17 -> 71) is caught by state.json's own crc."""
    root = tmp_path / "ck"
    last = ckpt.save_checkpoint(root, 1, {"data_position": 17}, engine_tensors={"w": torch.ones(4)})
    f = last / "state.json"
    f.write_text(f.read_text().replace('"data_position": 17', '"data_position": 71'))
    with pytest.raises(DiskIOError, match=r"state\.json: checksum mismatch.*damaged"):
        ckpt.read_state(last)


def test_damaged_latest_checkpoint_is_not_silently_replaced_by_an_older_one(tmp_path):
    root = tmp_path / "ck"
    for s in (1, 2):
        ckpt.save_checkpoint(root, s, {"data_position": s}, engine_tensors={"w": torch.full((256,), float(s))})
    f = root / "step_000002" / "engine.safetensors"
    raw = bytearray(f.read_bytes())
    raw[_data_offset(f) + 4] ^= 0xFF
    f.write_bytes(bytes(raw))
    last = ckpt.latest_checkpoint(root)
    assert last.name == "step_000002"
    with pytest.raises(DiskIOError, match="step_000002/engine.safetensors: checksum mismatch"):
        ckpt.load_checkpoint(last)


def test_intact_checkpoint_resumes_to_the_same_losses(base_overrides, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ov, _ = _stopped_run(base_overrides, b)
    s = _run(ov, b, "resume=true")
    assert s["start_step"] == 2 and s["end_step"] == 4
    _run(ov, a)
    assert _losses(a) == _losses(b)


def test_checkpoint_without_checksums_still_loads(base_overrides, tmp_path):
    """A checkpoint written before checksums were recorded resumes as before, unchecked."""
    out = tmp_path / "r"
    ov, last = _stopped_run(base_overrides, out)
    f = last / "state.json"
    state = json.loads(f.read_text())
    del state[ckpt.FILE_SUMS], state[ckpt.STATE_SUM]
    f.write_text(json.dumps(state, indent=1))
    st, tensors = ckpt.load_checkpoint(last)
    assert st["step"] == 2 and len(tensors) > 0
    s = _run(ov, out, "resume=true")
    assert s["start_step"] == 2 and s["end_step"] == 4
    assert len(_losses(out)) == 4


def test_digest_from_memory_equals_the_files(tmp_path):
    """The checksum recorded at save is computed from the tensors in memory and the header read
    back; it must equal what resume computes from the file."""
    import torch
    from safetensors.torch import save_file

    from lazytrain.recipes.checkpoint import file_digest, written_digest
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(33, 7, generator=g), "h": torch.randn(5, generator=g).bfloat16(),
               "i": torch.arange(3, dtype=torch.int64), "s": torch.tensor(2.5), "e": torch.empty(0, 4),
               "b": torch.tensor([True, False])}
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    assert written_digest(path, tensors) == file_digest(path)
