"""The causal-LM loss over chunks of tokens: lm_head + cross-entropy without [tokens, vocab] fp32
tensors for the whole micro-batch.

HF's loss (`ForCausalLMLoss`) upcasts all logits to fp32 and runs log-softmax + NLL: its backward
holds two fp32 [tokens, vocab] gradients next to the saved fp32 log-softmax (12 x tokens x vocab
bytes; 12 GiB for 8192 tokens of Llama 3's 128k vocabulary). Here the forward keeps per token only
the log-sum-exp, and the backward recomputes each chunk's logits (as torchtune's chunked loss and
Liger's fused linear cross-entropy do), so at most one chunk's logits exist at a time. Same
semantics: labels shifted left by one, -100 ignored, mean over the rest. The arithmetic is HF's per
element (compute-dtype logits, upcast to fp32, the fp32 gradient cast to the compute dtype before
the matmuls); sums run per chunk, so results match HF's to rounding (~1e-7 relative in fp32). The
lm_head weight gradient is summed over chunks in fp32 (an fp32 [vocab, hidden] accumulator while
the backward runs), then cast once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM targets: position t predicts labels[t + 1]; the last position is ignored."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, targets, chunk):
        n = h.shape[0]
        valid = targets != IGNORE_INDEX
        count = valid.sum()
        safe = targets.clamp(min=0)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = F.linear(h[s:e], weight, bias).float()
            picked = logits.gather(1, safe[s:e, None]).squeeze(1)
            # log-sum-exp in place (torch.logsumexp would hold another fp32 chunk as scratch)
            m = logits.amax(dim=-1, keepdim=True)
            lse[s:e] = logits.sub_(m).exp_().sum(dim=-1).log_().add_(m.squeeze(1))
            total += ((lse[s:e] - picked) * valid[s:e]).sum()
            del logits
        ctx.save_for_backward(h, weight, bias if bias is not None else torch.empty(0, device=h.device),
                              targets, lse, count)
        ctx.chunk, ctx.has_bias = chunk, bias is not None
        return total / count

    @staticmethod
    def backward(ctx, grad):
        h, weight, bias, targets, lse, count = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        chunk, n = ctx.chunk, h.shape[0]
        valid = targets != IGNORE_INDEX
        safe = targets.clamp(min=0)
        # (no target at all: the loss is NaN, as HF's, but the gradients are zero, as HF's are)
        scale = grad.float() / count.clamp(min=1)
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            p = F.linear(h[s:e], weight, bias).float()
            p.sub_(lse[s:e, None]).exp_()                       # softmax
            rows = torch.arange(e - s, device=h.device)
            p[rows, safe[s:e]] -= 1.0                          # - one-hot of the target
            p.mul_((valid[s:e].to(torch.float32) * scale)[:, None])
            d = p.to(h.dtype)                                  # HF: the fp32 gradient, cast back
            del p
            if need_h:
                dh[s:e] = d @ weight
            if need_w:
                dw.addmm_(d.t().float(), h[s:e].float())   # exact products, fp32 sums
            if need_b:
                db += d.float().sum(0)
            del d
        return (dh, dw.to(weight.dtype) if need_w else None, db.to(bias.dtype) if need_b else None,
                None, None)


def chunked_causal_lm_loss(h: torch.Tensor, lm_head: torch.nn.Linear, labels: torch.Tensor,
                           chunk_tokens: int) -> torch.Tensor:
    """Mean cross-entropy of `lm_head(h)` against `labels` shifted by one (HF's causal-LM loss),
    `chunk_tokens` tokens at a time. h: [B, S, H] (the final norm's output); labels: [B, S]."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat = h.reshape(-1, h.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(flat, lm_head.weight, lm_head.bias,
                                            shifted_targets(labels.to(h.device)), int(chunk_tokens))
