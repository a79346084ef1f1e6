"""Per-layer costs of one micro-batch: bytes that can move between tiers, seconds of compute.

Everything the planner and the simulator charge comes from here, so the two cannot disagree on a
number. Times are analytic (FLOPs / achieved FLOP/s); `lazytrain profile` fits the efficiency.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

from ..spec import HardwareSpec, JobSpec, ModelSpec

# Host staging sets for NVMe-tier optimizer state (master + moments of one layer each): one being
# updated, one read ahead, one being written back. The executor's pool and the planner's host
# bytes both use it.
NVME_STATE_SETS = 3
# Host staging for activations written to NVMe: the layers whose writes may be in flight at once
# (the one saving and the one before it); the executor waits for older layers' writes before it
# stages more (runtime/activations.py), and the planner's host bytes count as many of the largest
# NVMe-tier item. Unbounded and uncounted before: a review saw 45-110% over the planned host peak.
NVME_ACT_STAGING_LAYERS = 2


@dataclass(frozen=True)
class LayerCost:
    name: str
    kind: str                 # embed | block | head
    index: int
    param_bytes: int          # compute-dtype weights one use of the layer needs on the device
    param_store_bytes: int    # what its param tier stores (a tied head: its norm; the embed holds
                              # the matrix it borrows, param_bytes - param_store_bytes)
    trainable_params: int     # updated by the host optimizer (0 for LoRA base weights)
    grad_device_bytes: int    # compute-dtype grads leaving the device per micro-batch (a tied
                              # head's include the borrowed matrix's, handed to the embed)
    grad_store_bytes: int     # fp32 grads on the grad tier
    optimizer_bytes: int      # fp32 master + both moments on the optimizer tier
    fwd_s: float
    bwd_s: float
    act_bytes: int            # everything the layer saves for backward (stored mode)
    boundary_in_bytes: int    # its input boundary: what a checkpoint keeps
    bwd_transient_bytes: int  # gradient temporaries alive while its backward runs
    optimizer_s: float        # host optimizer step for this layer
    # the head only: its bytes on the device when its weight gradient is made (the last op of its
    # backward), without that gradient; see plan.ops.head_peak_bytes
    bwd_tail_bytes: int = 0
    # what a block's forward holds at its worst beyond what it saves (measured specs; the
    # families' formulas have none): plan.assignment.Segment.working_bytes, simulate's forward
    fwd_transient_bytes: int = 0
    # a block's backward with its saved activations brought back (host, NVMe tiers): the executor
    # holds them all until it ends; None: as bwd_transient_bytes
    bwd_offloaded_transient_bytes: int | None = None


@dataclass(frozen=True)
class JobCosts:
    layers: tuple[LayerCost, ...]
    num_blocks: int
    grad_accum: int
    tokens_per_micro_batch: int
    device_static_bytes: int  # workspace + LoRA adapters/grads/states + boundary grad buffers
    host_static_bytes: int    # what always sits on the host regardless of tiers
    host_capacity_bytes: int
    device_capacity_bytes: int
    nvme_capacity_bytes: int
    trains_base: bool         # full fine-tuning (grads and optimizer for every layer)
    clip_grad: bool = False   # updates wait for the global gradient norm (plan/ops.update_window)
    # a CPU device, one micro-batch, no clipping, a 16-bit master in the compute dtype (pure bf16):
    # the update reads the gradients where backward left them (runtime LayerTrainState.accumulate;
    # plan.ops.grad_d2h_bytes)
    direct_grads: bool = False
    # a CPU device: each layer's gradients are taken off inline right after its backward, before
    # the next one's starts (the executor's default there), so one layer's are in flight, not two
    # (plan.ops.grads_in_flight)
    grads_inline: bool = False
    # a CPU device: the streamer keeps freed streaming buffers for reuse (a fresh one page-faults
    # in), one more block-sized one than it holds at once (plan.ops.streaming_reserve)
    caches_stream_buffers: bool = False

    @property
    def blocks(self) -> tuple[LayerCost, ...]:
        return self.layers[1:-1]


# saved tensors whose dtype does not follow the compute dtype (LayerSpec.saved_bytes_per_token keys)
DTYPE_FIXED_SAVES = ("input_ids", "log_softmax")


def lora_saved_delta_per_token(spec, hidden: int, rank: int, targets: tuple[str, ...]) -> int:
    """How much more (or less) a block saves per token for backward under LoRA than under full
    fine-tuning, in a 16-bit compute dtype (the spec's saved bytes are full fine-tuning's).

    Frozen weights need no weight gradient, so what only those need is not saved: the norms'
    normalised values (their weight multiply) and outputs (the linears' inputs), o_proj's and
    down_proj's inputs, Qwen3/OLMoE q/k norms' normalised values, routed experts' gathered inputs
    and down inputs. PEFT runs a 16-bit model's adapters in fp32: each targeted linear saves an fp32
    copy of its input (per linear, even where q, k and v share one) and lora_A's fp32 output.
    Measured with saved-tensor hooks (tests/spec): within 0.1% for Llama, Qwen2, Qwen3, Mixtral,
    Qwen3-MoE, Qwen2-MoE and OLMoE blocks with attention targets, and dense MLP targets too. Not
    modelled: LoRA on routed experts' own weights (PEFT wraps their 3D parameters when MLP names are
    targets, as for Qwen3-MoE), which saves several times more; the executor warns about it.
    """
    H = hidden
    lin = {x.name: x for x in spec.linears}
    delta = -8 * H                                    # 2 norms: normalised values + outputs
    q = lin.get("q_proj")
    if q is not None:
        delta -= 2 * q.out_features                   # o_proj's input
    if "qk_norm" in spec.saved_bytes_per_token and q is not None:
        delta -= 2 * (q.out_features + lin["k_proj"].out_features)
    for name in ("down_proj", "shared_expert.down_proj"):
        if name in lin:
            delta -= 2 * lin[name].in_features        # a dense MLP's down_proj input
    if "experts.down_proj" in lin:                    # routed experts: input and down input
        e = lin["experts.down_proj"]
        delta -= e.active * 2 * (H + e.in_features)
    for x in spec.linears:
        if x.count == 1 and x.name.split(".")[-1] in targets:
            delta += 4 * x.in_features + 4 * rank     # fp32 input copy, fp32 lora_A output
    return delta


def optimizer_traffic_per_param(job: JobSpec) -> float:
    """Bytes the host update streams per trainable parameter: master, gradient and both moments in
    and out, compute-dtype weights out. The update is charged as memory-bound at
    `hardware.host_memory_gbps`; `lazytrain profile` on a GPU machine sets that figure from a timed
    update (this many bytes / its seconds per parameter)."""
    return 2 * (job.master_bytes + job.optimizer_state_bytes_per_param) + min(4, job.master_bytes) + job.compute_bytes


def check_lora_targets(model: ModelSpec, targets: tuple[str, ...]) -> None:
    """ValueError when none of the LoRA targets matches a linear layer the cost model counts (the
    last part of a linear's name, as PEFT matches them), naming the ones it has: `[qproj, vproj]`
    would otherwise plan a job that trains 0 adapter parameters. Only linears PEFT can wrap count
    (ModelSpec.lora_linears: not routed experts' 3-D weights, not a router module): MLP names on
    Mixtral or OLMoE match nothing. A target the cost model does not count while others match (a
    typo next to a real name) is only logged: the train recipe checks every target against the
    model's own modules before anything runs."""
    names = model.lora_target_names()   # (not routed experts or a router: PEFT wraps nn.Linear only)
    missing = [t for t in targets if t not in names]
    if not targets or len(missing) == len(targets):
        raise ValueError(f"job.lora_targets {missing or list(targets)} match no linear layer of {model.name}; "
                         f"its linear layers: {', '.join(names)}")
    if missing and _LORA_WARNED.get((id(model), tuple(missing))) is not model:
        # once per model spec: planning calls job_costs many times (plan compare: once per method)
        _LORA_WARNED[(id(model), tuple(missing))] = model
        logging.getLogger(__name__).warning(
            "job.lora_targets %s match no linear layer the cost model counts for %s (%s): the plan "
            "counts no adapters for them", missing, model.name, ", ".join(names))


_LORA_WARNED: "weakref.WeakValueDictionary[tuple, ModelSpec]" = weakref.WeakValueDictionary()


# An eager attention's backward (measured specs: what a block saves per token x sequence, the
# softmax probabilities) holds the probabilities' gradients next to them: in fp32 around the fp32
# softmax (its input's and output's gradients) and in the compute dtype around the matmuls. Fitted
# on Gemma 2 (eager, head_dim 32, 4 and 8 heads, batch 1-2, seq 256-1024, op temporaries counted,
# acts-on-host plans): the peak above the plan grew with the sequence, 1.15-1.30x at 1.0 without
# this term, 1.017x at 1024 tokens with 1.25; 1.5 gives 0.93-0.96 (2026-12-02 review). Used only
# where a measured block's transients were not measured (a spec saved before they were, a block
# whose backward did not run in the measure): one factor did not fit every eager attention
# (GPT-OSS 1.14-1.35x its plan, Gemma 2's device plans at 0.84-0.87).
EAGER_ATTN_BWD_FACTOR = 1.5


def transient_bytes(terms: tuple[tuple[int, int, int], ...], batch: int, seq: int, cb: int) -> int:
    """The largest of a measured block's transient terms (constant, per token, per token x
    sequence; measured in bf16: scaled to the compute dtype as saved activations are) for `batch`
    sequences of `seq` tokens; never below 0."""
    tokens = batch * seq
    worst = max((c * (batch if c > 0 else 1) + a * tokens + b * tokens * seq for c, a, b in terms), default=0)
    return max(0, worst) * cb // 2


def sliding_window_active(model: ModelSpec, job: JobSpec) -> bool:
    """The sequence reaches the model's attention window: transformers then builds an explicit mask
    for SDPA instead of its causal flag (masking_utils: kv_length >= the window; below it, causal
    is the same)."""
    return model.sliding_window is not None and job.seq_len >= model.sliding_window


def masked_blocks(model: ModelSpec, job: JobSpec) -> frozenset[int]:
    """The blocks (0-based) that get an explicit [batch, 1, seq, seq] mask instead of SDPA's causal
    flag: the sliding-window ones once the sequence reaches the window, and with packed rows
    (job.packed_rows: transformers' mask that keeps each row to itself) every block with softmax
    attention."""
    cfg = model.hf_config
    if str(cfg.get("attn_implementation", cfg.get("_attn_implementation")) or "").startswith("flash"):
        # (flash attention takes the window and packed rows' position ids itself: no mask, no
        # square; transformers builds none for it)
        return frozenset()
    out = set(model.sliding_blocks) if sliding_window_active(model, job) else set()
    if job.packed_rows:
        out |= {spec.index - 1 for spec in model.layers
                if spec.kind == "block" and spec.attn_flops_fwd_per_token_per_seq > 0}
    return frozenset(out)


def explicit_mask_bytes(model: ModelSpec, job: JobSpec) -> int:
    """The model's boolean [batch, 1, seq, seq] masks, made once in the forward and handed to the
    layers (the step context holds them until the last backward): one per kind of attention that
    gets one (sliding window, full)."""
    blocks = masked_blocks(model, job)
    kinds = {i in model.sliding_blocks for i in blocks}
    return len(kinds) * job.batch_size * job.seq_len * job.seq_len


def step_context_bytes(model: ModelSpec, job: JobSpec) -> int:
    """What the blocks' shared arguments hold for the whole step: measured specs' masks and rotary
    tables (spec/generic.py: per sequence, times the batch), where the measure found no mask the
    explicit ones the sliding window or packed rows bring; the families' masks (their rotary tables
    are in the workspace)."""
    if not model.context_bytes_terms:
        return explicit_mask_bytes(model, job)
    c, a, b = model.context_bytes_terms
    measured = max(0, job.batch_size * (c + a * job.seq_len + b * job.seq_len * job.seq_len))
    # (an eager attention's model builds its masks at every length: those are the measured ones)
    return measured + (explicit_mask_bytes(model, job) if b <= 0 else 0)


def job_costs(model: ModelSpec, hw: HardwareSpec, job: JobSpec) -> JobCosts:
    tokens = job.tokens_per_micro_batch
    cb = job.compute_bytes
    full = job.mode == "full"
    if not full:
        check_lora_targets(model, job.lora_targets)
    flops = hw.achieved_flops_per_s
    # fp32 master (or none if master dtype == compute dtype and fp32) + moments
    opt_per_param = job.master_bytes + job.optimizer_state_bytes_per_param
    opt_traffic_per_param = optimizer_traffic_per_param(job)
    bnd = model.boundary_bytes_per_token(cb) * tokens
    masks = masked_blocks(model, job)

    out: list[LayerCost] = []
    for spec in model.layers:
        tied_head = spec.kind == "head" and model.tie_word_embeddings
        stream_params = spec.param_count + (model.vocab_size * model.hidden_size if tied_head else 0)
        trainable = spec.param_count if full else 0
        # the tied head's backward also yields the matrix's gradient, which leaves the device at once
        # (the executor hands it to the embed's backward on the host)
        borrowed_grad = model.vocab_size * model.hidden_size if (tied_head and full) else 0
        # bf16 saved bytes in the spec assume 2-byte compute; scale if the job computes in fp32
        # (not what is saved in its own dtype whatever the compute dtype: token ids, the loss's
        # fp32 log-softmax)
        fixed = tokens * sum(b for k, b in spec.saved_bytes_per_token.items() if k in DTYPE_FIXED_SAVES)
        # a chunked scan's block runs on the sequence padded to whole chunks, for which its
        # terms were measured (spec/generic.py)
        seq = -(-job.seq_len // spec.scan_chunk) * spec.scan_chunk if spec.scan_chunk else job.seq_len
        padded = job.batch_size * seq if spec.scan_chunk else tokens
        act = (spec.saved_bytes(padded) - fixed) * cb // 2 + fixed
        act += padded * seq * spec.saved_bytes_per_token_per_seq * cb // 2   # (measured specs)
        act += job.batch_size * spec.saved_bytes_per_sequence * cb // 2
        if spec.kind == "block" and spec.index - 1 in masks:
            # With the mask, torch's SDPA turns it into an additive one in the compute dtype and
            # saves that, in every block given one (sliding window, packed rows; measured on the
            # CPU device: [batch, 1, seq, seq] per block, its own each), and transformers repeats
            # k and v to every query head first (no enable_gqa with a mask), which are what SDPA
            # saves: (heads - kv heads) x head_dim more
            act += job.batch_size * job.seq_len * job.seq_len * cb
            act += tokens * 2 * (model.num_heads - model.num_kv_heads) * model.head_dim * cb
        if spec.kind == "block" and not full and cb == 2 and "measured" not in spec.saved_bytes_per_token:
            # Only where LoRA saves more than full fine-tuning's count (Llama-shaped blocks: 10.9%
            # more at hidden 256): applied where it saves less (MoE blocks, frozen experts: 12-16%
            # less), the measured peak of a Qwen3-MoE LoRA job with NVMe-streamed parameters went
            # 0-3.9% above the plan's (scripts/audit_memory_model.py): another MoE term lives off
            # that slack, not found yet.
            act += tokens * max(0, lora_saved_delta_per_token(spec, model.hidden_size, job.lora_rank,
                                                              job.lora_targets))
        if spec.kind == "block" and not full and "measured" in spec.saved_bytes_per_token:
            # A measured block was measured for full fine-tuning, and what LoRA saves less (frozen
            # linears' inputs) is not Llama's shape everywhere (Cohere's parallel attention and
            # MLP share one input): only what the adapters add, each targeted linear's fp32 input
            # and fp32 rank output (the Llama-shaped delta left Cohere, Cohere 2 and SmolLM3
            # LoRA plans 1.01-1.08x under their peak; review)
            act += tokens * sum(4 * (lin.in_features + job.lora_rank) for lin in model.lora_linears(spec)
                                if lin.count == 1 and lin.name.split(".")[-1] in job.lora_targets)
        fwd_tr, bwd_off = 0, None
        # An attention given an explicit mask (sliding window past it, packed rows) or run eagerly
        # (a measured spec saving its probabilities) computes the whole [seq, seq] square: the
        # FLOPs count the causal half, the other half is this
        square = 0
        if spec.kind == "block" and (spec.index - 1 in masks or spec.saved_bytes_per_token_per_seq > 0):
            square = tokens * job.seq_len * spec.attn_flops_fwd_per_token_per_seq
        if spec.kind == "block" and spec.bwd_transient_terms:
            # measured (spec/generic.py: the block's own ops, op by op, at three lengths)
            bwd_tr = transient_bytes(spec.bwd_transient_terms, job.batch_size, seq, cb)
            bwd_off = transient_bytes(spec.bwd_offloaded_transient_terms, job.batch_size, seq, cb)
            fwd_tr = transient_bytes(spec.fwd_transient_terms, job.batch_size, seq, cb)
            if spec.index - 1 in masks:   # (measured without a mask: the one made again, below)
                mask = job.batch_size * job.seq_len * job.seq_len * cb
                bwd_tr, bwd_off = bwd_tr + mask, bwd_off + mask
        elif spec.kind == "block":
            inter = max((lin.out_features for lin in spec.linears if lin.name.endswith("up_proj")),
                        default=model.intermediate_size)
            k = max(1, spec.experts_per_token)
            bwd_tr = tokens * (2 * model.hidden_size * 4 + 3 * inter * k * cb)
            bwd_tr += int(EAGER_ATTN_BWD_FACTOR * tokens * job.seq_len * spec.saved_bytes_per_token_per_seq * cb // 2)
            if spec.index - 1 in masks:   # (the additive mask SDPA makes again in the backward, on the device
                bwd_tr += job.batch_size * job.seq_len * job.seq_len * cb   # whatever tier its saved copy is on)
            if spec.experts_per_token > 1:
                # Routed experts: their backward holds tokens x k x hidden tensors (the gathered
                # inputs' and outputs' gradients), up to 7 of them at once in the compute dtype at
                # its peak, whatever the experts' width: measured with op temporaries counted
                # (Mixtral-shaped, hidden 256-512, intermediate 128-256, 16-32 experts, top 2-8,
                # 512-1024 tokens): 14 x k x hidden bytes per token at k >= 4, 9097 at k = 2 and
                # hidden 256 (covered by the dense terms + 7 k x hidden x cb, 9216). Qwen3-MoE,
                # Qwen2-MoE and OLMoE blocks hold less (hidden 256: 9481 at top 2 and 4, 14352 at
                # top 8; hidden 512, top 4: 18194), over-covered at top 4 and 8, 3% short at top 2
                # (the rest of their plan covers it). The old terms alone (3 x intermediate x k)
                # gave half of Mixtral's: plans at 1024 tokens measured up to 4.9% above the plan.
                bwd_tr = max(bwd_tr + tokens * k * model.hidden_size * cb,
                             tokens * (2 * model.hidden_size * 4 + 7 * k * model.hidden_size * cb))
        elif spec.kind == "head":
            # The loss (HF: logits.float(), then cross-entropy = log-softmax + NLL), per token and
            # vocabulary entry: the forward holds the compute-dtype logits and their fp32 copy next
            # to the fp32 log-softmax it saves (4 + cb bytes beyond it); the log-softmax's backward
            # holds two fp32 gradients (the NLL's, its own) next to it (8 bytes beyond: the most).
            # The lm_head's weight gradient comes last, next to the compute-dtype logits gradient,
            # once the saved log-softmax is freed (bwd_tail_bytes). Measured on the CPU device with
            # count_op_temporaries: the head's peak is the log-softmax backward's.
            bwd_tr = tokens * model.vocab_size * 8
            tail = act - tokens * model.vocab_size * (4 - cb)
            if job.loss_chunk_tokens:
                # models/chunked_loss.py: it saves a log-sum-exp per token, not the log-softmax;
                # one chunk's logits exist at a time: a compute-dtype and an fp32 copy (forward;
                # backward: the fp32 softmax, made in place, then the compute-dtype gradient and
                # its fp32 upcast); when the matrix trains, its gradient is summed over chunks in fp32
                V, Hd, c = model.vocab_size, model.hidden_size, min(job.loss_chunk_tokens, tokens)
                act += tokens * 4 - tokens * V * 4
                bwd_tr = c * V * (4 + cb) + (V * Hd * 4 if full else 0)
                tail = act + (V * Hd * 4 if full else 0)
        else:
            bwd_tr = 0
        out.append(LayerCost(
            name=spec.name, kind=spec.kind, index=spec.index,
            param_bytes=stream_params * cb, param_store_bytes=spec.param_count * cb,
            trainable_params=trainable, grad_device_bytes=(trainable + borrowed_grad) * cb,
            grad_store_bytes=trainable * min(4, job.master_bytes), optimizer_bytes=int(trainable * opt_per_param),
            fwd_s=(spec.flops_fwd(tokens, job.seq_len) + square) / flops,
            # (the chunked loss's backward recomputes every chunk's logits: the head's forward again)
            bwd_s=(spec.flops_bwd(tokens, job.seq_len, weight_grads=full) + 2 * square
                   + (spec.flops_fwd(tokens, job.seq_len) if spec.kind == "head" and job.loss_chunk_tokens else 0))
            / flops,
            act_bytes=act, boundary_in_bytes=bnd if spec.kind != "embed" else 0,
            bwd_transient_bytes=bwd_tr, bwd_tail_bytes=tail if spec.kind == "head" else 0,
            fwd_transient_bytes=fwd_tr, bwd_offloaded_transient_bytes=bwd_off,
            optimizer_s=trainable * opt_traffic_per_param / hw.host_memory_bytes_per_s,
        ))

    lora_params = 0 if full else model.lora_param_count(job.lora_rank, job.lora_targets)
    # LoRA adapters stay resident with fp32 master, grads and both moments on the device
    lora_bytes = lora_params * (4 + 4 + 8)
    # Gradients are not static: a layer's weight grads are on the device from its backward until
    # they have left (the executor keeps at most two layers' in flight; one on a CPU device, where
    # they leave inline); plan/ops.grads_in_flight.
    device_static = hw.workspace_bytes + lora_bytes + 2 * bnd + step_context_bytes(model, job)
    return JobCosts(
        layers=tuple(out), num_blocks=model.num_layers, grad_accum=job.grad_accum,
        tokens_per_micro_batch=tokens, device_static_bytes=device_static,
        # a tied head's share of the matrix's gradient waits on the host for the embedding's
        # backward (the executor's borrowed_grads), in the compute dtype
        host_static_bytes=model.vocab_size * model.hidden_size * cb
        if (full and model.tie_word_embeddings) else 0,
        host_capacity_bytes=hw.host_capacity_bytes,   # (a CPU device's budget comes out of it)
        # a CPU device's budget is RAM: at most the usable host RAM (a budget of 30 GiB on a 23.5 GiB
        # profile planned a 21 GiB peak as fitting: review)
        device_capacity_bytes=min(hw.device_memory_bytes, hw.host_usable_bytes) if hw.device_type == "cpu"
        else hw.device_memory_bytes, nvme_capacity_bytes=hw.nvme_capacity_bytes,
        # updates wait for the global norm with clipping, and always under fp16 (its overflow check:
        # runtime.executor's _deferred)
        trains_base=full, clip_grad=job.clip_grad or job.compute_dtype == "fp16",
        direct_grads=(full and hw.device_type == "cpu" and job.grad_accum == 1 and not job.clip_grad
                      and job.compute_dtype != "fp16"
                      and job.master_dtype == job.compute_dtype and job.master_bytes < 4),
        grads_inline=hw.copies_share_compute,
        caches_stream_buffers=hw.device_type == "cpu",
    )
