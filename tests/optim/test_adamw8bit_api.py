"""AdamW8bit as a torch.optim.Optimizer: copying and pickling, loading checkpoints across param
dtypes, edits to param_groups between steps, add_param_group, load_state_dict hooks, and group
options it does not implement."""

import copy
import io
import pickle

import pytest
import torch

from lazytrain.optim import AdamW8bit

N = 5000  # 8-bit states with min_8bit_numel=1024 and a tail block of 8 at block_size 64


def _param(dtype=torch.float32, seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))


def _grad(p, seed):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(p.shape, generator=g).to(p.dtype)


def _torch_save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize(
    "copier",
    [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o)), _torch_save_load],
    ids=["deepcopy", "pickle", "torch.save"],
)
def test_copied_optimizer_keeps_settings_and_steps_identically(copier):
    p = _param()
    opt = AdamW8bit([p], lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, block_size=64, min_8bit_numel=1024)
    p.grad = _grad(p, 0)
    opt.step()
    p.grad = torch.full_like(p, float("nan"))
    opt.step()  # skipped, counted
    p.grad = None
    opt2 = copier(opt)
    for k in ("max_grad_norm", "block_size", "min_8bit_numel", "backend", "skipped_steps"):
        assert getattr(opt2, k) == getattr(opt, k), k
    assert opt2.skipped_steps == 1
    (q,) = opt2.param_groups[0]["params"]
    assert q is not p and torch.equal(q, p)
    for _ in range(2):
        p.grad, q.grad = _grad(p, 1), _grad(p, 1)
        opt.step(), opt2.step()
        opt.step_params([p]), opt2.step_params([q])
    assert torch.equal(p, q)
    assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in ("qm", "qv", "absmax_m", "absmax_v"))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_fp32_checkpoint_into_bf16_params_gets_a_master_from_the_params(backend):
    p = _param(torch.float32)
    opt = AdamW8bit([p], lr=1e-2, backend=backend, min_8bit_numel=1024)
    p.grad = _grad(p, 0)
    opt.step()
    q = torch.nn.Parameter(p.detach().bfloat16())
    opt2 = AdamW8bit([q], lr=1e-2, backend=backend, min_8bit_numel=1024)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    master = opt2.state[q]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, q.detach().float().reshape(-1))
    before = q.detach().clone()
    q.grad = _grad(q, 1)
    opt2.step()
    assert not torch.equal(q, before)
    assert torch.equal(q.detach().reshape(-1), opt2.state[q]["master"].bfloat16())


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_bf16_checkpoint_into_fp32_params_updates_the_params_not_the_stale_master(backend):
    p = _param(torch.bfloat16)
    opt = AdamW8bit([p], lr=1e-2, backend=backend, min_8bit_numel=1024)
    p.grad = _grad(p, 0)
    opt.step()
    q = torch.nn.Parameter(p.detach().float() + 0.5)  # e.g. weights restored from elsewhere
    opt2 = AdamW8bit([q], lr=1e-2, backend=backend, min_8bit_numel=1024)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert "master" not in opt2.state[q]
    before = q.detach().clone()
    q.grad = _grad(q, 1)
    opt2.step()
    moved = (q.detach() - before).abs()
    assert 0 < moved.max() < 0.05  # one Adam step of lr 1e-2, from the fp32 params


def test_load_state_dict_names_the_parameter_whose_state_does_not_fit():
    w, b = _param(seed=0), _param(seed=1, n=100)
    opt = AdamW8bit([("layer.w", w), ("layer.b", b)], lr=1e-2, block_size=64, min_8bit_numel=1024)
    w.grad, b.grad = _grad(w, 0), _grad(b, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["absmax_m"] = sd["state"][0]["absmax_m"][:-1]
    w2, b2 = _param(seed=0), _param(seed=1, n=100)
    opt2 = AdamW8bit([("layer.w", w2), ("layer.b", b2)], lr=1e-2, block_size=64, min_8bit_numel=1024)
    with pytest.raises(ValueError, match="layer.w.*absmax_m"):
        opt2.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][1]["exp_avg"] = sd["state"][1]["exp_avg"].bfloat16()
    with pytest.raises(ValueError, match="layer.b.*exp_avg"):
        opt2.load_state_dict(sd)


def test_popping_or_reordering_param_groups_uses_each_params_own_group():
    a, b = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8))
    opt = AdamW8bit([dict(params=[a], lr=0.0), dict(params=[b], lr=0.1)], weight_decay=0.0)
    a.grad, b.grad = torch.ones(8), torch.ones(8)
    opt.step()
    opt.param_groups.pop(0)  # freeze a
    opt.step()
    assert torch.allclose(b.detach(), torch.full((8,), 0.8))

    for entry in ("step", "step_params"):
        a, b = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8))
        opt = AdamW8bit([dict(params=[a], lr=0.0), dict(params=[b], lr=0.1)], weight_decay=0.0)
        a.grad, b.grad = torch.ones(8), torch.ones(8)
        opt.step_params([a, b])  # fills the per-layer cache
        opt.param_groups.reverse()
        opt.step() if entry == "step" else opt.step_params([a, b])
        assert torch.equal(a.detach(), torch.ones(8)), entry
        assert torch.allclose(b.detach(), torch.full((8,), 0.8)), entry
        opt.param_groups.pop(0)  # b's group
        with pytest.raises(ValueError, match="does not belong"):
            opt.step_params([b])


def test_add_param_group_rejects_unsupported_dtype_without_adding_it():
    p = torch.nn.Parameter(torch.ones(8))
    opt = AdamW8bit([p], lr=0.1)
    h = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
    with pytest.raises(TypeError, match="float16"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(8)), h]})
    assert len(opt.param_groups) == 1
    q, r = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt.add_param_group({"params": (x for x in (q, r)), "lr": 0.5})  # any iterable, read once
    assert opt.param_groups[1]["params"] == [q, r]


def test_load_state_dict_runs_pre_and_post_hooks():
    p = _param(n=64)
    opt = AdamW8bit([p], lr=0.1)
    p.grad = _grad(p, 0)
    opt.step()
    calls = []

    def pre(o, sd):
        assert o is opt
        calls.append("pre")
        sd = dict(sd, param_groups=[dict(g, lr=0.25) for g in sd["param_groups"]])
        return sd

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("post", o.param_groups[0]["lr"])))
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert calls == ["pre", ("post", 0.25)]
    assert sd["param_groups"][0]["lr"] == 0.1  # the caller's dict is not modified


@pytest.mark.parametrize("option", ["maximize", "amsgrad", "capturable", "differentiable"])
def test_unsupported_group_options_are_rejected_not_ignored(option):
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    with pytest.raises(TypeError, match=option):
        AdamW8bit([dict(params=[p], **{option: True})], lr=0.1)
    opt = AdamW8bit([dict(params=[p], **{option: False})], lr=0.1)  # the default is harmless
    with pytest.raises(TypeError, match=option):
        opt.add_param_group(dict(params=[q], **{option: True}))
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("key, value", [("max_grad_norm", 1e-3), ("block_size", 64), ("min_8bit_numel", 0),
                                        ("backend", "torch")])
def test_optimizer_wide_settings_in_a_group_are_refused(key, value):
    """A group with its own max_grad_norm was not clipped by it, nor block_size honoured: they
    are settings of the whole optimizer, and a group key is refused, not ignored (review)."""
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    with pytest.raises(TypeError, match=f"{key} is a setting of the whole optimizer"):
        AdamW8bit([dict(params=[p], **{key: value})], lr=0.1)
    opt = AdamW8bit([p], lr=0.1, **{key: value})   # where it belongs
    with pytest.raises(TypeError, match=key):
        opt.add_param_group(dict(params=[q], **{key: value}))
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("key", ["qm", "master", "exp_avg"])
def test_state_on_another_device_than_its_parameter_is_refused(key):
    """A model moved with .to() after some steps leaves its state behind: the C++ kernel would
    read a CUDA state's pointer on the host. Refused by name before anything moves (review; the
    'meta' device stands in for another device here)."""
    big = torch.nn.Parameter(torch.randn(8192).bfloat16())
    small = torch.nn.Parameter(torch.randn(16))
    opt = AdamW8bit([big, small], lr=1e-2)
    big.grad, small.grad = torch.randn(8192).bfloat16(), torch.randn(16)
    opt.step()
    p = small if key == "exp_avg" else big
    opt.state[p][key] = opt.state[p][key].to("meta")
    before = big.detach().clone()
    with pytest.raises(RuntimeError, match=f"{key} is on meta"):
        opt.step()
    assert torch.equal(big.detach(), before) and opt.state[big]["step"] == 1


@pytest.mark.gpu
def test_global_norm_over_params_on_cpu_and_cuda():
    """Gradients on two devices are summed per device (the C++ kernel reads CPU memory only: handed
    a CUDA pointer it would read garbage or crash)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(70_000, generator=g))
    b = torch.nn.Parameter(torch.randn(50_000, generator=g).cuda())
    a.grad, b.grad = torch.randn(70_000, generator=g), torch.randn(50_000, generator=g).cuda()
    opt = AdamW8bit([a, b], lr=1e-3, max_grad_norm=1.0)
    expect = a.grad.double().pow(2).sum() + b.grad.double().pow(2).sum().cpu()
    got = opt.grad_sq_sum([a, b])
    assert got.device.type == "cpu"
    assert abs(float(got) - float(expect)) <= 1e-5 * float(expect)


def test_clip_factor_of_a_huge_spike_still_updates_v():
    """The fused pass folds the clip factor into clip**2 * (1 - b2), which underflows fp32 for a
    spike ~1e12+ times max_grad_norm: v would lose the step's gradient. Such a step scales the
    gradients by 2**-k first and the clip factor by 2**k (the same products, bit for bit, as an
    unshifted pass with the shifted-in factor), leaves p.grad as it was, and lands where
    clip_grad_norm_ then an unclipped step does, within the folding's rounding."""
    import math

    g = torch.Generator().manual_seed(0)
    w = torch.randn(70_000, generator=g)
    spike = torch.randn(70_000, generator=g) * 1e15
    a, b, c = (torch.nn.Parameter(w.clone()) for _ in range(3))
    oa, ob, oc = AdamW8bit([a], lr=1e-3, max_grad_norm=1.0), AdamW8bit([b], lr=1e-3), AdamW8bit([c], lr=1e-3)
    a.grad = spike.clone()
    oa.step()
    clip = oa.clip_scale(spike.double().pow(2).sum().float())
    assert clip < 1e-12
    assert torch.equal(a.grad, spike)                      # untouched
    k = math.ceil(math.log2(1e-12 / clip))
    b.grad = spike * 2.0 ** -k                             # the shift, by hand: no prescale in b's pass
    ob.step_params([b], clip_scale=clip * 2.0 ** k)
    assert torch.equal(a.detach(), b.detach())
    for key in ("qm", "qv", "absmax_m", "absmax_v"):
        assert torch.equal(oa.state[a][key], ob.state[b][key])
    assert float(oa.state[a]["absmax_v"].max()) > 0        # v saw the (clipped) gradient
    c.grad = spike * clip                                  # clip_grad_norm_ then an unclipped step
    oc.step()
    torch.testing.assert_close(a.detach(), c.detach(), rtol=1e-5, atol=1e-6)


# ---- review of 2026-11-30 (evening): torch.optim.AdamW parity of the API ----------------------------
def _pair(shape=(16, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_default_weight_decay_is_torchs():
    """torch.optim.AdamW (and bitsandbytes) default to weight_decay=1e-2; the same call gave other
    weights (3.4e-3 apart after 10 steps at lr 1e-2)."""
    w0, g = _pair((64,))
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours, ref = AdamW8bit([a], lr=1e-2, min_8bit_numel=10**9), torch.optim.AdamW([b], lr=1e-2)
    assert ours.defaults["weight_decay"] == ref.defaults["weight_decay"] == 1e-2
    for _ in range(10):
        a.grad, b.grad = g.clone(), g.clone()
        ours.step(), ref.step()
    assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_non_contiguous_parameters_update_in_memory_order():
    """Channels-last convolutions and transposed views (dense, not contiguous) train as in torch's
    AdamW (fp32 states), and the 8-bit states follow memory order: a transposed view gives the
    same bytes as its contiguous base."""
    conv = torch.nn.Conv2d(8, 16, 3).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(conv)
    x = torch.randn(2, 8, 10, 10).to(memory_format=torch.channels_last)
    ours, theirs = AdamW8bit(conv.parameters(), lr=1e-2, min_8bit_numel=10**9), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        for m, o in ((conv, ours), (ref, theirs)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(conv.weight, ref.weight, atol=1e-6, rtol=0)

    w0, g = _pair((96, 64))
    base = torch.nn.Parameter(w0.clone())
    view = torch.nn.Parameter(w0.clone().t())          # a transposed view of the same bytes
    assert not view.is_contiguous()
    o1, o2 = AdamW8bit([base], lr=1e-2, max_grad_norm=1.0), AdamW8bit([view], lr=1e-2, max_grad_norm=1.0)
    for _ in range(3):
        base.grad, view.grad = g.clone(), g.clone().t()
        o1.step(), o2.step()
    assert torch.equal(view.detach().t(), base.detach())
    assert torch.equal(o2.state[view]["qm"], o1.state[base]["qm"])
    gappy = torch.nn.Parameter(torch.zeros(8)[::2])   # every other element: not dense
    gappy.grad = torch.ones(4)
    with pytest.raises(ValueError, match="not dense"):
        AdamW8bit([gappy]).step()


def test_options_set_on_a_group_later_are_refused_at_the_step():
    """maximize/amsgrad were refused when a group was added, but set afterwards they were ignored
    (the step minimised: 0.093 from torch's maximising result)."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = AdamW8bit([p], lr=0.1)
    opt.param_groups[0]["maximize"] = True
    p.grad = torch.ones(8)
    with pytest.raises(TypeError, match="maximize=True is not supported"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(8)) and not opt.state


def test_a_step_that_raises_changes_nothing():
    """A bad gradient in a later group: the earlier parameters' step counts and weights stay (a
    retried step bias-corrected for t=2 on moments that saw one gradient: 0.744x the update)."""
    good, bad = torch.nn.Parameter(torch.ones(64)), torch.nn.Parameter(torch.ones(16)[::2])
    opt = AdamW8bit([{"params": [good]}, {"params": [bad]}], lr=1e-2)
    good.grad, bad.grad = torch.ones(64), torch.ones(8)             # bad: not dense
    with pytest.raises(ValueError, match="not dense"):
        opt.step()
    assert torch.equal(good.detach(), torch.ones(64)) and opt.state[good].get("step", 0) == 0
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = AdamW8bit([good, *emb.parameters()], lr=1e-2)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert torch.equal(good.detach(), torch.ones(64)) and opt.state[good].get("step", 0) == 0


def test_a_parameter_listed_twice_is_updated_once():
    """The kernels ran both copies at once on the same buffers (not even run-to-run deterministic)
    with the step count advanced twice."""
    w0, g = _pair((4096,))
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    with pytest.warns(UserWarning):   # torch's own warning about duplicates
        twice = AdamW8bit([a, a], lr=1e-2)
    once = AdamW8bit([b], lr=1e-2)
    for _ in range(3):
        a.grad, b.grad = g.clone(), g.clone()
        twice.step(), once.step()
    assert torch.equal(a, b) and twice.state[a]["step"] == 3


def test_torch_compile_of_a_training_step_runs_the_step_eagerly():
    """Dynamo traced into the float32 rounding of the hyper-parameters and recursed without end
    (InternalTorchDynamoError at the first or second step); the step now runs eagerly inside the
    compiled function, with the same result."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        opt = AdamW8bit(model.parameters(), lr=1e-2, max_grad_norm=1.0, min_8bit_numel=64)
        x = torch.randn(4, 16)

        def train_step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        fn = torch.compile(train_step, backend="eager") if compiled else train_step
        for _ in range(3):
            fn()
        results.append(model.weight.detach().clone())
    assert torch.equal(results[0], results[1])


def test_review_fixes_duplicates_in_the_norm_bad_betas_and_another_layout():
    """A parameter listed twice counts once in the clipping norm too; a beta of 1 set on a group
    later fails before any step count moves; a state made for a channels-last parameter is refused
    by one laid out otherwise (flat memory order: loaded as is, it scrambled the weights)."""
    w0, g = _pair((4096,))
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    with pytest.warns(UserWarning):
        twice = AdamW8bit([a, a], lr=1e-2, max_grad_norm=1.0)
    once = AdamW8bit([b], lr=1e-2, max_grad_norm=1.0)
    for _ in range(3):
        a.grad, b.grad = g.clone(), g.clone()
        twice.step(), once.step()
    assert torch.equal(a, b)

    once.param_groups[0]["betas"] = (1.0, 0.999)
    b.grad = g.clone()
    with pytest.raises(ValueError, match="betas must be in"):
        once.step()
    assert once.state[b]["step"] == 3

    conv = torch.nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
    opt = AdamW8bit(conv.parameters(), lr=1e-2, min_8bit_numel=64)
    conv(torch.randn(1, 4, 6, 6)).sum().backward()
    opt.step()
    plain = torch.nn.Conv2d(4, 8, 3)
    plain.load_state_dict(conv.state_dict())
    other = AdamW8bit(plain.parameters(), lr=1e-2, min_8bit_numel=64)
    with pytest.raises(ValueError, match="memory order"):
        other.load_state_dict(opt.state_dict())
    same = AdamW8bit(copy.deepcopy(conv).parameters(), lr=1e-2, min_8bit_numel=64)
    same.load_state_dict(opt.state_dict())   # the same layout loads


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype,before,after", [(torch.float32, 1000, 3000),       # fp32 moments, grown
                                                (torch.bfloat16, 1000, 500),       # + master, shrunk
                                                (torch.float32, 5000, 10000),      # 8-bit states
                                                (torch.bfloat16, 5000, 2500)])
def test_a_parameter_resized_since_its_state_was_made_is_refused(backend, dtype, before, after):
    """The kernels take the state's tensors as they are: a parameter whose .data was replaced by
    one of another size was written out of bounds (heap corruption, a segfault) or half-updated."""
    p = torch.nn.Parameter(torch.randn(before).to(dtype))
    opt = AdamW8bit([p], backend=backend)
    p.grad = torch.randn_like(p)
    opt.step()
    p.data = torch.randn(after).to(dtype)
    p.grad = torch.randn_like(p)
    kept = p.detach().clone()
    with pytest.raises(ValueError, match=r"no longer fits its optimizer state.*needs " + str(after)):
        opt.step()
    assert opt.state[p]["step"] == 1 and torch.equal(p.detach(), kept)
    del opt.state[p]          # what the message offers: the state afresh
    opt.step()
    assert opt.state[p]["step"] == 1 and not torch.equal(p.detach(), kept)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_parameter_recast_since_its_state_was_made_is_refused(backend):
    """model.to(bfloat16) after a step: the C++ path raised a low-level dtype error after the step
    count moved; the torch path updated the bf16 parameter with no fp32 master."""
    p = torch.nn.Parameter(torch.randn(1, 5000))
    opt = AdamW8bit([p], backend=backend)
    p.grad = torch.randn_like(p)
    opt.step()
    p.data = p.data.bfloat16()
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="made for a float32 parameter"):
        opt.step()
    assert opt.state[p]["step"] == 1


def test_a_refused_new_parameter_leaves_no_half_state():
    """A bf16 parameter with gaps is refused at its first step; once made contiguous it steps
    (a half-built {'step': 0} made every later step raise KeyError: 'exp_avg')."""
    p = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16)[:, :64])
    opt = AdamW8bit([p])
    p.grad = torch.randn(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not dense"):
        opt.step()
    assert not opt.state.get(p)
    p.data = p.data.contiguous()
    opt.step()
    assert opt.state[p]["step"] == 1
    AdamW8bit([p]).load_state_dict(opt.state_dict())


def test_bad_min_8bit_numel_and_sparse_gradients_with_clipping_are_refused_clearly():
    with pytest.raises(ValueError, match="min_8bit_numel must be an int >= 0, got None"):
        AdamW8bit([torch.nn.Parameter(torch.randn(4))], min_8bit_numel=None)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        AdamW8bit(emb.parameters(), max_grad_norm=1.0).step()   # (the norm pass failed first)


def test_loading_a_state_of_another_size_says_so_whatever_its_layout():
    src = torch.nn.Parameter(torch.randn(64, 32).t())       # transposed: memory order (1, 0)
    opt = AdamW8bit([src])
    src.grad = torch.randn_like(src)
    opt.step()
    dst = torch.nn.Parameter(torch.randn(16, 16))
    with pytest.raises(ValueError, match="with 256 elements"):
        AdamW8bit([dst]).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("dtype,numel", [(torch.float32, 100), (torch.float32, 8192),
                                         (torch.bfloat16, 100), (torch.bfloat16, 8192)])
def test_a_step_is_an_in_place_change_autograd_sees(backend, dtype, numel):
    """Review: the C++ kernels wrote through data pointers without bumping the parameters' version
    counters, so a backward through a graph that saved a parameter before the step (a step between
    one loss's forward and backward) silently used the new weights; torch's AdamW and the pure-torch
    kernels raise autograd's in-place error, and so does every backend now."""
    p = torch.nn.Parameter(torch.randn(numel).to(dtype))
    opt = AdamW8bit([p], lr=0.1, backend=backend)
    stale = (p * p).sum()   # saves p
    (p ** 3).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()


def test_torch_adamw_calls_run_unchanged():
    """Review: a call written for torch.optim.AdamW (its defaults passed explicitly, fused=True,
    foreach=False, amsgrad as the 6th positional argument) raised a bare 'unexpected keyword'."""
    p = torch.nn.Parameter(torch.randn(64))
    ref = AdamW8bit([p], 1e-3, (0.9, 0.999), 1e-8, 1e-2)
    opt = AdamW8bit([p], 1e-3, (0.9, 0.999), 1e-8, 1e-2, False, maximize=False, foreach=False,
                    capturable=False, differentiable=False, fused=True)
    assert opt.defaults == ref.defaults
    for name in ("amsgrad", "maximize", "capturable", "differentiable"):
        with pytest.raises(TypeError, match=f"{name}=True is not supported"):
            AdamW8bit([p], **{name: True})


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_parameters_over_shared_memory_are_refused_and_disjoint_slices_update(backend):
    """Review: two Parameters over one storage were updated by the C++ kernel in one parallel pass,
    racing (weights differed run to run). Overlapping ones are refused, naming them; disjoint
    slices of one buffer (a flat-parameter layout) update as separate tensors would."""
    base = torch.randn(2 * 8192)
    x, y = torch.nn.Parameter(base), torch.nn.Parameter(base[100:8292])
    opt = AdamW8bit([x, y], lr=0.1, backend=backend)
    x.grad, y.grad = torch.randn_like(x), torch.randn_like(y)
    before = base.clone()
    with pytest.raises(ValueError, match=r"parameters 0 and 1 of this step .* share memory"):
        opt.step()
    assert torch.equal(base, before) and not opt.state   # nothing moved
    buf = torch.randn(2 * 8192)
    a, b = torch.nn.Parameter(buf[:8192]), torch.nn.Parameter(buf[8192:])
    ca, cb = (torch.nn.Parameter(t.detach().clone()) for t in (a, b))
    opt, ref = AdamW8bit([a, b], lr=0.1, backend=backend), AdamW8bit([ca, cb], lr=0.1, backend=backend)
    for p, q in ((a, ca), (b, cb)):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt.step(), ref.step()
    assert torch.equal(a, ca) and torch.equal(b, cb)


def _three_steps(backend: str, n: int, spoil):
    """(weights, state) after three steps of random gradients, `spoil` applied to the second's."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    opt = AdamW8bit([p], backend=backend)
    for s in range(3):
        p.grad = torch.randn(n, generator=g)
        if s == 1:
            spoil(p.grad)
        opt.step()
    return p.detach().clone(), opt.state[p]


@pytest.mark.parametrize("where", [0, 10, 63, 255, 300])
def test_a_nan_gradient_element_nans_that_weight_only_in_every_kernel(where):
    """Review: without clipping, one NaN gradient element made its weight NaN under the C++ kernel
    and torch's AdamW, but the pure-torch kernel's block maximum propagated the NaN and its whole
    256-element block went NaN (the CUDA compiled kernel has the same maximum). The block maxima
    skip NaN in every kernel now, and the kernels agree on every other element and block scale."""
    def spoil(grad):
        grad[where] = float("nan")
    (wa, sa), (wt, st) = (_three_steps(backend, 4096, spoil) for backend in ("auto", "torch"))
    for w in (wa, wt):
        assert w.isnan().nonzero().flatten().tolist() == [where]
    keep = torch.ones(4096, dtype=torch.bool)
    keep[where] = False
    assert torch.equal(wa[keep], wt[keep])
    assert torch.equal(sa["absmax_m"], st["absmax_m"]) and torch.equal(sa["absmax_v"], st["absmax_v"])
    assert torch.equal(sa["qm"][keep], st["qm"][keep]) and torch.equal(sa["qv"][keep], st["qv"][keep])


def test_an_overflowed_v_block_stores_the_same_codes_in_every_kernel():
    """Review: a gradient of 1e19 (no clipping) makes v infinite and its block's maximum inf; the
    other elements normalise to 0 and the inf one to NaN, which the VBMI kernel stored as code 255
    and the torch kernel as 1 (4864 of 5000 codes differed). NaN gets the smallest code everywhere."""
    def spoil(grad):
        grad[::100] = 1e19
    (wa, sa), (wt, st) = (_three_steps(backend, 5000, spoil) for backend in ("auto", "torch"))
    assert torch.equal(wa, wt)
    for k in ("qm", "qv", "absmax_m", "absmax_v"):
        assert torch.equal(sa[k], st[k]), k
