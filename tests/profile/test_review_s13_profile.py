"""Review (session 13) of `lazytrain profile`: the device type, memory and overlap of the device
timed (not the base's), no toy-model efficiency without model=, and configs with per-layer lists."""
import json
import shutil

import pytest
import yaml

from lazytrain.cli import profile as cli
from lazytrain.cli.config import config_dir
from lazytrain.profile.hardware import measured_spec
from lazytrain.profile.links import CopyRates
from lazytrain.spec import HardwareSpec, MiB, ModelSpec


def _hw(name):
    return HardwareSpec.from_dict(yaml.safe_load((config_dir() / "hardware" / f"{name}.yaml").read_text()))


GPU = CopyRates(device="cuda", h2d_pinned_gbps=52.0, d2h_pinned_gbps=50.0, h2d_pageable_gbps=20.0,
                d2h_pageable_gbps=18.0, size_bytes=256 * MiB)
CPU = CopyRates("cpu", None, None, 26.0, 26.0, MiB)


def test_a_cuda_profile_on_a_cpu_base_describes_the_gpu():
    """`lazytrain profile model=X` on a GPU machine (hardware defaults to cpu): the GPU is timed,
    and the profile used to say device_type cpu, the cpu budget (4 GiB) and no optimizer overlap
    (so the planner charged the GPU's copies to compute and `train hardware=measured` ran on the
    CPU)."""
    base = _hw("cpu")
    spec = measured_spec(base, GPU, None, peak_tflops=700.0, layers=None, host_optimizer_gbps=40.0,
                         device_memory_gib=139.76)
    assert spec.device_type == "cuda" and not spec.copies_share_compute
    assert spec.optimizer_overlaps_compute is True
    assert spec.device_memory_gib == 139.7                      # the card's total, never rounded up
    assert spec.workspace_gib >= 1.0 > base.workspace_gib       # room for a CUDA context
    assert spec.h2d_gbps == 52.0 and spec.device_tflops == 700.0
    # without the card's memory a CPU base has no figure for it: refused, not the CPU budget
    with pytest.raises(ValueError, match="device memory was not given.*'cpu' is a cpu profile"):
        measured_spec(base, GPU, None, 700.0, None, 40.0)


def test_profile_machine_on_cuda_writes_the_cards_type_and_memory(monkeypatch):
    """profile_machine's wiring on a CUDA device (no GPU here: the measurements are stubbed)."""
    import torch

    from lazytrain.profile import hardware, links
    from lazytrain.spec import JobSpec

    monkeypatch.setattr(links, "measure_copies", lambda size, repeats, device: GPU)
    monkeypatch.setattr(links, "measure_disk", lambda *a, **k: links.DiskRates(
        "/x", True, "O_DIRECT", 6.0, 5.0, MiB, 100 * 2**30, duplex_overlap=0.1))
    monkeypatch.setattr(links, "measure_matmul_tflops", lambda dtype, device: 700.0)
    monkeypatch.setattr(links, "measure_host_optimizer", lambda job, repeats: 40.0)
    monkeypatch.setattr(hardware, "cuda_memory_gib", lambda device: 139.76)
    lines = []
    spec, det = hardware.profile_machine(_hw("cpu"), None, JobSpec(), torch.device("cuda"), "/x", MiB, 1,
                                         with_layers=False, log=lines.append)
    assert (spec.device_type, spec.device_memory_gib, spec.optimizer_overlaps_compute) == ("cuda", 139.7, True)
    assert any("the device timed is cuda, base hardware cpu is cpu" in line and "139.8 GiB" in line
               for line in lines), lines
    assert det["model"] is None


def test_a_cuda_base_keeps_or_takes_the_cards_memory_and_a_cpu_timing_describes_the_cpu():
    h200 = _hw("h200")
    assert measured_spec(h200, GPU, None, 700.0, None).device_memory_gib == h200.device_memory_gib
    assert measured_spec(h200, GPU, None, 700.0, None, device_memory_gib=139.8).device_memory_gib == 139.8
    # `lazytrain profile hardware=h200` on a CPU-only machine: the CPU is the device timed
    spec = measured_spec(h200, CPU, None, 0.2, None)
    assert spec.device_type == "cpu" and spec.copies_share_compute and not spec.optimizer_overlaps_compute
    assert spec.device_memory_gib == h200.device_memory_gib     # the planned (accounted) budget
    cpu = measured_spec(_hw("cpu"), CPU, None, 0.2, None)
    assert (cpu.device_type, cpu.optimizer_overlaps_compute) == ("cpu", False)


def test_profile_without_a_model_keeps_the_base_efficiency(tmp_path, capsys):
    """Without model= the config's default model is the 64-wide tiny-llama, whose blocks gave an
    efficiency of ~0.05 and plans ~7x too slow: its blocks are not timed any more."""
    (tmp_path / "ssd").mkdir()
    out = tmp_path / "m.yaml"
    rc = cli.main(["hardware=cpu", "--size-mib", "4", "--repeats", "1", "--nvme-dir", str(tmp_path / "ssd"),
                   "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "no model= given: per-layer timing skipped, efficiency 0.6 kept from hardware=cpu" in text
    hw = HardwareSpec.from_dict(yaml.safe_load(out.read_text()))
    assert hw.efficiency == _hw("cpu").efficiency and hw.device_type == "cpu"
    det = json.loads((tmp_path / "m.profile.json").read_text())
    assert det["layers"] == [] and det["model"] is None


@pytest.mark.parametrize("overrides, named", [
    (["hardware=cpu"], False), (["hardware=cpu", "job.seq_len=64"], False),
    (["model=demo-llama"], True), (["model.path=/m"], True), (["+model.hf_config.x=1"], True)])
def test_which_overrides_name_a_model(overrides, named):
    assert cli._names_a_model(overrides) is named


def test_layer_times_for_a_config_with_layer_types(monkeypatch):
    """transformers >= 4.53 writes `layer_types` (one entry per layer) into every Qwen2/Qwen3
    config.json; timing 2 of 4 blocks cut num_hidden_layers but not the list, and the config
    refused itself. Every list of one entry per layer is cut alike."""
    from transformers import AutoConfig, Qwen3Config

    from lazytrain.profile.layers import measure_layers

    hf = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256).to_dict()
    assert len(hf["layer_types"]) == 4
    spec = ModelSpec.from_hf_config({**hf, "no_rope_layers": [1, 1, 1, 0]})
    seen = {}
    real = AutoConfig.for_model

    def recording(model_type, **kw):
        seen.update(kw)
        return real(model_type, **kw)
    monkeypatch.setattr(AutoConfig, "for_model", recording)
    lts = measure_layers(spec, 1, 16, "fp32", repeats=1)
    assert [lt.name for lt in lts] == [ls.name for ls in spec.layers]
    assert seen["num_hidden_layers"] == 2 and seen["layer_types"] == hf["layer_types"][:2]
    assert seen["no_rope_layers"] == [1, 1]


def test_profile_on_a_cpu_only_machine_refuses_a_cuda_base_before_timing(capsys, monkeypatch):
    """Said in one line before minutes of timing, not a profile that cannot plan anything."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    called = []
    monkeypatch.setattr("lazytrain.profile.hardware.profile_machine", lambda *a, **k: called.append(1))
    assert cli.main(["hardware=h200"]) == 2 and not called
    err = capsys.readouterr().err
    assert "no CUDA device is visible" in err and "hardware=cpu" in err and "Traceback" not in err
