import json
import shutil

import pytest
import torch
import yaml

from lazytrain.cli import profile as cli
from lazytrain.cli.config import config_dir, load_config, model_spec
from lazytrain.profile.layers import measure_layers
from lazytrain.profile.hardware import measured_spec
from lazytrain.profile.links import CopyRates, measure_copies, measure_disk, measure_host_optimizer
from lazytrain.spec import HardwareSpec, JobSpec, MiB


def test_copy_and_disk_rates_are_measured(tmp_path):
    c = measure_copies(8 * MiB, repeats=2)
    assert c.h2d_pageable_gbps > 0 and c.d2h_pageable_gbps > 0
    assert (c.h2d_pinned_gbps is None) == (c.device == "cpu")
    d = measure_disk(tmp_path, 8 * MiB, repeats=1, chunk_bytes=1 * MiB)
    assert d.read_gbps > 0 and d.write_gbps > 0 and d.size_bytes == 8 * MiB
    assert d.direct == (d.reason == "O_DIRECT")
    assert (d.duplex_overlap is None) == (not d.direct)   # measured only where O_DIRECT works
    assert d.duplex_overlap is None or 0.0 <= d.duplex_overlap <= 1.0
    assert not list(tmp_path.iterdir())  # the probe files are removed


def test_cpu_host_to_device_rate_is_measured_with_the_streamers_copy(monkeypatch):
    """On a CPU device the executor fetches large host-tier layers with streaming stores
    (storage/fastcopy); the profiled h2d rate is measured with the same copy."""
    from lazytrain.storage import fastcopy

    used = []

    def counting(dst, src):
        used.append(dst.nbytes)
        dst.copy_(src)

    monkeypatch.setattr("lazytrain.profile.links.copy_into", counting)
    c = measure_copies(fastcopy.MIN_BYTES, repeats=1, device=torch.device("cpu"))
    assert c.h2d_pageable_gbps > 0 and used and set(used) == {fastcopy.MIN_BYTES}


def test_measured_drive_duplex_sets_the_planner_mode():
    from lazytrain.profile.links import DiskRates

    base = HardwareSpec(name="base", device_type="cpu", device_memory_gib=4, host_memory_gib=16,
                        nvme_capacity_gib=100, h2d_gbps=25, d2h_gbps=25, nvme_read_gbps=3,
                        nvme_write_gbps=2, device_tflops=1, nvme_full_duplex=True)
    cpu = CopyRates("cpu", None, None, 26.0, 26.0, MiB)

    def disk(overlap):
        return DiskRates("/x", True, "O_DIRECT", 1.8, 1.4, MiB, 10 * MiB, duplex_overlap=overlap)
    assert measured_spec(base, cpu, disk(0.1), 1.0, None).nvme_full_duplex is False
    assert measured_spec(base, cpu, disk(0.8), 1.0, None).nvme_full_duplex is True
    assert measured_spec(base, cpu, disk(None), 1.0, None).nvme_full_duplex is True   # base kept


def test_host_optimizer_rate_sets_host_memory_gbps():
    rates = {bits: measure_host_optimizer(JobSpec(optimizer_state_bits=bits), numel=1 << 16, repeats=1)
             for bits in (32, 8)}
    assert all(0 < r < 1e4 for r in rates.values()), rates
    base = HardwareSpec(name="base", device_type="cuda", device_memory_gib=24, host_memory_gib=64,
                        nvme_capacity_gib=100, h2d_gbps=25, d2h_gbps=25, nvme_read_gbps=3,
                        nvme_write_gbps=2, device_tflops=71, host_memory_gbps=60.0)
    gpu = CopyRates("cuda", 50.0, 50.0, 10.0, 10.0, MiB)
    cpu = CopyRates("cpu", None, None, 26.0, 26.0, MiB)
    assert measured_spec(base, gpu, None, 100.0, None, rates[8]).host_memory_gbps == round(rates[8], 3)
    assert measured_spec(base, gpu, None, 100.0, None, None).host_memory_gbps == 60.0   # not measured
    # CPU-only: the timed update too; the copy rate stands in only when it was not timed
    assert measured_spec(base, cpu, None, 1.0, None, rates[32]).host_memory_gbps == round(rates[32], 3)
    assert measured_spec(base, cpu, None, 1.0, None, None).host_memory_gbps == 26.0


def test_layer_times_cover_every_planner_layer():
    spec = model_spec(load_config(["model=tiny-llama"]))
    lts = measure_layers(spec, 1, 16, "fp32", repeats=1)
    assert [lt.name for lt in lts] == [ls.name for ls in spec.layers]
    blocks = [lt for lt in lts if lt.name.startswith("block.")]
    assert all(lt.fwd_s > 0 and lt.bwd_s > 0 and lt.flops_fwd > 0 for lt in blocks)


def test_profile_cli_writes_a_loadable_hardware_config(tmp_path, capsys, monkeypatch):
    cfgs = tmp_path / "configs"
    shutil.copytree(config_dir(), cfgs)
    (cfgs / "hardware" / "measured.yaml").unlink(missing_ok=True)
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", str(cfgs))
    (tmp_path / "ssd").mkdir()
    rc = cli.main(["hardware=cpu", "model=tiny-llama", "job.seq_len=16", "--size-mib", "4",
                   "--repeats", "1", "--nvme-dir", str(tmp_path / "ssd")])
    assert rc == 0, capsys.readouterr().err
    out = cfgs / "hardware" / "measured.yaml"
    hw = HardwareSpec.from_dict(yaml.safe_load(out.read_text()))
    base = HardwareSpec.from_dict(yaml.safe_load((cfgs / "hardware" / "cpu.yaml").read_text()))
    assert hw.name == "measured" and hw.device_memory_gib == base.device_memory_gib
    assert hw.h2d_gbps > 0 and hw.nvme_read_gbps > 0 and 0 < hw.efficiency <= 1
    assert hw.nvme_read_gbps != base.nvme_read_gbps  # measured, not copied
    det = json.loads((cfgs / "hardware" / "measured.profile.json").read_text())
    assert len(det["layers"]) == 6 and det["disk"]["direct"] in (True, False)
    cfg = load_config(["hardware=measured"])           # what `plan|train hardware=measured` compose
    assert cfg.hardware.name == "measured"


def test_profile_written_elsewhere_says_how_to_use_it(tmp_path, capsys):
    (tmp_path / "ssd").mkdir()
    rc = cli.main(["hardware=cpu", "--no-layers", "--size-mib", "4", "--repeats", "1",
                   "--nvme-dir", str(tmp_path / "ssd"), "--out", str(tmp_path / "mine.yaml")])
    out = capsys.readouterr().out
    assert rc == 0 and (tmp_path / "mine.yaml").is_file()
    assert "plan with hardware=measured" not in out and "hardware=NAME once it is copied to" in out


def test_broken_measured_profile_says_to_profile_again(tmp_path, monkeypatch):
    from lazytrain.cli.config import ConfigError, hardware_spec
    cfgs = tmp_path / "configs"
    shutil.copytree(config_dir(), cfgs)
    d = yaml.safe_load((cfgs / "hardware" / "cpu.yaml").read_text())
    (cfgs / "hardware" / "measured.yaml").write_text(yaml.safe_dump({**d, "name": "measured", "h2d_gbps": 0.0}))
    monkeypatch.setenv("LAZYTRAIN_CONFIG_DIR", str(cfgs))
    with pytest.raises(ConfigError, match="h2d_gbps must be > 0.*run it again"):
        hardware_spec(load_config(["hardware=measured"]))


def test_profile_cli_bad_nvme_dir(tmp_path, capsys):
    rc = cli.main(["hardware=cpu", "--nvme-dir", str(tmp_path / "nope"), "--no-layers"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_profile_cli_unwritable_out_is_refused_before_timing(tmp_path, capsys, monkeypatch):
    """--out that is a directory, or under a file, is one line (exit 2) before any timing (review:
    a traceback after minutes of measuring, and a stray .tmp file)."""
    import lazytrain.profile.hardware as hwmod

    def never(*a, **k):
        raise AssertionError("timed before the --out check")
    monkeypatch.setattr(hwmod, "profile_machine", never)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    for bad, says in ((tmp_path / "adir", "is a directory"), (tmp_path / "afile" / "m.yaml", "is not a directory")):
        rc = cli.main(["hardware=cpu", "--no-layers", "--out", str(bad)])
        err = capsys.readouterr().err
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_layer_times_take_every_dtype_spelling(dtype):
    spec = model_spec(load_config(["model=tiny-llama"]))
    assert len(measure_layers(spec, 1, 8, dtype, repeats=1)) == len(spec.layers)
