"""StreamingExecutor.eval_loss: forward only, streaming the layers as training does. It equals the
plain model's loss with the weights trained so far, in every plan family; it changes nothing of
the training that follows; it leaves no device bytes counted; dropout is off while it runs."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain.runtime import StreamingExecutor
from lazytrain.runtime.testing import hand_plan, plan_families, random_batches, tiny_model

PLANS = tuple(plan_families(3))


def _executor(model, plan_name, tmp_path, sub):
    plan = hand_plan(model.config.num_hidden_layers, **plan_families(3)[plan_name])
    (tmp_path / sub).mkdir(exist_ok=True)
    return StreamingExecutor(copy.deepcopy(model), plan, device="cpu", nvme_dir=tmp_path / sub, lr=1e-2,
                             max_grad_norm=1.0)


@pytest.mark.parametrize("family", ["llama", "mixtral", "llama-tied"])
@pytest.mark.parametrize("plan_name", PLANS)
def test_eval_loss_is_the_models_loss_and_leaves_training_as_it_was(family, plan_name, tmp_path):
    model = tiny_model(family)
    steps = [random_batches(2, seed=s) for s in range(3)]
    held = random_batches(1, seed=99)[0]
    ex, ref = _executor(model, plan_name, tmp_path, "a"), _executor(model, plan_name, tmp_path, "b")
    for mbs in steps[:2]:
        ex.train_step(mbs)
        ref.train_step(mbs)
    def counted():   # (streaming buffers a CPU device keeps for reuse stay within the plan's reserve)
        return {k: v for k, v in ex.acct.by_kind.items() if k != "params_streamed" and v}

    live = counted()
    got = ex.eval_loss(*held)
    assert counted() == live   # nothing left counted
    assert ex.streamer._pool_bytes <= ex.streamer._cap
    assert ex.model.training
    # the plain model with the weights trained so far (the queued updates included)
    synced = copy.deepcopy(ref.sync_model())
    with torch.no_grad():
        want = synced(input_ids=held[0], labels=held[1]).loss.item()
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    # the next step is the one a run without the evaluation takes, bit for bit
    a, b = ex.train_step(steps[2]), ref.train_step(steps[2])
    assert a.loss == b.loss and a.grad_norm == b.grad_norm
    ex.wait()
    ref.wait()
    for (n, p), (_, q) in zip(ex.sync_model().named_parameters(), ref.sync_model().named_parameters()):
        assert torch.equal(p, q), n
    ex.close()
    ref.close()


def test_eval_loss_runs_without_dropout(tmp_path):
    model = tiny_model("llama", attention_dropout=0.5)
    ex = _executor(model, "params_host", tmp_path, "a")
    held = random_batches(1, seed=5)[0]
    first, again = ex.eval_loss(*held), ex.eval_loss(*held)
    assert first == again   # dropout would draw other masks
    with torch.no_grad():
        want = copy.deepcopy(model).eval()(input_ids=held[0], labels=held[1]).loss.item()
    assert abs(first - want) <= 1e-5 * abs(want)
    ex.close()


def test_eval_loss_refuses_mismatched_shapes(tmp_path):
    ex = _executor(tiny_model("llama"), "all_resident", tmp_path, "a")
    ids, labels = random_batches(1, seed=5)[0]
    with pytest.raises(ValueError, match="input_ids and labels must both be"):
        ex.eval_loss(ids, labels[:, :-1])
    ex.close()
