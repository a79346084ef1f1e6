"""ActivationStore: saved tensors offloaded to host/NVMe come back exact, and each storage crosses once."""

from __future__ import annotations

import pytest
import torch

from lazytrain.runtime.accountant import MemoryAccountant
from lazytrain.runtime.activations import ActivationStore
from lazytrain.runtime.trace import Trace
from lazytrain.storage.aligned_io import IOPool

CPU = torch.device("cpu")


def _fused_mlp(x, w_gate_up, w_down):
    # an MoE expert's shape of computation: one projection, split into gate and up halves (views
    # of one storage, each spanning nearly all of it), both saved by the ops that use them
    gate, up = torch.nn.functional.linear(x, w_gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_views_of_one_storage_cross_once_and_come_back_exact(tier, tmp_path):
    torch.manual_seed(0)
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    wgu = torch.randn(2 * 48, 32, dtype=torch.bfloat16, requires_grad=True)
    wd = torch.randn(32, 48, dtype=torch.bfloat16, requires_grad=True)
    ref = torch.autograd.grad(_fused_mlp(x, wgu, wd).float().square().sum(), (x, wgu, wd))

    acct = MemoryAccountant(1 << 40, enforce=True)
    pool = IOPool(2)
    acts = ActivationStore(CPU, acct, Trace(None), tmp_path if tier == "nvme" else None, pool, ["l0"])
    acts.resident_ptrs |= {w.untyped_storage().data_ptr() for w in (wgu, wd)}   # weights stay put
    gate_up_bytes = 64 * 2 * 48 * 2
    with acts.hooks(0, tier, lambda j: None):
        out = _fused_mlp(x, wgu, wd)
    acts.end_forward(0)
    recs = acts.layers[0].recs
    # x (the first linear's input), the gate_up output once (not once per half), silu's output
    # and the product (the second linear's input): four storages, each copied once
    assert sorted(r.nbytes for r in recs) == sorted([64 * 32 * 2, gate_up_bytes, 64 * 48 * 2, 64 * 48 * 2])
    acts.prefetch(0)
    got = torch.autograd.grad(out.float().square().sum(), (x, wgu, wd))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    acts.release(0)
    assert acct.live_bytes == 0
    pool.shutdown()


def test_a_small_view_of_a_large_storage_copies_only_its_window():
    # a saved view covering under half its storage is copied alone, not with the whole storage
    acct = MemoryAccountant(1 << 40, enforce=True)
    acts = ActivationStore(CPU, acct, Trace(None), None, None, ["l0"])
    big = torch.randn(1000, 16, requires_grad=True)
    with acts.hooks(0, "host", lambda j: None):
        y = big[:100].sin()          # sin saves its input: a view of a tenth of big's storage
    acts.end_forward(0)
    assert [r.nbytes for r in acts.layers[0].recs] == [100 * 16 * 4]
    y.sum().backward()
    assert torch.equal(big.grad[:100], torch.cos(big[:100].detach()))
    acts.release(0)
