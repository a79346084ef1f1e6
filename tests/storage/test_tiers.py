"""Flat per-layer buffers and the host / NVMe tier stores."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lazytrain.storage.aligned_io import IOPool
from lazytrain.storage.flat import FlatLayout, typed
from lazytrain.storage.tiers import HostStore, NvmeStore, check_nvme_dir, staging_buffer


def test_flat_layout_round_trip():
    params = [("a", nn.Parameter(torch.randn(3, 5))), ("b", nn.Parameter(torch.randn(7))),
              ("c", nn.Parameter(torch.randn(2, 2, 2)))]
    lay = FlatLayout.of(params, torch.float32)
    assert lay.numel == 15 + 7 + 8 and lay.nbytes == 4 * 30 and lay.padded_nbytes % 4096 == 0
    flat = torch.empty(lay.numel)
    lay.gather([p.data for _, p in params], flat)
    for (_, p), v in zip(params, lay.views(flat)):
        assert torch.equal(p.data, v) and v.data_ptr() >= flat.data_ptr()


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_store_round_trip(tier, tmp_path):
    pool = IOPool(2)
    store = HostStore() if tier == "host" else NvmeStore(tmp_path, pool)
    n = 10_000
    store.allocate("layer.param", n * 4)
    src = staging_buffer(n * 4)
    typed(src, torch.float32, n).copy_(torch.arange(n, dtype=torch.float32))
    store.write_from("layer.param", src).result()
    dst = staging_buffer(n * 4)
    store.read_into("layer.param", dst).result()
    assert torch.equal(typed(dst, torch.float32, n), torch.arange(n, dtype=torch.float32))
    store.close()
    pool.shutdown()


def test_nvme_dir_checks(tmp_path):
    with pytest.raises(ValueError, match="no nvme_dir"):
        check_nvme_dir(None, 1)
    with pytest.raises(ValueError, match="does not exist"):
        check_nvme_dir(tmp_path / "missing", 1)
    with pytest.raises(ValueError, match="GiB free but the plan needs"):
        check_nvme_dir(tmp_path, 1 << 60)
    assert check_nvme_dir(tmp_path, 1) == tmp_path
