"""The MILP's predicted step time and per-tier peaks equal the simulator's replay of the plan it
returns (within 1%), on random small problems (also with tied input/output embeddings); pinned
plans are evaluated identically."""

import random
from dataclasses import replace

import pytest

from lazytrain.costmodel import job_costs
from lazytrain.plan.assignment import RECOMPUTE, STORE, Segment
from lazytrain.plan.heuristics import HEURISTICS, heuristic_pins
from lazytrain.plan.milp import Pins, solve_milp
from lazytrain.plan.simulate import simulate
from lazytrain.spec import GiB, JobSpec



def _random_problem(rng: random.Random, llama, hw, tied: bool = False):
    hidden = rng.choice([128, 256, 512])
    model = llama(layers=rng.randint(2, 9), hidden=hidden, inter=hidden * rng.choice([2, 3]),
                  vocab=rng.choice([512, 4096]), heads=4, kv=rng.choice([1, 2, 4]),
                  **({"tie_word_embeddings": True} if tied else {}))
    job = JobSpec(batch_size=rng.randint(1, 4), seq_len=rng.choice([128, 512, 1024]),
                  grad_accum=rng.choice([1, 1, 3]), mode=rng.choice(["full", "lora"]),
                  optimizer_state_bits=rng.choice([8, 32]))
    costs0 = job_costs(model, hw(device_memory_gib=100), job)
    total_act = sum(c.act_bytes for c in costs0.layers) + costs0.device_static_bytes
    total_params = sum(c.param_bytes for c in costs0.layers)
    device = (total_act + total_params) * rng.uniform(0.35, 1.2) / GiB
    h = hw(device_memory_gib=max(device, 0.02), h2d_gbps=rng.uniform(0.05, 20), d2h_gbps=rng.uniform(0.05, 20),
           nvme_read_gbps=rng.uniform(0.02, 3), nvme_write_gbps=rng.uniform(0.02, 3),
           device_tflops=rng.uniform(0.5, 50), host_memory_gib=rng.choice([1.0, 64.0]),
           host_reserve_gib=0.0, optimizer_overlaps_compute=rng.random() < 0.7,
           nvme_full_duplex=rng.random() < 0.5)
    job = replace(job, clip_grad=rng.random() < 0.5)
    # drawn last, so the problems above stay what they were: the CPU as the device, where copies
    # take compute time and NVMe reads land in device memory
    h = replace(h, device_type="cpu" if rng.random() < 0.4 else "cuda")
    return model, h, job


def _close(a, b, tol=0.01):
    return abs(a - b) <= tol * max(abs(a), abs(b)) + 1e-12


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("seed", range(18))
def test_milp_agrees_with_simulator(seed, tied, make_llama, make_hw):
    rng = random.Random(seed)
    model, h, job = _random_problem(rng, make_llama, make_hw, tied=tied)
    costs = job_costs(model, h, job)
    r = solve_milp(costs, h, max_segment_len=rng.choice([2, 4, 8]), time_limit_s=20)
    if r.status == "infeasible":
        pytest.skip("random budget infeasible")  # the infeasible path has its own tests
    tl = simulate(costs, r.assignment, h)
    assert _close(r.objective_s, tl.step_time_s), (r.objective_s, tl.step_time_s)
    for tier in ("device", "host", "nvme"):
        assert _close(r.peak_bytes[tier], tl.peak_bytes[tier]) or abs(r.peak_bytes[tier] - tl.peak_bytes[tier]) < 4096, tier
    assert tl.peak_bytes["device"] <= h.device_memory_bytes * 1.0001


def test_enough_seeds_are_feasible(make_llama, make_hw):
    feasible = 0
    for seed in range(14):
        model, h, job = _random_problem(random.Random(seed), make_llama, make_hw)
        r = solve_milp(job_costs(model, h, job), h, time_limit_s=20)
        feasible += r.status != "infeasible"
    assert feasible >= 8


def test_pinned_plan_is_evaluated_like_the_simulator(small):
    model, h, job = small
    costs = job_costs(model, h, job)
    L = model.num_layers
    segs = (Segment(0, 2, RECOMPUTE, "host"), Segment(2, 3, STORE, "device"), Segment(3, 4, STORE, "nvme"),
            Segment(4, 6, RECOMPUTE, "device"))
    pins = Pins(segments=segs, param_tier=("host",) + ("nvme",) * L + ("device",),
                optimizer_tier=("host",) * (L + 2))
    r = solve_milp(costs, h, pins=pins, device_capacity_bytes=10 * GiB,
                   minimize="time")
    h_big = replace(h, device_memory_gib=10)
    r = solve_milp(job_costs(model, h_big, job), h_big, pins=pins)
    assert r.status == "optimal"
    assert r.assignment.segments == segs
    tl = simulate(job_costs(model, h_big, job), r.assignment, h_big)
    assert _close(r.objective_s, tl.step_time_s)
    assert _close(r.peak_bytes["device"], tl.peak_bytes["device"])


@pytest.mark.parametrize("budget_gib", [0.12, 0.3, 2.0])
def test_milp_never_worse_than_any_heuristic(small, budget_gib):
    model, h, job = small
    h = replace(h, device_memory_gib=budget_gib)
    costs = job_costs(model, h, job)
    best = solve_milp(costs, h, mip_gap=1e-4)
    for name in HEURISTICS:
        r = solve_milp(costs, h, pins=heuristic_pins(name, model.num_layers), mip_gap=1e-4)
        if r.status == "infeasible":
            continue
        assert best.status != "infeasible", name
        assert best.objective_s <= r.objective_s * (1 + 1e-3), name


def test_more_device_memory_is_never_slower(small):
    model, h, job = small
    times = []
    for gib in (0.1, 0.2, 0.4, 0.8, 1.6):
        hh = replace(h, device_memory_gib=gib)
        r = solve_milp(job_costs(model, hh, job), hh, mip_gap=1e-4)
        times.append(r.objective_s if r.status != "infeasible" else float("inf"))
    assert all(b <= a * (1 + 2e-3) for a, b in zip(times, times[1:])), times
    assert times[-1] < float("inf")


def test_tight_budget_forces_recompute_or_offload(small):
    model, h, job = small
    roomy = replace(h, device_memory_gib=4)
    # (the optimum, not a plan within the default 1e-3 gap: recompute that costs no step time
    # differs from storing only in the tie-breakers, ~2e-4 of the objective here)
    r = solve_milp(job_costs(model, roomy, job), roomy, mip_gap=1e-6)
    assert all(s.mode == STORE and s.tier == "device" for s in r.assignment.segments)
    # the least device memory any plan that keeps every activation on the device needs
    need = solve_milp(job_costs(model, roomy, job), roomy, minimize="device_peak",
                      pins=heuristic_pins("no-checkpoint", model.num_layers)).peak_bytes["device"]
    tight = replace(h, device_memory_gib=0.8 * need / GiB)
    r = solve_milp(job_costs(model, tight, job), tight)
    assert r.status != "infeasible"
    assert any(s.mode == RECOMPUTE or s.tier != "device" for s in r.assignment.segments)


def test_cbc_and_highs_agree(small):
    model, h, job = small
    h = replace(h, device_memory_gib=0.15)
    costs = job_costs(model, h, job)
    a = solve_milp(costs, h, solver="highs", mip_gap=1e-4)
    b = solve_milp(costs, h, solver="cbc", mip_gap=1e-4)
    assert (a.solver_name, b.solver_name) == ("highs", "cbc")
    assert a.status != "infeasible" and b.status != "infeasible"
    assert _close(a.objective_s, b.objective_s, tol=2e-3)


def test_half_duplex_drive_serialises_reads_and_writes(make_llama, make_hw):
    """A window that reads and writes NVMe takes read_s + write_s on a half-duplex drive (this
    project's machines) and max(read_s, write_s) on a full-duplex one; the MILP agrees."""
    model = make_llama(layers=4, hidden=256, inter=768, vocab=512, heads=4, kv=4)
    job = JobSpec(batch_size=1, seq_len=128, mode="full", optimizer_state_bits=32)
    times = {}
    for duplex in (False, True):
        h = make_hw(device_memory_gib=100, nvme_read_gbps=0.01, nvme_write_gbps=0.01, device_tflops=50,
                    nvme_full_duplex=duplex)
        costs = job_costs(model, h, job)
        pins = Pins(param_tier=("nvme",) * 6, optimizer_tier=("nvme",) * 6)
        r = solve_milp(costs, h, pins=pins, time_limit_s=20)
        tl = simulate(costs, r.assignment, h)
        assert _close(r.objective_s, tl.step_time_s)
        times[duplex] = tl.step_time_s
    # NVMe-bound: the optimizer state is read and written back in the same windows
    assert times[False] > 1.3 * times[True]


def test_clipped_updates_wait_for_the_backward_and_overlap_the_next_forward(make_llama, make_hw):
    """With clipping every update waits for the global norm: the simulator runs them after the
    backward, layer j's during the forward of layer j - 1 (each done before its layer's forward),
    the embedding's at the end; without, right after each layer's backward. An optimizer-bound
    job (an update takes longer than a layer's forward) is slower clipped: the
    updates hide behind the forwards, not the longer backwards. The MILP agrees."""
    from lazytrain.plan.ops import bwd_window

    model = make_llama(layers=4, hidden=256, inter=768, vocab=512, heads=4, kv=4)
    h = make_hw(device_memory_gib=100, device_tflops=0.05, host_memory_gbps=1, optimizer_overlaps_compute=True)
    L, times = model.num_layers, {}
    for clip in (False, True):
        job = JobSpec(batch_size=1, seq_len=128, mode="full", clip_grad=clip)
        costs = job_costs(model, h, job)
        r = solve_milp(costs, h, pins=Pins(param_tier=("device",) * (L + 2)), time_limit_s=20)
        tl = simulate(costs, r.assignment, h)
        assert _close(r.objective_s, tl.step_time_s)
        times[clip] = tl.step_time_s
        ev = {(e.kind, e.layer): e for e in tl.events if e.micro_batch == 0}
        bwd_end = max(e.end_s for e in tl.events if e.kind == "compute_bwd")
        for j, c in enumerate(costs.layers):
            opt = ev["optimizer", c.name]
            if not clip:
                assert opt.start_s >= ev["compute_bwd", c.name].end_s - 1e-12
            elif j == 0:
                assert opt.start_s >= ev["compute_bwd", c.name].start_s   # the last window
            else:
                assert opt.end_s <= ev["compute_fwd", c.name].start_s + 1e-12   # before its forward
                assert opt.start_s >= ev["compute_fwd", costs.layers[j - 1].name].start_s - 1e-12
        assert bwd_end > 0 and bwd_window(L, 0) == 2 * L + 2
    assert times[True] > 1.1 * times[False]


def test_cpu_device_copies_take_compute_time(small):
    """On a CPU device a host-tier fetch or offload is a memcpy by the computing cores: the
    simulator puts it on the compute lane (nothing there overlaps), an NVMe-tier layer or
    activation needs no copy after its read, and the MILP's pinned evaluation agrees."""
    model, h, job = small
    L = model.num_layers
    segs = (Segment(0, 2, RECOMPUTE, "host"), Segment(2, 3, STORE, "device"), Segment(3, 4, STORE, "nvme"),
            Segment(4, 6, RECOMPUTE, "device"))
    # (blocks ordered device < host < nvme: the MILP's symmetry breaking)
    tiers = ("host",) + ("host",) * (L // 2) + ("nvme",) * (L - L // 2) + ("device",)
    pins = Pins(segments=segs, param_tier=tiers, optimizer_tier=("host",) * (L + 2))
    times = {}
    for device_type in ("cuda", "cpu"):
        hh = replace(h, device_type=device_type, device_memory_gib=10, host_memory_gib=64)
        costs = job_costs(model, hh, job)
        r = solve_milp(costs, hh, pins=pins)
        assert r.status == "optimal"
        tl = simulate(costs, r.assignment, hh)
        assert _close(r.objective_s, tl.step_time_s), device_type
        times[device_type] = tl.step_time_s
        h2d = [e for e in tl.events if e.kind == "h2d"]
        nvme_layers = {costs.layers[j].name for j, t in enumerate(tiers) if t == "nvme"}
        copied_nvme = [e for e in h2d if e.what == "params" and e.layer in nvme_layers]
        if device_type == "cuda":
            assert copied_nvme
            continue
        assert not copied_nvme
        assert [e for e in h2d if e.what == "params"]   # the host-tier layers are still copied
        lane = sorted((e.start_s, e.end_s) for e in tl.events
                      if e.kind in ("compute_fwd", "compute_bwd", "recompute", "h2d", "d2h"))
        assert all(b[0] >= a[1] - 1e-12 for a, b in zip(lane, lane[1:])), "compute-lane events overlap"
    assert times["cpu"] > times["cuda"]   # same rates: copies no longer hide behind compute


@pytest.mark.parametrize("seed", range(10))
def test_simplify_step_time_is_the_simulators(seed, make_llama, make_hw):
    """simplify's quick step time (no events) queues items as the simulator does: a half-duplex
    drive's reads and writes on one lane, a CPU device's copies on the compute lane."""
    from lazytrain.plan.simplify import step_time_s
    rng = random.Random(seed)
    model, h, job = _random_problem(rng, make_llama, make_hw)
    costs = job_costs(model, h, job)
    r = solve_milp(costs, h, time_limit_s=20)
    if r.status == "infeasible":
        pytest.skip("random budget infeasible")
    for depth in (1, 2):
        assert _close(step_time_s(costs, r.assignment, h, depth), simulate(costs, r.assignment, h, depth).step_time_s)
