"""Per-layer forward / backward time of a model on this machine, in the planner's layer names.

Each execution-order layer (embed, block.i, head) is timed on its own with the model's real block
inputs (masks and rotary embeddings captured from the model's forward), in the compute dtype:
median of `repeats` after one warm-up. The achieved FLOP/s of the blocks against the matmul peak
gives the `efficiency` the cost model multiplies the peak by.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..runtime.malloc import keep_freed_memory
from ..spec import ModelSpec

# every spelling JobSpec accepts (spec.job.COMPUTE_DTYPES)
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
_CACHE_FLUSH_BYTES = 128 << 20   # a pass over this evicts the last level cache (32 MiB here)


@dataclass(frozen=True)
class LayerTime:
    name: str
    fwd_s: float
    bwd_s: float
    flops_fwd: float
    flops_bwd: float


def measure_layers(spec: ModelSpec, batch_size: int, seq_len: int, compute_dtype: str = "bf16",
                   device: torch.device | None = None, repeats: int = 3,
                   max_blocks: int = 2) -> list[LayerTime]:
    """Time embed, the first `max_blocks` blocks (blocks are identical: the rest reuse block.0's
    figure scaled by nothing) and head, forward and backward, on random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models.adapter import block_kwargs, find_parts, run_block

    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    dtype = DTYPES[compute_dtype]
    hf = dict(spec.hf_config)
    n_blocks = min(max_blocks, spec.num_layers)
    hf["num_hidden_layers"] = n_blocks  # weights of only the blocks we time
    # ... and the per-layer lists cut alike (`layer_types`, which transformers >= 4.53 writes into
    # every Qwen2/Qwen3 config, and e.g. `no_rope_layers`): a config checks their length
    for k, v in hf.items():
        if isinstance(v, list) and len(v) == spec.num_layers:
            hf[k] = v[:n_blocks]
    cfg = AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)
    parts = find_parts(model)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    B, S, tokens = batch_size, seq_len, batch_size * seq_len
    kw = block_kwargs(parts, B, S, dtype, device)[0]   # (blocks of another layer type: same cost)
    ids = torch.randint(0, spec.vocab_size, (B, S), device=device)

    # On a CPU device every layer op in a step starts with cold caches: copies, updates and the
    # other layers' weights pass through between one layer's use and the next. Timed with its own
    # weights and inputs cache-hot, a block runs ~5-10% faster than it does there. So on the CPU
    # each timed op here starts after a pass over a buffer larger than the caches.
    scratch = torch.empty(_CACHE_FLUSH_BYTES // 4) if device.type == "cpu" else None
    if device.type == "cpu":
        keep_freed_memory()   # as the executor runs (runtime/malloc.py)

    def cold() -> None:
        if scratch is not None:
            scratch.fill_(1.0)

    def fwd_bwd(f) -> tuple[float, float]:
        """Median forward and backward seconds, each timed on its own (one warm-up first)."""
        fs, bs = [], []
        for r in range(repeats + 1):
            cold()
            sync()
            t0 = time.perf_counter()
            out, _ = f()
            sync()
            t1 = time.perf_counter()
            cold()
            t2 = time.perf_counter()
            out.backward(torch.ones_like(out) if out.dim() else None)
            sync()
            t3 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if r:
                fs.append(t1 - t0)
                bs.append(t3 - t2)
        return statistics.median(fs), statistics.median(bs)

    out: list[LayerTime] = []
    lspecs = {ls.name: ls for ls in spec.layers}

    def embed():
        return parts.embed(ids).float().sum(), None
    f, b = fwd_bwd(embed)
    out.append(LayerTime("embed", f, b, 0.0, 0.0))
    x0 = torch.randn(B, S, spec.hidden_size, device=device, dtype=dtype)
    timed: list[tuple[float, float]] = []
    for i in range(n_blocks):
        blk = parts.blocks[i]

        def block(blk=blk):
            x = x0.detach().requires_grad_(True)
            return run_block(blk, x, kw), x
        timed.append(fwd_bwd(block))
    for i in range(spec.num_layers):
        f, b = timed[min(i, n_blocks - 1)]
        ls = lspecs[f"block.{i}"]
        out.append(LayerTime(f"block.{i}", f, b, ls.flops_fwd(tokens, S), ls.flops_bwd(tokens, S)))
    labels = ids

    def head():
        x = x0.detach().requires_grad_(True)
        logits = parts.head(parts.norm(x))
        return parts.lm.loss_function(logits=logits, labels=labels, vocab_size=parts.vocab_size), x
    f, b = fwd_bwd(head)
    hs = lspecs["head"]
    out.append(LayerTime("head", f, b, hs.flops_fwd(tokens, S), hs.flops_bwd(tokens, S)))
    return out


def achieved_tflops(layers: list[LayerTime]) -> float:
    """FLOP/s over the blocks' forward + backward (the bulk of a step)."""
    blocks = [lt for lt in layers if lt.name.startswith("block.")]
    flops = sum(lt.flops_fwd + lt.flops_bwd for lt in blocks)
    secs = sum(lt.fwd_s + lt.bwd_s for lt in blocks)
    return flops / secs / 1e12 if secs > 0 else 0.0
