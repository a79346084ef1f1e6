import torch

from lazytrain.moe.arch import find_moe_layers
from lazytrain.moe.predictor import (Oracle, PredictorHeads, SpeculativeGate, TrainedPredictor,
                                     recall_at_k, train_heads)


def _synthetic_traces(layers, n=1024, seed=0):
    """Next layer's experts = current experts + 1 (mod E): invisible to the gate, easy for the heads."""
    g = torch.Generator().manual_seed(seed)
    H = layers[0].router.weight.shape[1]
    first = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(n)])
    traces, tk = [], first
    for _ in layers:
        traces.append((torch.randn(n, H, generator=g), tk))
        tk = (tk + 1) % 8
    return traces


def test_trained_heads_learn_what_the_gate_cannot(tiny_moe, tmp_path):
    layers = find_moe_layers(tiny_moe("mixtral"))
    traces = _synthetic_traces(layers)
    test = _synthetic_traces(layers, n=256, seed=1)
    gate = SpeculativeGate(layers)
    r_gate = recall_at_k(lambda l, x, tk: gate.logits(l + 1, x).float(), test, layers)
    heads = train_heads(traces, layers, steps=250, lr=1e-2, width=64)
    pred = TrainedPredictor(PredictorHeads.load(heads.save(tmp_path / "p.safetensors")), layers)
    r_pred = recall_at_k(lambda l, x, tk: gate.logits(l + 1, x).float() + pred.heads(l, x, tk), test, layers)
    assert r_gate < 0.5 and r_pred > 0.95
    # predict() returns the next layer's experts first, nearest deadline first
    out = pred.predict(0, test[0][0][:1], test[0][1][:1], step=0)
    assert out[0][0] == 1 and sorted(out[0][1]) == sorted(((test[0][1][0] + 1) % 8).tolist())


def test_untrained_heads_equal_the_gate(tiny_moe):
    layers = find_moe_layers(tiny_moe("qwen3_moe"))
    heads = PredictorHeads(64, [ml.num_experts for ml in layers])
    x, tk = torch.randn(3, 64), torch.randint(0, 8, (3, 2))
    gate, pred = SpeculativeGate(layers, lookahead=2), TrainedPredictor(heads, layers, lookahead=2)
    assert gate.predict(1, x, tk, 0) == pred.predict(1, x, tk, 0)
    assert [t for t, _ in gate.predict(1, x, tk, 0)] == [2, 3]
    assert gate.predict(3, x, tk, 0) == []          # nothing after the last layer


def test_oracle_reads_the_future():
    future = [(0, (1, 2)), (1, (3,)), (2, (4, 5)), (0, (6,))]
    o = Oracle(future, lookahead=2)
    assert o.predict(0, None, None, 0) == [(1, [3]), (2, [4, 5])]
    assert o.predict(2, None, None, 2) == []        # next call is layer 0 of the next token


def test_fused_fast_path_equals_heads(tiny_moe):
    layers = find_moe_layers(tiny_moe("mixtral"))
    heads = PredictorHeads(64, [8] * 4)
    torch.manual_seed(0)
    for h in heads.heads:
        torch.nn.init.normal_(h[2].weight)
    pred, gate = TrainedPredictor(heads, layers), SpeculativeGate(layers)
    x = torch.randn(5, 64)
    tk = torch.stack([torch.randperm(8)[:2] for _ in range(5)])   # top-k ids are distinct
    for l in range(3):
        want = gate.logits(l + 1, x).float() + heads(l, x, tk)
        torch.testing.assert_close(pred.next_layer_logits(l, x, tk), want, rtol=1e-5, atol=1e-5)
