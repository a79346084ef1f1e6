"""Exponent maps: structure, nearest-code rounding, error bounds against bitsandbytes' map."""

import pytest
import torch

from lazytrain.optim import qmap


@pytest.mark.parametrize("signed", [True, False])
def test_codes_sorted_and_span_zero_to_one(signed):
    emap = qmap.exp_map(signed)
    mags = emap.code[: emap.top_code + 1]
    assert mags[0] == 0.0 and mags[-1] == 1.0
    assert torch.all(mags[1:] > mags[:-1])
    if signed:
        assert torch.equal(emap.code[128:], -mags)


def _samples(signed: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    emap = qmap.exp_map(signed)
    mags = emap.code[: emap.top_code + 1]
    mids = (mags[1:] + mags[:-1]) / 2
    x = torch.cat(
        [
            torch.rand(200_000, generator=g),
            10 ** (-10 * torch.rand(50_000, generator=g)),
            mags,
            mids,
            torch.nextafter(mids, torch.zeros_like(mids)),
            torch.nextafter(mids, torch.ones_like(mids)),
            torch.tensor([0.0, 1.0, 1.0000001]),
        ]
    )
    return torch.cat([x, -x]) if signed else x


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_is_nearest_code(signed):
    emap = qmap.exp_map(signed)
    mags = emap.code[: emap.top_code + 1]
    x = _samples(signed)
    deq = emap.code[qmap.quantize_normalized(x, emap).long()]
    a = x.abs()
    best = (a[:, None] - mags[None, :]).abs().min(dim=1).values
    err = (deq.abs() - a).abs()
    assert torch.all(torch.sign(deq) * torch.sign(x) >= 0)
    above = a >= mags[1]  # below the smallest code values flush to 0 or round up to it
    assert torch.all(err[above] <= best[above])
    assert torch.all(err[~above] <= mags[1])
    if not signed:  # v never decodes to 0 (zero-point exclusion)
        assert torch.all(qmap.quantize_normalized(x, emap) >= 1)


@pytest.mark.parametrize("signed", [True, False])
def test_error_bound_close_to_bitsandbytes(signed):
    emap = qmap.exp_map(signed)
    x = _samples(signed)
    err = (emap.code[qmap.quantize_normalized(x, emap).long()] - x).abs().max().item()
    bound = 2.0**-7 if signed else 2.0**-8
    assert err <= bound
    bnb = qmap.bnb_dynamic_map(signed)
    xs = x[: 100_000]
    bnb_err = (bnb[(xs[:, None] - bnb[None, :]).abs().argmin(dim=1)] - xs).abs().max().item()
    assert err <= 1.15 * bnb_err  # within 15% of the published map's worst case


def test_bnb_map_matches_bitsandbytes_if_installed():
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    for signed in (True, False):
        assert torch.equal(qmap.bnb_dynamic_map(signed), bnb_f.create_dynamic_map(signed=signed).float().cpu())


def test_blockwise_roundtrip_error_per_block():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=g) * torch.logspace(-6, 2, 10_000)
    emap = qmap.exp_map(True)
    q, absmax = qmap.quantize_blockwise(x, emap, 1024)
    assert q.dtype == torch.uint8 and q.numel() == x.numel() and absmax.numel() == 10
    back = qmap.dequantize_blockwise(q, absmax, emap, 1024)
    bound = absmax.repeat_interleave(1024)[: x.numel()] * 2.0**-7
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))
    zq, zmax = qmap.quantize_blockwise(torch.zeros(100), emap, 64)
    assert torch.all(zmax == 0) and torch.all(qmap.dequantize_blockwise(zq, zmax, emap, 64) == 0)
