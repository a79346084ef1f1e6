"""Routing predictors: which experts will the next layer(s) want? They only decide what to *load*;
routing stays the model's own, so a wrong guess costs a read, never correctness.

- SpeculativeGate: layer l+j's router applied to layer l's router input (no training;
  mixtral-offloading's trick). Also serves lookahead j >= 2 for the trained predictor.
- TrainedPredictor (Edge0's prerouter, simplified): per layer a small head on [hidden state,
  one-hot of the current top-k] whose output is *added* to the speculative gate's logits; the
  head's last layer starts at zero, so before training it is exactly the speculative gate.
- Oracle: the recorded future routing (benchmark bound only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..storage.filemode import share_like_umask
from .arch import MoeLayer

Prediction = list[tuple[int, list[int]]]   # (target MoE layer, experts), nearest layer first


class Predictor(Protocol):
    name: str

    def predict(self, layer: int, x: torch.Tensor, topk: torch.Tensor, step: int) -> Prediction: ...


def _top(logits: torch.Tensor, width: int) -> list[int]:
    # logits [T, E]; the union over tokens of each token's top `width`
    idx = logits.topk(min(width, logits.shape[-1]), dim=-1).indices
    return idx[0].tolist() if idx.shape[0] == 1 else torch.unique(idx).tolist()


class SpeculativeGate:
    name = "gate"

    def __init__(self, layers: list[MoeLayer], lookahead: int = 1, extra: int = 0) -> None:
        self.weights = [ml.router.weight.detach() for ml in layers]
        self.top_k = [ml.top_k for ml in layers]
        self.lookahead, self.extra = lookahead, extra

    def logits(self, target: int, x: torch.Tensor) -> torch.Tensor:
        w = self.weights[target]
        return F.linear(x.to(w.dtype), w)

    def predict(self, layer: int, x: torch.Tensor, topk: torch.Tensor, step: int) -> Prediction:
        out = []
        for j in range(1, self.lookahead + 1):
            t = layer + j
            if t >= len(self.weights):
                break
            out.append((t, _top(self.logits(t, x), self.top_k[t] + self.extra)))
        return out


class PredictorHeads(nn.Module):
    """Per source layer l (0..L-2): MLP([x_l, onehot(topk_l)]) -> residual logits for layer l+1."""

    def __init__(self, hidden_size: int, experts: list[int], width: int = 128) -> None:
        super().__init__()
        self.hidden_size, self.experts, self.width = hidden_size, list(experts), width
        self.meta: dict = {}   # what the file recorded besides the shapes (routers_crc32, recalls)
        self.heads = nn.ModuleList()
        for l in range(len(experts) - 1):
            head = nn.Sequential(nn.Linear(hidden_size + experts[l], width), nn.SiLU(),
                                 nn.Linear(width, experts[l + 1]))
            nn.init.zeros_(head[2].weight)
            nn.init.zeros_(head[2].bias)
            self.heads.append(head)

    def features(self, l: int, x: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        onehot = torch.zeros(x.shape[0], self.experts[l], dtype=torch.float32, device=x.device)
        onehot.scatter_(1, topk.long(), 1.0)
        return torch.cat([x.float(), onehot], dim=-1)

    def forward(self, l: int, x: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        return self.heads[l](self.features(l, x, topk))

    def save(self, path: str | Path, meta: dict | None = None) -> Path:
        from safetensors.torch import save_file

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        info = {"hidden_size": self.hidden_size, "experts": self.experts, "width": self.width, **(meta or {})}
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(p),
                  metadata={"lazytrain_predictor": json.dumps(info)})
        share_like_umask(p)   # safetensors writes its files 0600 (see storage/filemode.py)
        return p

    @staticmethod
    def load(path: str | Path) -> "PredictorHeads":
        from safetensors import SafetensorError, safe_open

        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"predictor {p} does not exist; train one with "
                                    "`lazytrain moe train-predictor ... out=FILE`")
        try:
            with safe_open(str(p), "pt") as f:
                raw = (f.metadata() or {}).get("lazytrain_predictor")
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as e:
            raise ValueError(f"predictor {p} is not a readable safetensors file ({e}); retrain it") from None
        if raw is None:
            raise ValueError(f"{p} is not a lazytrain routing predictor (no metadata)")
        try:
            info = json.loads(raw)
            heads = PredictorHeads(info["hidden_size"], info["experts"], info["width"])
            heads.load_state_dict(tensors)
            heads.meta = info
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            # metadata that does not parse or does not match the tensors (load_state_dict's size
            # mismatches are RuntimeErrors): a damaged or hand-edited file, one line, not a traceback
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"predictor {p} is damaged ({detail[:200]}); retrain it") from None
        return heads.eval()


def routers_crc32(layers: list[MoeLayer]) -> int:
    """crc32 of every MoE layer's router weights, rounded to bf16: which model a predictor was
    trained on, whatever dtype its store holds (fp32 and bf16 stores of one model agree; hashed in
    their own dtypes they did not, and a predictor was refused on the other: a review)."""
    import zlib

    crc = 0
    for ml in layers:
        w = ml.router.weight.detach().to("cpu", torch.bfloat16).contiguous()
        crc = zlib.crc32(w.view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


class TrainedPredictor:
    name = "predictor"

    def __init__(self, heads: PredictorHeads, layers: list[MoeLayer], lookahead: int = 1,
                 extra: int = 0) -> None:
        if heads.experts != [ml.num_experts for ml in layers]:
            raise ValueError(f"predictor was trained for experts {heads.experts}, model has "
                             f"{[ml.num_experts for ml in layers]}; retrain it for this model")
        hidden = layers[0].router.weight.shape[1]     # router weight [num_experts, hidden]
        if heads.hidden_size != hidden:                # else a shape error mid-generation
            raise ValueError(f"predictor was trained for hidden size {heads.hidden_size}, model has "
                             f"{hidden}; retrain it for this model")
        want = heads.meta.get("routers_crc32")
        if want is not None and int(want) != routers_crc32(layers):
            # (same shapes, other model: accepted before 2026-12-02, with a hit rate of 0.53
            # instead of 0.63 in a review's case; tokens stay exact either way)
            raise ValueError("predictor was trained for another model (its routers' weights differ from this "
                             "one's); retrain it for this model: `lazytrain moe train-predictor ...`")
        self.heads, self.gate = heads, SpeculativeGate(layers, lookahead, extra)
        self.top_k = [ml.top_k for ml in layers]
        self.extra = extra
        self._fused_cache: dict[int, tuple[torch.Tensor, ...]] = {}

    @torch.no_grad()
    def _fused(self, l: int) -> tuple[torch.Tensor, ...]:
        """Per source layer: [router_{l+1}; W1_x] stacked (one matvec for gate and head), W1's one-hot
        columns as rows (the one-hot product becomes a gather), b1, W2, b2."""
        f = self._fused_cache.get(l)
        if f is None:
            head = self.heads.heads[l]
            w1, b1 = head[0].weight.float(), head[0].bias.float()
            hsz = self.heads.hidden_size
            f = (torch.cat([self.gate.weights[l + 1].float(), w1[:, :hsz]]),
                 w1[:, hsz:].t().contiguous(), b1, head[2].weight.float(), head[2].bias.float())
            self._fused_cache[l] = f
        return f

    @torch.no_grad()
    def next_layer_logits(self, l: int, x: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        """gate logits + head output for layer l+1; x [T, H], topk [T, k] -> [T, E]."""
        wcat, w1oh, b1, w2, b2 = self._fused(l)
        y = x.float() @ wcat.t()                                  # [T, E + width]
        e = wcat.shape[0] - w1oh.shape[1]
        h = F.silu(y[:, e:] + b1 + w1oh[topk.long()].sum(1))      # [T, width]
        return torch.addmm(b2, h, w2.t()) + y[:, :e]

    @torch.no_grad()
    def predict(self, layer: int, x: torch.Tensor, topk: torch.Tensor, step: int) -> Prediction:
        if layer + 1 >= len(self.top_k):
            return []
        first = (layer + 1, _top(self.next_layer_logits(layer, x, topk), self.top_k[layer + 1] + self.extra))
        if self.gate.lookahead <= 1:
            return [first]
        return [first] + self.gate.predict(layer, x, topk, step)[1:]


class Oracle:
    """The true future routing (from a previous identical run); benchmark bound only."""

    name = "oracle"

    def __init__(self, future: list[tuple[int, tuple[int, ...]]], lookahead: int = 1) -> None:
        self.future, self.lookahead = future, lookahead

    def predict(self, layer: int, x: torch.Tensor, topk: torch.Tensor, step: int) -> Prediction:
        out = []
        for j in range(1, self.lookahead + 1):
            if step + j < len(self.future) and self.future[step + j][0] == layer + j:
                out.append((layer + j, list(self.future[step + j][1])))
        return out


def train_heads(traces: list[tuple[torch.Tensor, torch.Tensor]], layers: list[MoeLayer],
                steps: int = 300, lr: float = 3e-3, batch: int = 512, width: int = 128,
                seed: int = 0, log=None) -> PredictorHeads:
    """Fit the heads on router traces: traces[l] = (x_l [N, H], topk_l [N, k]) with row i the same
    token in every layer. Loss: BCE of (gate logits + head) against the next layer's top-k."""
    torch.manual_seed(seed)
    heads = PredictorHeads(traces[0][0].shape[1], [ml.num_experts for ml in layers], width)
    gate = SpeculativeGate(layers)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    n = traces[0][0].shape[0]
    base = [gate.logits(l + 1, traces[l][0]).float() for l in range(len(layers) - 1)]
    targets = []
    for l in range(len(layers) - 1):
        t = torch.zeros(n, layers[l + 1].num_experts)
        t.scatter_(1, traces[l + 1][1].long(), 1.0)
        targets.append(t)
    for it in range(steps):
        idx = torch.randint(0, n, (min(batch, n),))
        loss = 0.0
        for l in range(len(layers) - 1):
            x, tk = traces[l][0][idx], traces[l][1][idx]
            logits = base[l][idx] + heads(l, x, tk)
            loss = loss + F.binary_cross_entropy_with_logits(logits, targets[l][idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log is not None and (it % 100 == 0 or it == steps - 1):
            log(f"predictor step {it}: loss {loss.item() / max(len(layers) - 1, 1):.4f}")
    return heads.eval()


@torch.no_grad()
def recall_at_k(predict_fn, traces, layers: list[MoeLayer]) -> float:
    """Fraction of the next layer's routed experts inside the predicted top-k (per token)."""
    hit = total = 0
    for l in range(len(layers) - 1):
        x, tk = traces[l]
        pred = predict_fn(l, x, tk).topk(layers[l + 1].top_k, dim=-1).indices   # [N, k]
        true = traces[l + 1][1]
        hit += (pred.unsqueeze(-1) == true.unsqueeze(-2)).any(-1).sum().item()
        total += true.numel()
    return hit / max(total, 1)
