"""Python API for streamed MoE generation and predictor training (the CLI is a thin layer on this).

    from lazytrain.moe import generate
    res = generate("STORE_DIR", prompt="def f(", max_new_tokens=64, cache_fraction=0.45)
    print(res.text, res.stats.line())
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .engine import StreamedMoE, load_streamed
from .predictor import PredictorHeads, SpeculativeGate, TrainedPredictor, recall_at_k, routers_crc32, train_heads
from .stats import MoeStats


@dataclass
class GenerateResult:
    token_ids: list[int]          # generated ids only
    text: str | None
    stats: MoeStats               # decode phase (steady state)
    prefill_stats: MoeStats

    def to_json(self) -> dict:
        stats = self.stats.to_json()
        stats.update(prefill_tokens=self.prefill_stats.tokens,
                     prefill_tokens_per_s=self.prefill_stats.tokens_per_s,
                     # the count itself (bytes_per_token x tokens came out 1 byte short: a review)
                     prefill_bytes=self.prefill_stats.extra.get(
                         "bytes_read", round(self.prefill_stats.bytes_per_token * self.prefill_stats.tokens)))
        return {"token_ids": self.token_ids, "text": self.text, "stats": stats}


def load_tokenizer(*dirs: str | Path | None):
    """The first HF tokenizer found in `dirs` (offline), else None."""
    from transformers import AutoTokenizer

    for d in dirs:
        if d is not None and (Path(d).expanduser() / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(Path(d).expanduser()))
    return None


def generate(store: str | Path, *, prompt: str | None = None, prompt_ids: list[int] | None = None,
             max_new_tokens: int = 64, model_path: str | Path | None = None,
             engine: StreamedMoE | None = None, **engine_kwargs) -> GenerateResult:
    """Greedy generation with experts streamed from `store` (see `load_streamed` for options)."""
    if engine is None and not Path(store).expanduser().exists():
        from .store import StoreError

        raise StoreError(f"expert store {store} does not exist; create one with "
                         f"`lazytrain moe convert model.path=HF_DIR out={store}`")
    tok = load_tokenizer(model_path, store)
    if prompt_ids is None:
        if tok is None:
            raise ValueError(f"no tokenizer in {model_path or store}; pass prompt_ids=[...] instead of a prompt")
        prompt_ids = tok(prompt or "", return_tensors="pt").input_ids[0].tolist()
    if not prompt_ids:
        raise ValueError("the prompt is empty; give prompt=TEXT or prompt_ids=[...]")
    own = engine is None
    eng = engine or load_streamed(store, model_path=model_path, **engine_kwargs)
    try:
        eng.reset_stats()
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        out = eng.generate(ids, max_new_tokens)
        new = out[0, ids.shape[1]:].tolist()
        text = tok.decode(new, skip_special_tokens=True) if tok is not None else None
        return GenerateResult(new, text, eng.stats("decode"), eng.stats("prefill"))
    finally:
        if own:
            eng.close()


@torch.no_grad()
def record_traces(eng: StreamedMoE, token_ids: list[int], seq_len: int = 128,
                  max_tokens: int = 20000) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run the streamed model over text (teacher forcing, no generation) and return per MoE layer
    (router input x [N, H], routed top-k [N, k]); row i is the same token in every layer."""
    per_layer: list[list] = [[] for _ in eng.layers]
    eng.record_hidden = []
    try:
        n = min(len(token_ids), max_tokens) // seq_len * seq_len
        for s in range(0, n, seq_len):
            eng.record_hidden.clear()
            eng.model(torch.tensor([token_ids[s:s + seq_len]]), use_cache=False)
            for layer, x, tk in eng.record_hidden:
                per_layer[layer].append((x, tk))
    finally:
        eng.record_hidden = None
    return [(torch.cat([x for x, _ in rows]), torch.cat([t for _, t in rows])) for rows in per_layer]


def train_predictor(eng: StreamedMoE, token_ids: list[int], out: str | Path, *, seq_len: int = 128,
                    max_tokens: int = 20000, steps: int = 400, lr: float = 3e-3, width: int = 128,
                    holdout: float = 0.1, log=print) -> dict:
    """Record traces, fit the next-layer heads, save them; returns held-out recall of the speculative
    gate and of the trained predictor (fraction of next-layer routed experts in the predicted top-k)."""
    if len(eng.layers) < 2:
        raise ValueError(f"the model has {len(eng.layers)} MoE layer(s); a next-layer predictor needs "
                         f"at least 2 (without one, use moe.prefetch=gate or none)")
    for name, v in (("seq_len", seq_len), ("max_tokens", max_tokens), ("steps", steps), ("width", width)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:   # (seq_len=0: a ZeroDivisionError)
            raise ValueError(f"predictor_train.{name} must be a whole number >= 1, got {v!r}")
    if not 0 < holdout < 1:
        raise ValueError(f"predictor_train.holdout must be in (0, 1), got {holdout!r}")
    if max_tokens < seq_len:
        raise ValueError(f"max_tokens={max_tokens} is less than one sequence of seq_len={seq_len}; "
                         f"raise max_tokens or lower seq_len")
    if len(token_ids) < seq_len:
        raise ValueError(f"the training text has {len(token_ids)} tokens, less than one sequence of "
                         f"seq_len={seq_len}; give more text or a smaller seq_len")
    out = Path(out).expanduser()   # (save() would have written a literal ./~ dir)
    if out.is_dir():   # (found after all the training, as a traceback)
        raise ValueError(f"out={out} is a directory; give a file path (e.g. predictor.safetensors)")
    traces = record_traces(eng, token_ids, seq_len, max_tokens)
    n = traces[0][0].shape[0]
    cut = int(n * (1 - holdout)) // seq_len * seq_len
    if not 0 < cut < n:   # (the "held-out" recall was measured on the training tokens)
        raise ValueError(f"{n // seq_len} sequence(s) of seq_len={seq_len} leave none to hold out "
                         f"(holdout={holdout}); give more text, a larger max_tokens or a smaller seq_len")
    train = [(x[:cut], t[:cut]) for x, t in traces]
    test = [(x[cut:], t[cut:]) for x, t in traces]
    heads = train_heads(train, eng.layers, steps=steps, lr=lr, width=width, log=log)
    gate = SpeculativeGate(eng.layers)
    pred = TrainedPredictor(heads, eng.layers)
    r_gate = recall_at_k(lambda l, x, tk: gate.logits(l + 1, x).float(), test, eng.layers)
    r_pred = recall_at_k(pred.next_layer_logits, test, eng.layers)
    heads.save(out, {"train_tokens": cut, "recall_gate": r_gate, "recall_predictor": r_pred,
                     "routers_crc32": routers_crc32(eng.layers)})
    return {"out": str(out), "train_tokens": cut, "test_tokens": n - cut,
            "recall_gate": r_gate, "recall_predictor": r_pred}


__all__ = ["GenerateResult", "generate", "load_tokenizer", "record_traces", "train_predictor",
           "PredictorHeads"]
