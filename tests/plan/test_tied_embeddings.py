"""Tied input/output embeddings: the head computes with the embedding's matrix, one buffer owned by
the embedding (the executor's `borrows`). Resident, the matrix is counted once; streamed, it is
fetched for the head from the embedding's tier. The MILP and the simulator agree on every mix."""

import itertools
from dataclasses import replace

import pytest

from lazytrain.costmodel import job_costs
from lazytrain.plan.assignment import STORE, Assignment, Segment
from lazytrain.plan.heuristics import heuristic_pins
from lazytrain.plan.milp import Pins, solve_milp
from lazytrain.plan.ops import fwd_window, grads_in_flight
from lazytrain.plan.simulate import _window_items, memory_peaks, simulate
from lazytrain.spec import GiB, JobSpec

TIERS = ("device", "host", "nvme")


def _close(a, b, tol=0.01):
    return abs(a - b) <= tol * max(abs(a), abs(b)) + 1e-12


@pytest.fixture
def tied_pair(make_llama, make_hw):
    kw = dict(layers=3, hidden=256, inter=704, vocab=4096)
    tied = make_llama(tie_word_embeddings=True, **kw)
    untied = make_llama(**kw)
    return tied, untied, make_hw(device_memory_gib=8.0), JobSpec(batch_size=2, seq_len=128)


def _assignment(L, param_tier, segments=None):
    segs = segments or tuple(Segment(b, b + 1, STORE, "device") for b in range(L))
    return Assignment(segments=segs, param_tier=tuple(param_tier),
                      grad_tier=("host",) * (L + 2), optimizer_tier=("host",) * (L + 2))


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_resident_tied_matrix_is_counted_once(tied_pair, mode):
    tied, untied, h, job = tied_pair
    job = replace(job, mode=mode)
    L, cb = tied.num_layers, job.compute_bytes
    matrix = tied.vocab_size * tied.hidden_size * cb
    ct, cu = job_costs(tied, h, job), job_costs(untied, h, job)
    assert ct.device_static_bytes == cu.device_static_bytes
    a = _assignment(L, ("device",) * (L + 2))
    peak_t = memory_peaks(ct, a, depth=2)[0]["device"]
    peak_u = memory_peaks(cu, a, depth=2)[0]["device"]
    # the untied model holds one more vocab x hidden matrix (its lm_head); nothing else differs
    assert peak_u - peak_t == matrix
    # explicit sum: every unique weight once, plus statics and the largest activation moment
    static = ct.device_static_bytes + tied.param_count * cb
    acts = sum(c.act_bytes for c in ct.layers[1:-1])
    head = ct.layers[-1]
    # backward moments: the head, each block (its kept activations and those before it), the
    # embedding; each with the weight grads then in flight (its own and the previous layer's)
    # the head: what it saves plus its log-softmax backward's two fp32 gradients, or later its
    # weight gradient next to the logits gradient (the log-softmax output freed by then)
    moments = [acts + max(head.act_bytes + head.bwd_transient_bytes,
                          head.bwd_tail_bytes + grads_in_flight(ct, L + 1, L + 1))]
    moments += [sum(c.act_bytes for c in ct.layers[1:j + 1]) + ct.layers[j].bwd_transient_bytes
                + grads_in_flight(ct, j, j) for j in range(1, L + 1)]
    moments.append(grads_in_flight(ct, 0, 0))
    assert peak_t == static + max(moments)
    # the MILP evaluating the same plan predicts the same peak
    pins = Pins(segments=a.segments, param_tier=a.param_tier)
    r = solve_milp(ct, h, pins=pins)
    assert r.status == "optimal" and _close(r.peak_bytes["device"], peak_t, 1e-6)


@pytest.mark.parametrize("embed_tier,head_tier", list(itertools.product(TIERS, TIERS)))
def test_milp_agrees_with_simulator_on_every_tier_mix(tied_pair, embed_tier, head_tier):
    tied, _, h, job = tied_pair
    L = tied.num_layers
    # slow links so that the head's fetch shows in the step time
    h = replace(h, h2d_gbps=0.5, nvme_read_gbps=0.2)
    costs = job_costs(tied, h, job)
    param_tier = (embed_tier, "device", "host", "nvme", head_tier)
    segs = (Segment(0, 2, "recompute", "host"), Segment(2, 3, STORE, "device"))
    r = solve_milp(costs, h, pins=Pins(segments=segs, param_tier=param_tier))
    assert r.status == "optimal"
    assert r.assignment.param_tier == param_tier
    tl = simulate(costs, r.assignment, h)
    assert _close(r.objective_s, tl.step_time_s, 1e-4), (r.objective_s, tl.step_time_s)
    for tier in TIERS:
        assert _close(r.peak_bytes[tier], tl.peak_bytes[tier], 1e-4), tier


@pytest.mark.parametrize("embed_tier", ["host", "nvme"])
def test_streamed_embedding_is_fetched_for_a_resident_head(tied_pair, embed_tier):
    tied, untied, h, job = tied_pair
    L, cb = tied.num_layers, job.compute_bytes
    matrix = tied.vocab_size * tied.hidden_size * cb
    costs = job_costs(tied, h, job)
    a = _assignment(L, (embed_tier,) + ("device",) * (L + 1))
    items = _window_items(costs, a, h, final=False)
    # the window before the head (F_L) brings the embedding's matrix for it
    head_fetch = [(res, layer, amount) for res, _, layer, what, amount in items[fwd_window(L, L)]
                  if what == "params"]
    want = [("h2d", "embed", matrix)] + ([("nvme_read", "embed", matrix)] if embed_tier == "nvme" else [])
    assert sorted(head_fetch) == sorted(want)
    # per micro-batch: the head's and the next forward's; not the embedding's backward, which
    # reads no weights (between micro-batches the next forward's is fetched before it, across
    # the step's end, where the weights change, after the update: ops.held_into_next_cycle)
    def h2d(items):   # the matrix's fetches (the final micro-batch also publishes resident layers' weights)
        return sum(amount for its in items for res, _, layer, what, amount in its
                   if res == "h2d" and what == "params" and layer == "embed")
    assert h2d(items) == 2 * matrix
    assert h2d(_window_items(costs, a, h, final=True)) == 2 * matrix
    # on the device: the head's norm resident, the matrix in a streaming buffer (not resident)
    peaks, _ = memory_peaks(costs, a, depth=2)
    all_dev = memory_peaks(costs, _assignment(L, ("device",) * (L + 2)), depth=2)[0]
    assert peaks["device"] == all_dev["device"] - matrix + 2 * matrix   # depth 2 buffers of the matrix
    # and the MILP charges the same
    r = solve_milp(costs, h, pins=Pins(segments=a.segments, param_tier=a.param_tier))
    tl = simulate(costs, r.assignment, h)
    assert _close(r.objective_s, tl.step_time_s, 1e-4)
    assert _close(r.peak_bytes["device"], peaks["device"], 1e-6)


def test_a_streamed_head_with_a_resident_embedding_fetches_only_its_norm(tied_pair):
    tied, _, h, job = tied_pair
    L, cb = tied.num_layers, job.compute_bytes
    costs = job_costs(tied, h, job)
    a = _assignment(L, ("device",) * (L + 1) + ("host",))
    items = _window_items(costs, a, h, final=False)
    fetched = [(layer, amount) for its in items for res, _, layer, what, amount in its
               if res == "h2d" and what == "params"]
    assert fetched == [("head", tied.hidden_size * cb)]


def test_tied_model_plans_fit_where_the_untied_one_needs_more(tied_pair):
    """With the matrix counted once, the least device memory of an all-resident plan drops by it."""
    tied, untied, h, job = tied_pair
    pins = replace(heuristic_pins("no-checkpoint", tied.num_layers), param_tier=("device",) * (tied.num_layers + 2))
    need = {}
    for name, m in (("tied", tied), ("untied", untied)):
        r = solve_milp(job_costs(m, h, job), h, pins=pins, minimize="device_peak")
        need[name] = r.peak_bytes["device"]
    matrix = tied.vocab_size * tied.hidden_size * job.compute_bytes
    assert abs(need["untied"] - need["tied"] - matrix) < 4096
    tight = replace(h, device_memory_gib=(need["tied"] + matrix // 2) / GiB)
    assert solve_milp(job_costs(tied, tight, job), tight, pins=pins).status == "optimal"
    assert solve_milp(job_costs(untied, tight, job), tight, pins=pins).status == "infeasible"


def test_full_tuning_moves_the_shared_matrix_once_per_update(tied_pair):
    """The head's backward yields the matrix's gradient too (handed to the embedding: d2h after the
    head); the update rewrites it once, with the embedding; a resident head re-uploads its norm only."""
    tied, _, h, job = tied_pair
    L, cb = tied.num_layers, job.compute_bytes
    matrix = tied.vocab_size * tied.hidden_size * cb
    costs = job_costs(tied, h, replace(job, mode="full"))
    head = costs.layers[-1]
    assert head.grad_device_bytes == tied.hidden_size * cb + matrix
    a = _assignment(L, ("device",) * (L + 2))
    items = _window_items(costs, a, h, final=True)
    uploads = {layer: amount for its in items for res, _, layer, what, amount in its
               if res == "h2d" and what == "params"}
    assert uploads["head"] == tied.hidden_size * cb and uploads["embed"] == matrix
    grads_after_head = [amount for res, _, layer, what, amount in items[fwd_window(L, L + 1) + 1]
                        if what == "grads" and layer == "head"]
    assert grads_after_head == [tied.hidden_size * cb + matrix]


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_head_share_of_the_tied_gradient_is_counted_on_the_host(tied_pair, mode):
    # Full fine-tuning: the head's share of the shared matrix's gradient waits on the host until
    # the embedding's backward (the executor's borrowed_grads); the untied model has none
    tied, untied, h, job = tied_pair
    job = replace(job, mode=mode)
    ct, cu = job_costs(tied, h, job), job_costs(untied, h, job)
    a = _assignment(tied.num_layers, ("device",) * (tied.num_layers + 2))
    share = tied.vocab_size * tied.hidden_size * job.compute_bytes if mode == "full" else 0
    assert ct.host_static_bytes == share and cu.host_static_bytes == 0
    host_t = memory_peaks(ct, a, depth=2)[0]["host"]
    host_u = memory_peaks(cu, a, depth=2)[0]["host"]
    # the untied model's head holds its own matrix and its optimizer state on the host instead
    untied_extra = sum(c.optimizer_bytes + c.grad_store_bytes for c in cu.layers) - \
        sum(c.optimizer_bytes + c.grad_store_bytes for c in ct.layers)
    assert host_t - host_u == share - untied_extra
