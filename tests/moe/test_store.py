import json
import os

import pytest
import torch
from safetensors.torch import save_file

from lazytrain.moe import ExpertStore, StoreError, StoreMismatchError, convert_checkpoint, load_streamed
from lazytrain.moe.arch import find_moe_layers



def _record(store: ExpertStore, layer: int, expert: int) -> bytes:
    lr = store.layers[layer]
    path = store.dir / lr.file
    with open(path, "rb") as f:
        f.seek(expert * lr.record_bytes)
        return f.read(lr.record_bytes)


def test_store_layout_and_tensors(mixtral_store):
    model, d = mixtral_store
    st = ExpertStore(d / "store")
    try:
        assert st.num_layers == 4 and st.record_bytes % 4096 == 0
        layers = find_moe_layers(model)
        st.check_model(layers)
        for l, ml in enumerate(layers):
            lr = st.layers[l]
            assert all(o % 4096 == 0 for o in lr.offsets)
            for e in (0, 5):
                rec = bytearray(_record(st, l, e))
                for spec, off in zip(lr.tensors, lr.offsets):
                    got = torch.frombuffer(rec[off:off + spec.nbytes], dtype=torch.float32).view(spec.shape)
                    assert torch.equal(got, getattr(ml.experts, spec.name)[e].detach())
    finally:
        st.close()


def test_per_expert_and_fused_checkpoints_convert_identically(mixtral_store, tmp_path):
    model, d = mixtral_store
    keys = json.dumps(sorted(__import__("safetensors").safe_open(str(d / "hf" / "model.safetensors"), "pt").keys()))
    assert "experts.0.w1.weight" in keys            # save_pretrained wrote per-expert keys
    convert_checkpoint(d / "hf", tmp_path / "a")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((d / "hf" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
    convert_checkpoint(fused, tmp_path / "b")
    for name in ("a", "b"):
        st, ref = ExpertStore(tmp_path / name), ExpertStore(d / "store")
        try:
            assert [lr.crc32 for lr in st.layers] == [lr.crc32 for lr in ref.layers]
        finally:
            st.close()
            ref.close()


def test_corrupt_expert_is_refused_by_checksum(mixtral_store, tmp_path):
    import shutil

    _, d = mixtral_store
    shutil.copytree(d / "store", tmp_path / "s")
    st = ExpertStore(tmp_path / "s")
    lr = st.layers[1]
    st.close()
    with open(tmp_path / "s" / lr.file, "r+b") as f:
        f.seek(3 * lr.record_bytes + 100)
        f.write(b"\x13\x37")
    eng = load_streamed(tmp_path / "s", cache_slots=32, prefetch="none")
    try:
        with pytest.raises(StoreMismatchError, match="checksum mismatch: layer 1 expert 3"):
            for _ in range(8):     # enough tokens that layer 1 routes to expert 3 at some point
                eng.generate(torch.randint(0, 128, (1, 16)), 4)
    finally:
        eng.close()


def test_mismatched_store_lists_differences(mixtral_store, tiny_moe, tmp_path):
    _, d = mixtral_store
    other = tiny_moe("mixtral", num_local_experts=4, intermediate_size=80)
    other.save_pretrained(tmp_path / "hf4")
    with pytest.raises(StoreMismatchError) as e:
        load_streamed(d / "store", model_path=tmp_path / "hf4")
    msg = str(e.value)
    assert "experts: store 8, model 4" in msg and "shape" in msg


def test_missing_and_incomplete_store(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        ExpertStore(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(StoreError, match="not an expert store"):
        ExpertStore(tmp_path / "half")


def test_store_and_predictor_files_have_the_mode_open_gives(tiny_moe, tmp_path):
    """safetensors writes 0600 whatever the umask (safetensors#782): a store or predictor made by
    one user must be readable by the serving user the umask allows."""
    from lazytrain.moe import convert_model
    from lazytrain.moe.predictor import PredictorHeads

    model = tiny_moe("mixtral")
    old = os.umask(0o027)
    try:
        d = convert_model(model, tmp_path / "store")
        p = PredictorHeads(model.config.hidden_size, [8] * 4).save(tmp_path / "p.safetensors")
    finally:
        os.umask(old)
    files = [f for f in d.rglob("*") if f.is_file()] + [p]
    assert any(f.suffix == ".safetensors" for f in files[:-1])
    wrong = {f.name: oct(f.stat().st_mode & 0o777) for f in files if f.stat().st_mode & 0o777 != 0o640}
    assert not wrong, wrong
