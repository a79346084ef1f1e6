"""AdamW8bit's state dict through torch.distributed.checkpoint's optimizer API (which keeps only
'state' and 'param_groups'), a saved state refused on a parameter of another shape with the same
size, and AdamWRef's torch default weight decay (review, 2026-12-02)."""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from lazytrain.optim import AdamW8bit, AdamWRef


def _model(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))


def _steps(m, o, n, x, nan_at=None):
    for i in range(n):
        o.zero_grad()
        m(x).square().mean().backward()
        if i == nan_at:
            next(m.parameters()).grad[0, 0] = float("nan")
        o.step()


def test_dcp_optimizer_state_dict_round_trip_is_exact():
    x = torch.randn(16, 64)
    m = _model()
    o = AdamW8bit(m.parameters(), lr=1e-2, max_grad_norm=1.0, min_8bit_numel=1024)
    _steps(m, o, 4, x, nan_at=1)                         # one skipped step, counted
    osd = get_optimizer_state_dict(m, o)
    assert set(osd) == {"state", "param_groups"}         # (the top-level tag is gone here)
    m2 = _model()
    m2.load_state_dict(m.state_dict())
    o2 = AdamW8bit(m2.parameters(), lr=1e-2, max_grad_norm=1.0, min_8bit_numel=1024)
    set_optimizer_state_dict(m2, o2, osd)
    assert o2.skipped_steps == o.skipped_steps == 1
    assert all("lazytrain_adamw8bit" not in g for g in o2.param_groups)
    _steps(m, o, 2, x)
    _steps(m2, o2, 2, x)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    sd, sd2 = o.state_dict(), o2.state_dict()
    for pid in sd["state"]:
        for k, v in sd["state"][pid].items():
            assert torch.equal(v, sd2["state"][pid][k]) if torch.is_tensor(v) else v == sd2["state"][pid][k]


def test_a_state_for_another_shape_of_the_same_size_is_refused():
    up, down = torch.nn.Parameter(torch.randn(256, 64)), torch.nn.Parameter(torch.randn(64, 256))
    o = AdamW8bit([up, down], lr=1e-3)
    up.grad, down.grad = torch.randn_like(up), torch.randn_like(down) * 1000
    o.step()
    sd = o.state_dict()
    o2 = AdamW8bit([down, up], lr=1e-3)                   # the other order: same sizes, other shapes
    with pytest.raises(ValueError, match=r"made for a parameter of shape \(256, 64\), this one is \(64, 256\)"):
        o2.load_state_dict(sd)
    # a state dict saved before the shape was recorded still loads as it did
    for st in sd["state"].values():
        st.pop("shape")
    o2.load_state_dict(sd)
    # and a parameter reshaped in place after its state was made is refused at its next step
    o3 = AdamW8bit([up], lr=1e-3)
    o3.step()
    up.data = up.data.reshape(64, 256)
    up.grad = torch.randn_like(up)
    with pytest.raises(ValueError, match=r"made for a parameter of shape \(256, 64\)"):
        o3.step()


def test_reference_defaults_to_torchs_weight_decay():
    p = torch.nn.Parameter(torch.ones(8))
    assert AdamWRef([p]).defaults["weight_decay"] == torch.optim.AdamW([p]).defaults["weight_decay"] == 1e-2
