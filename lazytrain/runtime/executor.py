"""StreamingExecutor: runs a Plan on a Hugging Face causal LM, one layer at a time.

Each layer (embed, block.i, head = final norm + lm_head + loss) is its own autograd unit: forward
keeps only what the plan keeps (saved tensors on their tier, or just a recompute segment's input),
backward calls torch.autograd.grad per layer with the incoming gradient, so a layer's weights,
activations and gradients need to be on the device only around its own compute. Weights stream
through `ParamStreamer`; activations through `ActivationStore`; fp32 gradients, master weights and
AdamW states live on host/NVMe in `LayerTrainState` and are updated on an optimizer thread
(CUDA; on a CPU device inline, in the same order: the same cores would run both).
The plan is never changed here.

MoE models with `config.output_router_logits` get HF's router load-balancing loss: each block's
router logits (tokens x experts) are kept with their graph; the head computes the aux loss from
detached leaf copies of them and adds `router_aux_loss_coef * aux` as the model's own forward does;
the head's backward yields each block's router-logits gradient, which that block's backward feeds
into autograd.grad together with the hidden-state gradient. A recomputed block re-produces its
logits in the recompute pass. The logits stay on the device (counted as "router_logits").
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..models.adapter import (DecoderParts, RouterAux, block_kwargs, check_chunked_loss, context_tensors,
                              embedding_backward_reads_weights, find_parts, head_loss, micro_batch_parts,
                              probe_forward, rng_states, router_aux, router_aux_enabled, run_block,
                              run_block_routed, set_rng_states)
from ..plan.plan import Plan
from ..spec.model import experts_implementation
from ..storage.aligned_io import InlinePool, IOPool, aligned_empty, round_up
from ..storage.fastcopy import copy_into
from ..storage.flat import FlatLayout, typed
from ..costmodel import NVME_STATE_SETS
from ..storage.tiers import (HostStore, NvmeStore, ScratchDir, StagingSets, check_nvme_dir,
                             remove_dead_scratch)
from .accountant import MemoryAccountant
from .activations import ActivationStore
from .layer_state import LayerTrainState, clip_scale_for, total_norm
from .loss_scale import DynamicLossScale
from .malloc import keep_freed_memory
from .state import executor_state_dict, executor_state_shards, load_executor_state_dict
from .streamer import ParamStreamer, StreamedLayer, use_sequence
from .trace import Trace

TIERS = ("device", "host", "nvme")


@dataclass(frozen=True)
class StepResult:
    loss: float                      # mean over micro-batches
    grad_norm: float | None          # global L2 norm of the (unclipped, unscaled) gradients; None without
                                     # max_grad_norm and loss scaling (not computed: math.inf clips
                                     # nothing but reports it)
    skipped: bool                    # non-finite gradients with clipping or loss scaling on: no update
    step_time_s: float
    device_peak_bytes: int           # the accountant's peak (CUDA: max of it and the allocator's,
                                     # less other owners' bytes held when the executor was made)
    tokens: int
    predicted_step_time_s: float
    predicted_device_peak_bytes: int
    accounted_peak_bytes: int = 0    # the accountant's figure alone
    aux_loss: float | None = None    # MoE router load-balancing loss (unscaled, mean over micro-batches;
                                     # `loss` includes coef * aux, as HF's does); None when off
    loss_scale: float | None = None  # fp16: the loss scale this step's backward ran with (None: bf16/fp32)


class PlanMismatchError(ValueError):
    """The plan does not describe this model (layer count/names) or is not runnable."""


def _check_plan(plan: Plan, names: list[str]) -> None:
    if not plan.fits:
        raise PlanMismatchError(f"plan status is {plan.status!r}: it does not fit; "
                                + " ".join(plan.explanation))
    got = [d.name for d in plan.layers]
    if got != names:
        raise PlanMismatchError(f"plan layers {got[:3]}..{got[-2:]} ({len(got)}) do not match the model's "
                                f"{names[:3]}..{names[-2:]} ({len(names)})")
    # LoRA: base weights get no gradients and no optimizer state; the adapters' live on the
    # device, which the planner records as grad/optimizer tier "device".
    state_tiers = ("host", "nvme", "device") if plan.job.mode == "lora" else ("host", "nvme")
    for d in plan.layers:
        if d.param_tier not in TIERS or d.grad_tier not in state_tiers \
                or d.optimizer_tier not in state_tiers:
            raise PlanMismatchError(f"{d.name}: bad tiers param={d.param_tier} grad={d.grad_tier} "
                                    f"optimizer={d.optimizer_tier}")
        first = (not d.recompute) or d.segment_start == d.index
        if first and d.activation_tier not in TIERS:
            raise PlanMismatchError(f"{d.name}: activation_tier must be device/host/nvme, got {d.activation_tier!r}")
        if d.recompute and not (0 <= d.segment_start <= d.index):
            raise PlanMismatchError(f"{d.name}: segment_start {d.segment_start} out of range")
    for a, b in plan.segments():
        if plan.layers[a].segment_start != a:
            raise PlanMismatchError(f"recompute segment {a}..{b} does not start at its segment_start")


def _to_pinned(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A blocking copy of `t` into pinned host memory, cast to `dtype` on the host if given
    (torch's caching host allocator recycles the buffers once they are freed)."""
    out = torch.empty_like(t, dtype=dtype, device="cpu", pin_memory=True)   # t's strides
    out.copy_(t)
    return out


PUBLISH_IN_FLIGHT = 2   # NVMe-tier weight writes queued behind their updates at once
# Offloaded activations on the device in backward: the layer's in use and the next one's, brought
# back one window ahead (what the planner times and reserves: plan.simulate, plan.milp), whatever
# the weights' prefetch_depth.
ACT_ITEMS_AHEAD = 1


def _vector_like(t: torch.Tensor) -> bool:
    """At most one dimension longer than 1: a bias, a norm weight, a per-expert vector."""
    return sum(n > 1 for n in t.shape) <= 1


def _check_experts_implementation(model: nn.Module, plan: Plan) -> None:
    """Warn when an MoE model runs another HF experts implementation than the plan's memory model
    counted (its saved bytes per routed pair differ: `spec.model.experts_implementation`)."""
    cfg = getattr(model, "config", None)
    running = getattr(cfg, "_experts_implementation", None)
    if running is None or not (getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)):
        return   # not an MoE model (dense configs report an implementation too)
    planned = experts_implementation(plan.model_config)
    if running != planned:
        warnings.warn(
            f"the model runs HF's {running!r} experts implementation but the plan's memory model "
            f"counted {planned!r} (which saves different bytes per routed token); re-plan with "
            f"model_config['_experts_implementation'] = {running!r}, or load the model with "
            f"experts_implementation={planned!r}", stacklevel=3)


def _check_lora_on_experts(model: nn.Module) -> None:
    """Warn when PEFT put LoRA on routed experts' own weights (it wraps their 3D parameters):
    what such a block saves for backward is not in the plan's memory model (measured several
    times more than counted on a tiny Qwen3-MoE)."""
    wrapped = sorted({n.rsplit(".", 1)[0] for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper"})
    if wrapped:
        warnings.warn(
            f"LoRA adapters on expert weights ({wrapped[0]}{' and others' if len(wrapped) > 1 else ''}): "
            "the plan's memory model does not count what these blocks save for backward (several "
            "times more); target the attention projections only, or leave headroom in the budget",
            stacklevel=3)


class StreamingExecutor:
    """Runs training steps exactly as `plan` says. See the module docstring."""

    def __init__(self, model: nn.Module, plan: Plan, *, device: str | torch.device | None = None,
                 nvme_dir: str | Path | None = None, optimizer: str = "adamw", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float | None = None,
                 trace_path: str | Path | None = None, fused: bool = True,
                 compute_dtype: torch.dtype | None = None,
                 master_dtype: torch.dtype = torch.float32, overlap_optimizer: bool | None = None,
                 count_op_temporaries: bool = False, loss_scale: DynamicLossScale | None = None) -> None:
        """`compute_dtype`: the dtype the streamed weights are stored, moved and computed in (the
        plan's `job.compute_dtype`); None keeps the model's own. Full fine-tuning keeps master
        weights, AdamW moments and the gradient accumulator in `master_dtype` (the plan's
        `job.master_dtype`), taken from the model's original values: fp32 (mixed precision), or
        bf16 for pure-bf16 training (exactly torch's AdamW on bf16 parameters, less memory and
        traffic, coarser updates). `overlap_optimizer`: run accumulation and updates on their own
        thread (default: on CUDA; inline on a CPU device, where with True each layer's backward
        still waits for its own, as the plan's device memory counts one layer's gradients there). `count_op_temporaries` (CPU device): also
        count what autograd and the ops allocate inside each layer's forward and backward (see
        accountant.OpTemporaries), as a device allocator would, in the budget and the measured peak;
        ~10% slower steps. On CUDA the allocator's own peak already covers them.

        fp16 compute (the model's dtype or `compute_dtype`) needs an fp32 master and scales the loss
        (`loss_scale`, default `DynamicLossScale()`: torch.amp.GradScaler's rule): a step whose
        gradients overflow is skipped and the scale backs off, and 1/scale is folded into the clip
        coefficient of the update (reported norms and losses are unscaled)."""
        if optimizer not in ("adamw", "adamw8bit"):
            raise ValueError(f"optimizer must be 'adamw' or 'adamw8bit', got {optimizer!r}")
        if master_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"master_dtype must be torch.float32 or torch.bfloat16, got {master_dtype}")
        if optimizer == "adamw8bit" and master_dtype != torch.float32:
            raise ValueError("optimizer=adamw8bit keeps fp32 master weights; use master_dtype fp32 "
                             "(job.master_dtype=fp32) or optimizer=adamw")
        self.master_dtype = master_dtype
        emptied = [n for n, p in model.named_parameters() if p.numel() == 0 and getattr(p, "_lazytrain_moved", False)]
        if emptied:   # (the structure probe would blame the architecture: "'weight' must be 2-D")
            raise ValueError(f"{len(emptied)} of the model's parameters are empty ({emptied[0]}, ...): its "
                             f"weights were moved into a StreamingExecutor that was closed without "
                             f"sync_model(); call sync_model() before close(), or reload the model")
        self.model = model
        self.plan = plan
        self._cast_to = compute_dtype
        self.device = torch.device(device) if device is not None else \
            torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = self.device.type == "cuda"
        if not self.cuda:
            keep_freed_memory()   # no page faults for the tensors every layer re-allocates (malloc.py)
        # CUDA copy streams of their own: weight gradients leaving the device (queued behind the
        # layer's backward, not waited for by the launching thread) and updated weights of
        # device-resident layers going back (not queued behind the compute stream's kernels)
        self.grad_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.publish_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.parts: DecoderParts = find_parts(model)
        lm = self.parts.lm
        if getattr(lm, "is_activation_checkpointing", None) or (
                not hasattr(lm, "is_activation_checkpointing") and getattr(lm, "is_gradient_checkpointing", False)):
            # the plan decides what is recomputed; HF's own checkpointing would recompute again
            # inside it, and its reentrant form cannot run under the per-layer backward (review:
            # torch's raw RuntimeError in the first step). (transformers 5.x renamed it
            # activation checkpointing; the old names warn)
            (getattr(lm, "activation_checkpointing_disable", None) or lm.gradient_checkpointing_disable)()
            warnings.warn("the model had Hugging Face gradient checkpointing on: turned off (the plan decides "
                          "what is recomputed)", stacklevel=2)
        if plan.job.loss_chunk_tokens:
            check_chunked_loss(self.parts)
        names = self.parts.layer_names()
        _check_plan(plan, names)
        # The model's own forward on 8 tokens with its blocks stood in for (embedding, final norm and
        # head only, in eval and train mode): refuses a model that computes anything the executor's
        # embed -> blocks -> norm -> head would not (an embedding multiplier, logit soft-capping, ...)
        probe_forward(self.parts, plan.job.loss_chunk_tokens)
        _check_experts_implementation(model, plan)
        _check_lora_on_experts(model)
        self.names = names
        self.n_layers = len(names)
        self.decisions = list(plan.layers)
        self.lora = hasattr(model, "peft_config")
        # the layers' moments live in AdamW8bit (8-bit, host), not in their LayerTrainState
        layers_8bit = optimizer == "adamw8bit" and not self.lora
        if layers_8bit and any(d.optimizer_tier != "host" for d in self.decisions):
            # (before any storage is made: refused late, the weights were already written to NVMe)
            raise ValueError("optimizer=adamw8bit keeps its 8-bit states on the host; the plan puts "
                             "optimizer state on nvme")
        self.hp: dict[str, Any] = {"lr": float(lr), "betas": tuple(betas), "eps": float(eps),
                                   "weight_decay": float(weight_decay), "fused": bool(fused)}
        self.max_grad_norm = max_grad_norm
        self.loss_scale = loss_scale   # (checked, or made for fp16, once the compute dtype is known)
        self._step_scale: float | None = None   # the running step's loss scale (fp16)
        self._deferred = max_grad_norm is not None
        self.trace = Trace(trace_path)
        self.acct = MemoryAccountant(plan.hardware.device_memory_bytes, enforce=not self.cuda)
        # The plan keeps hardware.workspace_gib free for kernels' scratch, the CUDA context and
        # allocator slack; on CPU that reservation is counted here so the budget means the same
        # thing to the planner and to the accountant (on CUDA the allocator's figure covers it).
        if not self.cuda:
            self.acct.alloc(plan.hardware.workspace_bytes, "workspace")
        self.count_op_temporaries = count_op_temporaries   # sets _count_ops (CPU device only)
        # On CUDA the measured peak is the allocator's, less what other owners in this process
        # already held when the executor was made (a model kept for comparison, a data batch); the
        # model's own device tensors are the executor's from here on. The predicted figure it is
        # compared with leaves out the plan's workspace reserve, which is no allocation of ours.
        self._foreign_bytes = 0
        if self.cuda:
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            own = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                      if t.device.type == "cuda" and t.device.index == idx)
            self._foreign_bytes = max(0, torch.cuda.memory_allocated(idx) - own)
        self.pool = IOPool(workers=2)
        self.publish_io = IOPool(workers=1)   # NVMe-tier weights written after their update, in order
        self._publishing: deque[Future] = deque()   # those writes, oldest first (PUBLISH_IN_FLIGHT)
        # Host-side gradient accumulation and optimizer updates run on their own thread, overlapped
        # with the device's compute. When the CPU is the device the same cores would run both (the
        # planner's `optimizer_overlaps_compute: false`): they run inline, in the same order, which
        # avoids oversubscribing the cores (measured: backward 25% slower with the thread).
        self.opt_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-opt") \
            if (self.cuda if overlap_optimizer is None else overlap_optimizer) else InlinePool()
        self.step_count = 0
        self._calls = 0
        self._synced = False
        self._closed = False
        self._pending: list[Future] = []
        self._grads_inflight: deque[Future] = deque()
        self._accum_failed: set[int] = set()   # layers whose accumulation failed this step
        # what the running micro-batch holds in the accountant (freed if it raises)
        self._mb_held: dict[str, Any] | None = None
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.nvme_dir = nvme_dir
        self._router: RouterAux | None = None
        if router_aux_enabled(self.parts):
            self._router = router_aux(self.parts)

        home = {id(p): (p.dtype, p.device) for p in model.parameters()}
        try:
            self._set_up(plan, optimizer, names)
        except BaseException:
            # a constructor that fails leaves no scratch files or threads, and the model as it was
            self._restore_model(home)
            self._close_partial()
            raise

    def _set_up(self, plan: Plan, optimizer: str, names: list[str]) -> None:
        self._build_layers()
        self._set_loss_scale()
        # (probed before _init_storage moves the weights into the streamer's buffers)
        self.embed_bwd_weights = embedding_backward_reads_weights(self.parts, self.layers[0].params)
        if self.embed_bwd_weights and self.layers[0].tier != "device":
            warnings.warn(f"{type(self.parts.embed).__name__}: the embedding's backward may read its weights, so "
                          "they are fetched for it too; the planner assumes an HF embedding, which does not, "
                          "and charges one fetch of them per micro-batch less than this run makes",
                          UserWarning, stacklevel=2)
        self.use_seq = use_sequence(self.n_layers, plan.segments(), embed_backward=self.embed_bwd_weights)
        self.streamer = ParamStreamer(self.layers, self.device, plan.options.prefetch_depth,
                                      self.host, self.nvme, self.pool, self.acct, self.trace,
                                      embed_recomputed=any(a == 0 for a, _ in plan.segments()))
        self._init_storage()
        self.acts = ActivationStore(self.device, self.acct, self.trace, self.nvme_root, self.pool, names)
        self._init_optimizer(optimizer)

    # What close() releases, in order (threads before the files they use; the scratch dir is our
    # own subdirectory); a failed constructor releases what it made so far.
    _RESOURCES = (("streamer", "close"), ("acts", "close"), ("opt_pool", "shutdown"),
                  ("publish_io", "shutdown"), ("pool", "shutdown"), ("state_io", "shutdown"),
                  ("nvme", "close"), ("scratch", "close"), ("host", "close"))

    def _release(self, quiet: bool = False) -> None:
        for name, method in self._RESOURCES:
            obj = getattr(self, name, None)
            if obj is None:
                continue
            try:
                getattr(obj, method)()   # (pools' shutdown waits by default)
            except Exception:
                if not quiet:
                    raise

    def _restore_model(self, home: dict) -> None:
        """After a failed constructor: every parameter the set-up had moved gets its values back.
        A layer not yet released gets its original tensors (kept until its optimizer state was
        made); one already released (its originals freed as each layer was set up, so that the
        model is never held twice) is read back from the executor: the master where one was made
        (the original values), else its stored copy in the compute dtype (a frozen layer of an fp32
        model computed in bf16 comes back rounded), in its own dtype and device. Device-tier layers
        included: they are bound to the executor's device buffer from the start. Best effort: a
        layer whose storage cannot be read keeps what it has (review: a full disk left 10 of 30
        parameters as 0-element tensors, and device-tier ones on an unfilled buffer)."""
        for i, lay in enumerate(getattr(self, "layers", [])):
            if not lay.params:
                continue
            try:
                # (released: its state was appended before, so _layer_values finds it)
                values = list(lay.extra["init_values"]) if "init_values" in lay.extra else \
                    self._layer_values(i, full_precision=True)
                for p, v in zip(lay.params, values):
                    dtype, device = home[id(p)]
                    p.data = v.to(device=device, dtype=dtype)
                    p.__dict__.pop("_lazytrain_moved", None)
            except Exception:  # noqa: BLE001 - the constructor's own error is the one to report
                continue

    def _close_partial(self) -> None:
        self._release(quiet=True)   # (the constructor's own error is the one to report)

    # ---- setup ---------------------------------------------------------------------------
    def _set_loss_scale(self) -> None:
        """fp16 compute: an fp32 master and a loss scale (the default one unless given)."""
        if self.compute_dtype == torch.float16:
            if self.master_dtype != torch.float32:
                raise ValueError("fp16 compute needs fp32 master weights (master_dtype=torch.float32): "
                                 "in fp16 AdamW's moments and small updates underflow")
            if self.loss_scale is None:
                self.loss_scale = DynamicLossScale()
        elif self.loss_scale is not None:
            raise ValueError(f"loss_scale is for fp16 compute; this model computes in {self.compute_dtype} "
                             f"(bf16 and fp32 need none)")
        # Updates wait for the global norm: clipping needs it, loss scaling checks it for overflow
        self._deferred = self.max_grad_norm is not None or self.loss_scale is not None

    def _build_layers(self) -> None:
        # A parameter belongs to the first layer that uses it; a later layer using it too (the tied
        # head: lm_head.weight *is* embed.weight) borrows it: one buffer, one fp32 state, one update.
        owner: dict[int, int] = {}
        self.layers: list[StreamedLayer] = []
        self.adapters: list[list[nn.Parameter]] = []
        # adapters a layer uses but an earlier one owns: PEFT's trainable_token_indices on a tied
        # embedding wraps the head too, with the same delta (review: its gradient from the head
        # was never taken, silently)
        self.adapter_borrows: list[list[nn.Parameter]] = []
        borrowed: list[tuple[int, ...]] = []
        self.constants: list[list[nn.Parameter]] = []
        for i, mods in enumerate(self.parts.layer_modules()):
            streamed, adapters, lenders, ad_borrows = [], [], [], []
            for m in mods:
                for n, p in m.named_parameters(remove_duplicate=False):
                    if id(p) in owner:
                        if owner[id(p)] != i and self.lora and p.requires_grad:
                            if all(q is not p for q in ad_borrows):
                                ad_borrows.append(p)
                        elif owner[id(p)] != i and owner[id(p)] not in lenders:
                            lenders.append(owner[id(p)])
                        continue
                    owner[id(p)] = i
                    (adapters if (self.lora and p.requires_grad) else streamed).append((n, p))
            borrowed.append(tuple(lenders))
            constants = []
            if not self.lora and any(p.requires_grad for _, p in streamed):
                # A frozen vector or scalar in a layer that trains (HF freezes some itself: Ernie 4.5
                # MoE's [1, experts] e_score_correction_bias) stays on the device as a constant, as
                # buffers do: exact (no gradient, no update, as in plain PyTorch) and small. A frozen
                # matrix would have to stay there outside the plan: refused below.
                constants = [(n, p) for n, p in streamed if not p.requires_grad and _vector_like(p)]
                streamed = [(n, p) for n, p in streamed if p.requires_grad or not _vector_like(p)]
            self.constants.append([p for _, p in constants])
            dtypes = {p.dtype for _, p in streamed}
            if len(dtypes) > 1:
                raise ValueError(f"{self.names[i]}: parameters have mixed dtypes {sorted(map(str, dtypes))}; "
                                 f"cast the model to one compute dtype first")
            dtype = dtypes.pop() if dtypes else torch.float32
            if self._cast_to is not None and streamed:
                dtype = self._cast_to
            layout = FlatLayout.of(streamed, dtype)
            self.layers.append(StreamedLayer(i, self.names[i], [p for _, p in streamed], layout,
                                             self.decisions[i].param_tier, borrows=borrowed[i]))
            # originals, read before the streamer rebinds parameters to its buffers
            self.layers[-1].extra["init_values"] = [p.data for _, p in streamed]
            self.adapters.append([p for _, p in adapters])
            self.adapter_borrows.append(ad_borrows)
        outside = [n for n, p in self.model.named_parameters() if id(p) not in owner]
        if outside:
            raise ValueError(f"parameters outside embed/blocks/norm/head are not supported: {outside[:3]}")
        self.compute_dtype = self.layers[1].layout.dtype if self.n_layers > 2 else self.layers[0].layout.dtype
        self.trainable = [bool(lay.params) and not self.lora and any(p.requires_grad for p in lay.params)
                          for lay in self.layers]
        for lay in self.layers:   # (checked before any scratch space is made)
            frozen = [self.param_names[id(p)] for p in lay.params if not p.requires_grad]
            if self.trainable[lay.index] and frozen:
                raise ValueError(f"{lay.name}: only some of its parameters are frozen ({frozen[:3]}"
                                 f"{' and others' if len(frozen) > 3 else ''}); a frozen weight matrix would have "
                                 f"to stay on the device outside the plan (frozen vectors are kept there as "
                                 f"constants): freeze whole layers, or none of their matrices")
        # Borrowed weights get gradients in the borrower's backward, which must run before the
        # lender's (the head's before the embedding's): the lender sums both, then updates once.
        for lay in self.layers:
            if any(j >= lay.index for j in lay.borrows):
                raise ValueError(f"{lay.name} shares weights with a later layer; only a head tied to "
                                 f"the embedding (an earlier layer) is supported")
        self.borrowed_grads: dict[int, list[torch.Tensor | None]] = {}

        need_nvme = 0
        itemsize = self.master_dtype.itemsize
        for lay, d in zip(self.layers, self.decisions):
            if d.param_tier == "nvme":
                need_nvme += lay.layout.padded_nbytes
            if self.trainable[lay.index]:
                # (each a file padded to the O_DIRECT block, as NvmeStore.allocate makes it)
                need_nvme += round_up(lay.layout.numel * itemsize) * ((d.grad_tier == "nvme")
                                                                      + 3 * (d.optimizer_tier == "nvme"))
        uses_nvme = need_nvme > 0 or any(d.activation_tier == "nvme" for d in self.decisions)
        self.host = HostStore(pin=self.cuda)
        self.nvme_root = None
        self.nvme = None
        self.scratch: ScratchDir | None = None
        if uses_nvme:
            if self.nvme_dir is not None:   # a killed run's files first (the free-space check)
                remove_dead_scratch(Path(self.nvme_dir))
            root = check_nvme_dir(self.nvme_dir, need_nvme)
            self.scratch = ScratchDir(Path(root))
            self.nvme_root = self.scratch.path
            self.nvme = NvmeStore(self.nvme_root, self.pool)

    def _init_storage(self) -> None:
        for lay, d in zip(self.layers, self.decisions):
            if not lay.params:
                continue
            values = lay.extra["init_values"]
            if d.param_tier == "device":
                lay.layout.gather(values, lay.resident)
            elif d.param_tier == "host" or d.param_tier == "nvme":
                key = self.streamer.key(lay)
                if d.param_tier == "host":
                    buf = self.host.allocate(key, lay.layout.nbytes)
                else:
                    self.nvme.allocate(key, lay.layout.nbytes)
                    buf = aligned_empty(lay.layout.padded_nbytes)
                lay.layout.gather(values, typed(buf, lay.layout.dtype, lay.layout.numel))
                if d.param_tier == "nvme":
                    self.nvme.write_sync(key, buf)
        # Buffers (rotary inv_freq, ...), frozen constants and LoRA adapters stay resident on the device.
        for mod in self.model.modules():
            for name, b in list(mod._buffers.items()):
                if b is not None and b.device != self.device:
                    mod._buffers[name] = b.to(self.device)
        for p in (p for consts in self.constants for p in consts):
            if p.device != self.device:
                p.data = p.data.to(self.device)
        for ads in self.adapters:
            for p in ads:
                if p.device != self.device:
                    p.data = p.data.to(self.device)
                self.acct.alloc(p.nbytes, "adapters")

    def _init_optimizer(self, optimizer: str) -> None:
        layers_8bit = optimizer == "adamw8bit" and not self.lora   # (their moments live in AdamW8bit)
        self.states: list[LayerTrainState | None] = []
        self.opt8 = None
        staging = (StagingSets(NVME_STATE_SETS) if any(
            t and d.optimizer_tier == "nvme" for t, d in zip(self.trainable, self.decisions)) else None)
        self.state_io = IOPool(workers=2) if staging is not None else None
        for lay, d in zip(self.layers, self.decisions):
            st = None
            if self.trainable[lay.index]:
                st = LayerTrainState(lay.name, FlatLayout(lay.layout.names, lay.layout.shapes, lay.layout.offsets,
                                                          lay.layout.numels, self.master_dtype),
                                     d.grad_tier, d.optimizer_tier, self.host, self.nvme, self.trace,
                                     master_alias=self.streamer.key(lay)
                                     if (self.master_dtype == lay.layout.dtype and d.param_tier == "host"
                                         and d.optimizer_tier == "host") else None,
                                     staging=staging, state_io=self.state_io,
                                     moments=not layers_8bit)
                st.init_master(lay.extra["init_values"])
                st.track_norms = self._deferred
            self.states.append(st)
            lay.extra.pop("init_values", None)
            if lay.resident is None:
                self.streamer._unbind(lay)   # the originals are released here
        # The order updates run in (clipping: after the norm, first layers first; otherwise as
        # backward lands them, last first) and the NVMe-tier states among them, read ahead in it.
        upd = [i for i, st in enumerate(self.states) if st is not None]
        self._update_order = upd if self._deferred else upd[::-1]
        self._staged_order = [i for i in self._update_order if self.states[i].staging is not None]
        self._staged_pos = {i: k for k, i in enumerate(self._staged_order)}
        if layers_8bit:
            try:
                from ..optim import AdamW8bit  # type: ignore[attr-defined]
            except ImportError:
                raise ValueError("optimizer=adamw8bit needs lazytrain.optim.AdamW8bit, which is not "
                                 "available in this build; use optimizer=adamw") from None
            self.opt8 = {}
            for st in self.states:
                if st is not None:
                    p = nn.Parameter(st.master(), requires_grad=False)
                    self.opt8[st.name] = AdamW8bit([p], lr=self.hp["lr"], betas=self.hp["betas"],
                                                   eps=self.hp["eps"], weight_decay=self.hp["weight_decay"])
        self.adapter_params = [p for ads in self.adapters for p in ads]
        self.adapter_grads: dict[int, torch.Tensor] = {}
        self.adapter_opt = None
        if self.adapter_params:
            self.adapter_opt = torch.optim.AdamW(self.adapter_params, lr=self.hp["lr"], betas=self.hp["betas"],
                                                 eps=self.hp["eps"], weight_decay=self.hp["weight_decay"],
                                                 fused=self.hp["fused"] or None)
            self.acct.alloc(sum(2 * p.numel() * 4 for p in self.adapter_params), "adapter_optimizer")

    # ---- weights publication -------------------------------------------------------------
    def _publisher(self, i: int):
        lay, d = self.layers[i], self.decisions[i]

        def write(master: torch.Tensor) -> None:
            if d.param_tier == "device":   # the new weights go back to the device (the plan's h2d)
                src = master
                if self.cuda and not (master.dtype == lay.resident.dtype and master.is_pinned()):
                    # Cast on the host into pinned memory, then one DMA copy (pure bf16's master
                    # already is the pinned store). A direct copy_ of the fp32 master casts into a
                    # fresh pageable temporary copied at the pageable rate (6 GB/s on the H200
                    # machine vs 53 pinned): with every layer resident there, the optimizer thread
                    # took 146 ms/step against 67 ms for the update alone.
                    src = _to_pinned(master, lay.resident.dtype)
                if self.cuda:
                    # On the publish stream, waited for here (this optimizer thread) before the
                    # update counts as done: the next forward waits for `lay.ready` before it
                    # queues a kernel that reads the layer, and every kernel that read the old
                    # weights (the layer's backward) ran before its gradients' copy, which the
                    # update waited for. On the compute stream the copy would wait for every
                    # kernel queued so far.
                    with self.trace.span("h2d", lay.name, lay.resident.nbytes, "device", "params"):
                        with torch.cuda.stream(self.publish_stream):
                            lay.resident.copy_(src, non_blocking=True)
                            done = torch.cuda.Event()
                            done.record(self.publish_stream)
                        done.synchronize()   # keeps `src` alive until the copy ran
                else:   # the update's own write of the compute-dtype weights (no transfer on a CPU)
                    copy_into(lay.resident, src)
            elif d.param_tier == "host":
                dst = typed(self.host.get(self.streamer.key(lay)), lay.layout.dtype, lay.layout.numel)
                if dst.data_ptr() != master.data_ptr():   # else the master is the store (pure bf16)
                    copy_into(dst, master)
            else:
                # Written behind the update, on its own I/O thread, as the planner overlaps it (a
                # synchronous write held the update, and on a CPU device the step, for the drive's
                # time). The next fetch of the layer, wait() and checkpoints wait for it.
                # At most PUBLISH_IN_FLIGHT of these buffers (a layer's weights each) wait for the
                # drive: within the host's NVMe bounce reserve the planner counts (depth x the
                # largest NVMe-tier layer), not every layer's weights queued at once.
                while len(self._publishing) >= PUBLISH_IN_FLIGHT:
                    self._publishing.popleft().result()
                buf = aligned_empty(lay.layout.padded_nbytes)
                copy_into(typed(buf, lay.layout.dtype, lay.layout.numel), master)
                key, trace, step = self.streamer.key(lay), self.trace, self.trace.current_step()

                def publish() -> None:
                    with trace.at_step(step), trace.span("nvme_write", lay.name, lay.layout.padded_nbytes,
                                                         "nvme", "params"):
                        self.nvme.write_sync(key, buf)
                lay.publish = self.publish_io.submit(publish)
                self._publishing.append(lay.publish)
        return write

    # ---- one layer -----------------------------------------------------------------------
    def _fwd(self, i: int, x: torch.Tensor | None, mb: dict) -> torch.Tensor:
        if i == 0:
            return self.parts.embed(mb["ids"])
        ra: RouterAux | None = mb["router"]
        if i == self.n_layers - 1:
            loss = head_loss(self.parts, x, mb["labels"], self.plan.job.loss_chunk_tokens)
            if ra is not None:
                # the model's own: loss += coef * load_balancing_loss_func(all router logits, E, k,
                # attention_mask); the executor has no attention mask (as model(ids, labels=...))
                leaves = tuple(t for j in sorted(mb["rl_leaf"]) for t in mb["rl_leaf"][j])
                if leaves:
                    aux = ra.loss_fn(leaves, ra.num_experts, ra.top_k, None)
                    if not mb["recomputing"]:
                        mb["aux"] = aux.detach()
                    loss = loss + ra.coef * aux.to(loss.device)
            if not mb["recomputing"]:
                mb["loss"] = loss.detach()
            # (a weight of 1, every micro-batch learning as many tokens: x * 1.0 is x, the plain mean bit for bit)
            out = loss * mb["weight"] / mb["n"]
            return out if self._step_scale is None else out * self._step_scale
        block = self.parts.blocks[i - 1]
        if ra is None or not ra.routers[i - 1]:
            return run_block(block, x, mb["kw"][i - 1])
        out, logits = run_block_routed(block, x, mb["kw"][i - 1], ra.routers[i - 1])
        # forward pass: with their graph if the layer keeps one (else recompute re-produces them);
        # the head computes from detached leaves so its backward yields their gradients
        prev = mb["rl"].get(i)
        mb["rl"][i] = logits
        for t in logits:   # counted by hand (a recompute's replace the forward's, counted then)
            self.acct.adopt(t)
        if prev is None:
            nb = sum(t.nbytes for t in logits)
            self.acct.alloc(nb, "router_logits")   # (recorded once counted: freed by what is recorded)
            mb["rl_bytes"][i] = mb["rl_bytes"].get(i, 0) + nb
        if not mb["recomputing"]:
            mb["rl_leaf"][i] = tuple(t.detach().requires_grad_(True) for t in logits)
        return out

    def _use_for_backward(self, i: int) -> None:
        """Layer i's weights on the device for its backward: the embedding's reads none unless the
        setup probe said otherwise (and then `use_sequence` kept that use)."""
        if i > 0 or self.embed_bwd_weights:
            self.streamer.use(i)

    def _bwd(self, i: int, x: torch.Tensor | None, out: torch.Tensor, g: torch.Tensor | None,
             first: bool, last: bool, mb: dict) -> torch.Tensor | None:
        lay = self.layers[i]
        params = lay.params if self.trainable[i] else []
        # weights borrowed from earlier layers (the tied head's embedding matrix)
        shared = [(j, p) for j in lay.borrows if self.trainable[j] for p in self.layers[j].params]
        ads = [*self.adapters[i], *self.adapter_borrows[i]]   # (a borrowed one's gradient adds to its owner's)
        outs, gouts = [out], [g]
        leaves: list[tuple[int, tuple[torch.Tensor, ...]]] = []
        if mb["router"] is not None:
            if i == self.n_layers - 1:    # the head: gradients of every block's router logits
                leaves = sorted(mb["rl_leaf"].items())
            elif i in mb["rl"]:           # a block: its router logits' gradient joins g
                for t, gt in zip(mb["rl"].pop(i), mb["rl_grad"].pop(i, ())):
                    if gt is not None and t.requires_grad:
                        outs.append(t)
                        gouts.append(gt)
        leaf_ts = [t for _, ts in leaves for t in ts]
        inputs = [*params, *(p for _, p in shared), *ads, *leaf_ts] + ([x] if x is not None else [])
        if not inputs:
            return None
        t = self.trace.now()
        with self._ops():
            grads = torch.autograd.grad(outs, inputs, grad_outputs=gouts, allow_unused=True)
        self.trace.add("compute_bwd", lay.name, t, self.trace.now())
        del outs, gouts
        if mb["router"] is not None and i != self.n_layers - 1:
            self.acct.free(mb["rl_bytes"].pop(i, 0), "router_logits")
        gx = grads[-1] if x is not None else None
        n_own, n_sh = len(params), len(shared)
        pg, sg = grads[:n_own], grads[n_own:n_own + n_sh]
        ag = grads[n_own + n_sh:n_own + n_sh + len(ads)]
        if leaves:
            lg = iter(grads[n_own + n_sh + len(ads):n_own + n_sh + len(ads) + len(leaf_ts)])
            for j, ts in leaves:
                gj = tuple(next(lg) for _ in ts)
                mb["rl_grad"][j] = gj
                nb = sum(gt.nbytes for gt in gj if gt is not None)
                self.acct.alloc(nb, "router_logits")
                mb["rl_bytes"][j] = mb["rl_bytes"].get(j, 0) + nb
            # the forward copies are needed no more (a recomputed block re-produces its own)
            mb["rl_leaf"].clear()
        for p, gr in zip(ads, ag):
            if gr is None:
                continue
            acc = self.adapter_grads.get(id(p))
            if acc is None:
                # in the adapter's own layout (autograd's .grad layout contract): fused AdamW reads
                # a gradient's memory in its parameter's order, and PEFT's lora_embedding_A got
                # its transposed gradient, each update landing on other elements (review)
                self.adapter_grads[id(p)] = torch.empty_like(p, dtype=gr.dtype, device=gr.device).copy_(gr)
                self.acct.alloc(gr.nbytes, "adapter_grads")
            else:
                acc.add_(gr)
        if params:
            st = self.states[i]
            nb = sum(gr.nbytes for gr in pg if gr is not None)
            # At most two layers' weight grads on the device (this one and the previous, maybe
            # still leaving; on a CPU device the inline pool has taken the previous one's
            # already), as the planner counts them (plan.ops.grads_in_flight).
            self._drain_grads(keep=1)
            self.acct.alloc(nb, "grads")
            landed = None
            if self.cuda:
                # d2h into pinned memory (a DMA copy; a pageable destination runs ~5x slower,
                # through a staging buffer) on the grad stream, queued behind this backward: this
                # thread goes on launching the next layer's kernels (a blocking copy would wait for
                # the GPU to drain its queue at every layer). The optimizer thread waits for
                # `landed`, then adds into fp32 on the host. The device grads stay counted until
                # then; record_stream keeps the allocator from reusing them before the copy ran.
                try:
                    self.grad_stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(self.grad_stream):
                        dev, pg = pg, [None if gr is None else
                                       torch.empty_like(gr, device="cpu", pin_memory=True).copy_(gr, non_blocking=True)
                                       for gr in pg]
                        landed = torch.cuda.Event()
                        landed.record(self.grad_stream)
                    for gr in dev:
                        if gr is not None:
                            gr.record_stream(self.grad_stream)
                    del dev
                except BaseException:   # e.g. pinned memory exhausted: nothing is left counted
                    self.acct.free(nb, "grads")
                    raise

            # this micro-batch's contribution from the layer that borrows these weights, if any
            borrowed = self.borrowed_grads.pop(i, None)

            def accumulate(pg=pg, nb=nb, borrowed=borrowed, landed=landed) -> None:
                held = nb
                try:
                    if landed is not None:   # CUDA: the copy is in pinned memory; the device's are free
                        landed.synchronize()
                        self.acct.free(held, "grads")
                        held = 0
                    st.accumulate(list(pg), first, last, shared=borrowed)
                    if st._direct is not None:
                        # the update reads these very tensors (pure bf16 on a CPU device): they
                        # stay counted until it has (with overlap_optimizer=True it runs on the
                        # optimizer thread while later layers' backward places more; uncounted
                        # from here they were 8.5-14% of the peak alive uncounted: a review)
                        st.direct_bytes += held
                        held = 0
                except BaseException:
                    self._accum_failed.add(i)   # this step's sum is incomplete: no update from it
                    raise
                finally:   # a failed accumulation leaves nothing counted (the step raises)
                    self.acct.free(held, "grads")

            fut = self.opt_pool.submit(accumulate)
            self._pending.append(fut)
            self._grads_inflight.append(fut)
            if last and not self._deferred:
                lay.ready = self.opt_pool.submit(self._update, i, None, dict(self.hp), self.trace.step)
            if not self.cuda:
                # The plan counts one layer's weight gradients at a time on a CPU device
                # (JobCosts.grads_inline): they are gone before the next layer's weights come
                # (inline they are; with overlap_optimizer=True this waits for the thread)
                self._drain_grads(keep=0)
                self._drain_direct(i)
        if shared:
            self._hand_over_borrowed(shared, sg)
        return gx

    def _drain_grads(self, keep: int) -> None:
        """Wait until at most `keep` layers' gradients are still on their way off the device."""
        q = self._grads_inflight
        while q and q[0].done():
            q.popleft()
        while len(q) > keep:
            q.popleft().result()

    def _drain_direct(self, i: int) -> None:
        """CPU device: wait for layer i's update if it reads the gradients in place (pure bf16, one
        micro-batch: LayerTrainState._direct). The plan counts one layer's weight gradients at a
        time there (JobCosts.grads_inline); with overlap_optimizer=True the update ran on the
        optimizer thread while the next layer's weights came and its backward placed its own
        gradients next to them (a run's peak 7.19 MB where its plan said 6.40). Inline there is
        nothing to wait for."""
        lay, st = self.layers[i], self.states[i]
        if st.direct_bytes and lay.ready is not None:
            lay.ready.result()

    def _hand_over_borrowed(self, shared: list[tuple[int, nn.Parameter]],
                            grads: Sequence[torch.Tensor | None]) -> None:
        """Keep a borrower's gradients of borrowed weights for the lender's backward, on the host.

        The lender (the embedding) adds its own contribution to them and accumulates the sum:
        exactly what autograd does for a weight used twice, and the weights update once."""
        for (j, p), gr in zip(shared, grads):
            if gr is None:
                continue
            # Like every other gradient the tensor leaves the device at once: on CUDA a blocking
            # d2h; on CPU it already is host memory, so handing it over is the whole transfer.
            # Held until the lender's backward (the end of this backward), it must not sit in the
            # device budget: the plan reserves room for grads in flight, not for this one.
            self.acct.alloc(gr.nbytes, "grads")
            held = _to_pinned(gr) if self.cuda else gr.detach()
            self.acct.free(gr.nbytes, "grads")
            slots = self.borrowed_grads.setdefault(j, [None] * len(self.layers[j].params))
            k = next(k for k, q in enumerate(self.layers[j].params) if q is p)
            slots[k] = held if slots[k] is None else slots[k] + held

    def _update(self, i: int, scale: torch.Tensor | None, hp: dict, step: int) -> None:
        # `hp` is a snapshot taken when the update was queued: set_lr for the next step may run
        # while this step's updates are still landing (and the trace has moved on to it).
        st = self.states[i]
        if i in self._accum_failed:
            # (queued behind the failed accumulation, without clipping): its gradient is partial
            # or stale, so the weights and AdamW state stay as they are; the step raises that error
            st.cancel_prefetch()
        else:
            try:
                with self.trace.at_step(step):
                    st.update(hp, scale, self._publisher(i), self.opt8.get(st.name) if self.opt8 else None)
            finally:
                self._free_direct(st)
        if st.staging is not None:   # keep the read-ahead NVMe_STATE_SETS - 1 layers deep
            k = self._staged_pos[i] + NVME_STATE_SETS - 1
            if k < len(self._staged_order):
                self.states[self._staged_order[k]].prefetch()

    def _free_direct(self, st) -> None:
        """Uncount the gradients a layer's update read where they were (LayerTrainState._direct)."""
        nb, st.direct_bytes = st.direct_bytes, 0
        self.acct.free(nb, "grads")

    def _prefetch_states(self) -> None:
        """Start reading the first NVMe-tier optimizer states this step's updates will need."""
        for i in self._staged_order[:NVME_STATE_SETS - 1]:
            self.states[i].prefetch()

    # ---- a micro-batch -------------------------------------------------------------------
    def _rng_state(self) -> tuple:
        return rng_states([self.device] if self.cuda else [])

    def _set_rng_state(self, st: tuple) -> None:
        set_rng_states(st, [self.device] if self.cuda else [])

    def _block_kwargs(self, B: int, S: int, pos: torch.Tensor | None) -> list[dict]:
        """The blocks' arguments for a [B, S] micro-batch; with `pos` (packed rows), the model's
        mask that keeps each row to itself and rotary tables of the rows' own positions."""
        if pos is not None:
            pos = pos.to(self.device)
        return block_kwargs(self.parts, B, S, self.compute_dtype, self.device, position_ids=pos)

    def _hold_step_context(self, kw: list[dict]) -> list[torch.Tensor]:
        """Count the tensors the blocks' arguments hold (masks, rotary tables; shared by all
        blocks) as device memory until `_end_micro_batch`; returns them."""
        ctx = context_tensors(kw)
        ctx_bytes = sum(t.untyped_storage().nbytes() for t in ctx)
        # (recorded once counted: a refused placement is not counted, and what is recorded is freed)
        self._mb_held = {"ctx": 0, "live": 0, "rl": {}}
        self.acct.alloc(ctx_bytes, "step_context")
        self._mb_held["ctx"] = ctx_bytes
        return ctx

    def _micro_batch(self, ids: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor | None, n: int,
                     first: bool, last: bool, weight: float = 1.0) -> float:
        ids, labels = ids.to(self.device), labels.to(self.device)
        B, S = ids.shape
        kw = self._block_kwargs(B, S, pos)   # one dict per block
        ctx = self._hold_step_context(kw)
        self.acts.resident_ptrs = {t.untyped_storage().data_ptr() for t in ctx}
        self.acts.resident_ptrs |= {p.untyped_storage().data_ptr() for p in self.adapter_params}
        self._drain_grads(keep=0)   # forward windows hold no weight grads (as planned)
        mb = {"ids": ids, "labels": labels, "kw": kw, "n": n, "weight": float(weight), "recomputing": False,
              # MoE router aux loss: per block its router logits (with graph), the head's leaf
              # copies, their gradients from the head, and the device bytes all of that holds
              "router": None, "rl": {}, "rl_leaf": {}, "rl_grad": {}, "rl_bytes": {}}
        self._mb_held["rl"] = mb["rl_bytes"]
        if router_aux_enabled(self.parts):   # read per micro-batch, like the model's own forward
            if self._router is None:
                self._router = router_aux(self.parts)
            mb["router"] = self._router   # (None: a dense model, which ignores the flag)
        self.borrowed_grads.clear()   # (left over only if a previous micro-batch failed)
        self.streamer.start(self.use_seq, wrap=self.lora or not last)
        L = self.n_layers
        dec = self.decisions
        graphs: dict[int, tuple] = {}
        seg_in: dict[int, Any] = {}
        rng: dict[int, tuple] = {}
        h: torch.Tensor | None = None
        prev_out: torch.Tensor | None = None

        live = 0
        # ---- forward
        for i in range(L):
            d = dec[i]
            self.streamer.use(i)
            t = self.trace.now()
            if d.recompute:
                if d.segment_start == i:
                    seg_in[i] = self.acts.save(i, d.activation_tier, ids if i == 0 else h)
                rng[i] = self._rng_state()
                with torch.no_grad(), self._ops():
                    out = self._fwd(i, h, mb)
                x = None
            else:
                x = h.detach().requires_grad_(True) if h is not None else None
                with self.acts.hooks(i, d.activation_tier, self.streamer.device_buffer,
                                     param_layers=self.streamer.group(i)), self._ops():
                    out = self._fwd(i, x, mb)
                self.acts.end_forward(i)
                graphs[i] = (x, out)
            self.trace.add("compute_fwd", self.names[i], t, self.trace.now())
            # The previous boundary is needed on the device only if a device-tier save holds it.
            if prev_out is not None and prev_out.untyped_storage().data_ptr() not in self.acts.protected():
                if i - 1 in graphs:
                    prev_out.untyped_storage().resize_(0)
            prev_out = out
            h = out if d.recompute else out.detach()
            # the live boundary (hidden state handed to the next layer) is device memory too
            live = self._track_live(live, h)
            if d.recompute:
                prev_out = None
        # The forward's last references: the head's loss (prev_out, out) holds its graph, whose leaf
        # views the last block's output; held here, that storage outlived the head's backward,
        # alive through every later layer's and counted by nothing (a review, 2026-12-01).
        prev_out = out = x = None
        # ---- backward
        g: torch.Tensor | None = None
        i = L - 1
        while i >= 0:
            d = dec[i]
            if d.recompute:
                a = d.segment_start
                self._prefetch_acts(i)
                hin = self.acts.load(seg_in.pop(a))   # (its record is released with layer a)
                mb["recomputing"] = True
                keep = self._rng_state()
                seg_graphs = {}
                for j in range(a, i + 1):
                    self.streamer.use(j)
                    t = self.trace.now()
                    xj = hin.detach().requires_grad_(True) if j > 0 else None
                    self._set_rng_state(rng[j])
                    with self.acts.hooks(j, "device", self.streamer.device_buffer, kind="recompute",
                                         param_layers=self.streamer.group(j)), self._ops():
                        outj = self._fwd(j, xj, mb)
                    self.acts.end_forward(j)
                    seg_graphs[j] = (xj, outj)
                    # as in forward: a boundary inside the segment stays only if a save holds it
                    if j > a and (prev := seg_graphs[j - 1][1]).untyped_storage().data_ptr() \
                            not in self.acts.protected():
                        prev.untyped_storage().resize_(0)
                    hin = outj.detach() if j < L - 1 else None
                    self.trace.add("recompute", self.names[j], t, self.trace.now())
                self._set_rng_state(keep)
                mb["recomputing"] = False
                # `prev` is the last recomputed layer's output but one: its graph's leaf is the
                # segment's input, which would stay alive (on CUDA, allocated) until the next segment
                del hin
                prev = None
                for j in range(i, a - 1, -1):
                    self._use_for_backward(j)
                    xj, outj = seg_graphs.pop(j)
                    self._drop_output(j, outj)
                    g = self._bwd(j, xj, outj, g, first, last, mb)
                    del xj, outj   # (nothing may keep the segment's input alive past its release)
                    live = self._track_live(live, g)
                    self.acts.release(j)
                i = a - 1
            else:
                self._prefetch_acts(i)
                self._use_for_backward(i)
                x, out = graphs.pop(i)
                self._drop_output(i, out)
                g = self._bwd(i, x, out, g, first, last, mb)
                del x, out
                live = self._track_live(live, g)
                self.acts.release(i)
                i -= 1
        self._end_micro_batch()   # step context, live boundary, router logits
        aux = mb.get("aux")
        return float(mb["loss"]), (float(aux) if aux is not None else None)

    def _drop_output(self, i: int, out: torch.Tensor) -> None:
        """Before layer i's backward: free its output's storage unless a save holds it (backward
        needs the output's grad_fn, not its data). The forward frees a stored layer's output once
        the next layer has run, but not one a save held then (the next segment's device-tier input,
        uncounted once that segment is released) nor a segment's last recomputed output: both were
        alive uncounted through this backward (a review, 2026-12-01). The head's loss stays."""
        if i < self.n_layers - 1 and out.untyped_storage().data_ptr() not in self.acts.protected():
            out.untyped_storage().resize_(0)

    def _prefetch_acts(self, i: int) -> None:
        """Backward is at layer i: start bringing back the offloaded activations of the item in
        use and of the next ACT_ITEMS_AHEAD items. An item is a stored layer (what it saved) or a
        recompute segment (its input, saved under its first layer), in backward order."""
        dec = self.decisions
        j, k = i, 0
        while j >= 0 and k <= ACT_ITEMS_AHEAD:
            start = dec[j].segment_start if dec[j].recompute else j
            self.acts.prefetch(start)
            k += 1
            j = start - 1

    @property
    def count_op_temporaries(self) -> bool:
        """Whether each layer's op temporaries are counted (a CPU device only; settable between
        steps, e.g. for one measuring step)."""
        return self._count_ops

    @count_op_temporaries.setter
    def count_op_temporaries(self, on: bool) -> None:
        self._count_ops = bool(on) and not self.cuda

    def _ops(self):
        """A window over one layer's compute counting its op temporaries (count_op_temporaries)."""
        return self.acct.op_window(self.device) if self._count_ops else nullcontext()

    def _track_live(self, live: int, g: torch.Tensor | None) -> int:
        """Count the tensor flowing between layers, the hidden state or its gradient (replaces the
        previous one)."""
        self.acct.free(live, "live_boundary")
        n = g.nbytes if g is not None else 0
        if self._mb_held is not None:
            self._mb_held["live"] = 0
        self.acct.alloc(n, "live_boundary")   # (may refuse: then nothing of it is counted or recorded)
        if self._mb_held is not None:
            self._mb_held["live"] = n
        return n

    def _end_micro_batch(self) -> None:
        """Uncount what the micro-batch held (at its end, or when it raised) and forget the saved
        tensors of layers it did not release (none after a whole backward)."""
        held, self._mb_held = self._mb_held, None
        if held is None:
            return
        self.acct.free(held["ctx"], "step_context")
        self.acct.free(held["live"], "live_boundary")
        self.acct.free(sum(held["rl"].values()), "router_logits")
        self.acts.clear()

    # ---- a step --------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, ...]],
                   weights: Sequence[float] | None = None) -> StepResult:
        """One optimizer step over `micro_batches` (list of (input_ids [B,S], labels [B,S]), or
        (input_ids, labels, position_ids [B,S]) for packed rows that each attend only to themselves:
        the model's own mask for them, as `model(input_ids, labels=, position_ids=)` builds it).

        The step's loss is the mean of the micro-batches' (mean) losses; `weights` (one per
        micro-batch, default 1) scale each in that mean: with n * learned_tokens_k / learned_tokens
        it is the mean over every learned token of the step (recipes.train.token_weights)."""
        self._check_open("train_step")
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        if weights is not None and (len(weights) != len(micro_batches)
                                    or not all(math.isfinite(w) and w >= 0 for w in weights)):
            raise ValueError(f"train_step: weights must be {len(micro_batches)} finite numbers >= 0 (one per "
                             f"micro-batch), got {list(weights)}")
        # all of them, before any runs
        parts = [micro_batch_parts(mb, f"micro-batch {k}") for k, mb in enumerate(micro_batches)]
        if self._synced:
            self._rebind()
        t0 = time.perf_counter()
        self.trace.step = self._calls   # this process's n-th step: one per metrics row, skipped or not
        self._calls += 1
        self.acct.reset_peak()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        n = len(micro_batches)
        losses, auxes, tokens = [], [], 0
        # fp16: this step's loss scale (the head multiplies the loss by it; a power of two)
        self._step_scale = loss_scale = self.loss_scale.scale if self.loss_scale is not None else None
        try:
            if self._staged_order:
                # read while this step computes; queued behind the last step's updates (the staging
                # state belongs to the optimizer thread)
                self._pending.append(self.opt_pool.submit(self._prefetch_states))
            for k, (ids, labels, pos) in enumerate(parts):
                w = 1.0 if weights is None else float(weights[k])
                loss, aux = self._micro_batch(ids, labels, pos, n, k == 0, k == n - 1, w)
                losses.append(loss * w)
                if aux is not None:
                    auxes.append(aux)
                tokens += ids.numel()
            self._wait_pending()
        except BaseException:
            self._abort_step()
            raise
        norm_t = grad_norm = None
        if self._deferred:   # norms are needed (and computed) only for clipping and loss scaling
            norms = [n for st in self.states if st is not None for n in st.norms]
            norms += [torch.linalg.vector_norm(self.adapter_grads[id(p)]) for p in self.adapter_params
                      if id(p) in self.adapter_grads]
            norm_t = total_norm(norms)
            if loss_scale is not None:   # the unscaled gradients' norm (a power of two: exactly)
                norm_t = norm_t / loss_scale
            grad_norm = float(norm_t)
        skipped = False
        if self._deferred:
            scale = clip_scale_for(norm_t, self.max_grad_norm if self.max_grad_norm is not None else math.inf)
            skipped = scale is None
            if loss_scale is not None:
                self.loss_scale.update(found_inf=skipped)
                if scale is not None:   # unscaling folded into the update's one multiply
                    scale = scale / loss_scale
            if not skipped:
                for i, st in enumerate(self.states):   # first layers first: the next forward needs them
                    if st is not None:
                        self.layers[i].ready = self.opt_pool.submit(self._update, i, scale, dict(self.hp),
                                                                    self.trace.step)
            else:
                for st in self.states:
                    if st is not None:
                        st.has_grad = False
                        self.opt_pool.submit(st.cancel_prefetch).result()
        else:
            scale = None
        if not skipped:
            self._step_adapters(scale)
        else:
            self._step_adapters(None, skip=True)
        if not self.lora:
            self.streamer.invalidate()
            self.streamer.prefetch_first(self.use_seq)
        if not skipped:
            self.step_count += 1
        peak = self.acct.peak_bytes
        measured = max(peak, torch.cuda.max_memory_allocated(self.device) - self._foreign_bytes) \
            if self.cuda else peak
        step_s = time.perf_counter() - t0
        self.trace.step = -1   # between steps (checkpoints, syncs): what queued work captured stays
        self.trace.flush()
        pred = self.plan.predicted
        return StepResult(loss=sum(losses) / n, grad_norm=grad_norm, skipped=skipped, step_time_s=step_s,
                          device_peak_bytes=int(measured), tokens=tokens,
                          predicted_step_time_s=float(pred.step_time_s),
                          predicted_device_peak_bytes=self.predicted_device_peak_bytes,
                          accounted_peak_bytes=int(peak),
                          aux_loss=sum(auxes) / len(auxes) if auxes else None, loss_scale=loss_scale)

    def eval_loss(self, ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None) -> float:
        """The model's mean loss on one batch with the current weights (those of every queued update),
        forward only: the layers stream in forward order as in training, nothing is kept for a
        backward, and the modules run in eval mode (dropout off). The language-model loss alone (a
        MoE router's auxiliary loss is a training term). Between steps only."""
        self._check_open("eval_loss")
        micro_batch_parts((ids, labels, position_ids), "eval_loss")
        if self._synced:
            self._rebind()
        ids, labels = ids.to(self.device), labels.to(self.device)
        B, S = ids.shape
        modes = [(m, m.training) for m in self.model.modules()]
        try:
            with torch.no_grad():
                self.model.eval()
                kw = self._block_kwargs(B, S, position_ids)
                self._hold_step_context(kw)
                mb = {"ids": ids, "labels": labels, "kw": kw, "n": 1, "weight": 1.0, "recomputing": False,
                      "router": None, "rl": {}, "rl_leaf": {}, "rl_grad": {}, "rl_bytes": {}}
                self.streamer.start(list(range(self.n_layers)), wrap=False)
                h: torch.Tensor | None = None
                live = 0
                for i in range(self.n_layers):
                    self.streamer.use(i)
                    t = self.trace.now()
                    h = self._fwd(i, h, mb)
                    self.trace.add("compute_fwd", self.names[i], t, self.trace.now())
                    if i < self.n_layers - 1:
                        live = self._track_live(live, h)
                return float(mb["loss"])
        finally:
            for m, training in modes:
                m.training = training
            self._end_micro_batch()
            # the next step starts as after an update: its first layers on their way
            self.streamer.invalidate()
            self.streamer.prefetch_first(self.use_seq)

    def _wait_pending(self) -> None:
        """Wait for all of this step's queued accumulations (and state reads); raise the first
        error once all are done. The list is taken first: a failed one is never waited for again."""
        pending, self._pending = self._pending, []
        err: BaseException | None = None
        for f in pending:
            try:
                f.result()
            except BaseException as e:
                err = err or e
        if err is not None:
            raise err

    def _abort_step(self) -> None:
        """A step raised: leave nothing of it behind, so the next step starts clean. (Without
        clipping, layers whose update already ran keep it; none ran with clipping.)"""
        try:
            self._end_micro_batch()   # the micro-batch that raised, if one did
        finally:
            pending, self._pending = self._pending, []
            for f in (*pending, *self._grads_inflight):
                f.exception()   # wait (the step raises its own error)
            self._grads_inflight.clear()
            for lay in self.layers:   # updates queued in this step (no clipping) are over
                if lay.ready is not None:
                    lay.ready.exception()
            self._accum_failed.clear()
            self.borrowed_grads.clear()
            for st in self.states:   # this step's partial gradient sums are dropped
                if st is not None:
                    st.has_grad = False
                    st.norms = []
                    st._direct = None
                    self._free_direct(st)
                    if st.staging is not None:
                        self.opt_pool.submit(st.cancel_prefetch).result()
            self._step_adapters(None, skip=True)   # adapter grads: dropped and uncounted
            self.streamer.invalidate()   # fetched copies may predate an update that ran
            self.trace.step = -1

    @property
    def predicted_device_peak_bytes(self) -> int:
        """The plan's device peak in the terms `device_peak_bytes` measures: on CUDA without the
        workspace reserve (CUDA context, allocator slack), which the allocator does not report."""
        peak = int(self.plan.predicted.peak_bytes.get("device", 0))
        return max(0, peak - self.plan.hardware.workspace_bytes) if self.cuda and peak else peak

    def _step_adapters(self, scale: torch.Tensor | None, skip: bool = False) -> None:
        if self.adapter_opt is None:
            return
        if not skip:
            t = self.trace.now()
            for p in self.adapter_params:
                gr = self.adapter_grads.get(id(p))
                if gr is not None and scale is not None:
                    gr.mul_(scale.to(gr.device))
                p.grad = gr
            self.adapter_opt.step()
            self.trace.add("optimizer", "adapters", t, self.trace.now(), 0, "device")
        for p in self.adapter_params:
            p.grad = None
        for gr in self.adapter_grads.values():
            self.acct.free(gr.nbytes, "adapter_grads")
        self.adapter_grads.clear()

    # ---- public helpers ------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        self.hp["lr"] = float(lr)
        if self.adapter_opt is not None:
            for grp in self.adapter_opt.param_groups:
                grp["lr"] = float(lr)

    def _settle(self) -> None:
        """Wait for every queued update and weight write to finish, their failures dropped: what
        they would have written is about to be replaced (load_state_dict; a failed one raised, or
        would, at the layer's next use, and the state it left is overwritten whole)."""
        for lay in self.layers:
            for f in (lay.ready, lay.publish):
                if f is not None:
                    f.exception()
            lay.ready = lay.publish = None
        while self._publishing:   # (the weight writes in flight: a failed one was raised by the next)
            self._publishing.popleft().exception()

    def wait(self, fetches: bool = False) -> None:
        """Block until every queued optimizer update has been applied (and its NVMe-tier weights
        written: a failed write is raised here, or at the layer's next fetch). `fetches`: and
        until the weight fetches a step starts for the next one at its end have landed (what a
        benchmark that times one step alone must count: the next step would wait for them)."""
        for lay in self.layers:
            if lay.ready is not None:
                lay.ready.result()
        for lay in self.layers:
            if lay.publish is not None:
                lay.publish.result()
        if fetches:
            for lay in self.streamer.layers:
                if lay.fetch is not None:
                    lay.fetch.result()

    def _layer_values(self, i: int, full_precision: bool = False) -> list[torch.Tensor]:
        """Current weights of layer i, as fresh tensors (not views of any buffer): in the compute
        dtype, or with `full_precision` the trained layers' master weights as they are."""
        lay, d = self.layers[i], self.decisions[i]
        if self.states[i] is not None:
            master = self.states[i].master()
            flat = master.clone() if full_precision else master.to(lay.layout.dtype)
        elif d.param_tier == "device":
            flat = lay.resident.clone()
        elif d.param_tier == "host":
            flat = typed(self.host.get(self.streamer.key(lay)), lay.layout.dtype, lay.layout.numel).clone()
        else:
            if lay.publish is not None:
                lay.publish.result()
            buf = aligned_empty(lay.layout.padded_nbytes)
            self.nvme.read_sync(self.streamer.key(lay), buf)
            flat = typed(buf, lay.layout.dtype, lay.layout.numel).clone()
        return [v.clone() for v in lay.layout.views(flat.to(self.device))]

    def sync_model(self, full_precision: bool = False) -> nn.Module:
        """Write current weights back into `self.model`'s parameters (for saving / evaluation).
        `full_precision`: the trained layers get their master weights (fp32 with an fp32 master),
        what a saved model must hold: rounded to the compute dtype, a fine-tune's small updates
        are partly lost (as the other engines, which save their fp32 weights)."""
        self._check_open("sync_model")
        self.wait()
        self.streamer.invalidate()
        for i, lay in enumerate(self.layers):
            for p, v in zip(lay.params, self._layer_values(i, full_precision)):
                p.data = v
                p.__dict__.pop("_lazytrain_moved", None)
        self._synced = True
        return self.model

    def _rebind(self) -> None:
        for lay in self.layers:
            if lay.resident is not None:
                self.streamer._bind(lay, lay.resident)
            else:
                self.streamer._unbind(lay)
        self._synced = False

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Full FT: every weight (compute dtype) by model parameter name; LoRA: the adapters."""
        self._check_open("trainable_state")
        self.wait()
        if self.lora:
            return {self.param_names[id(p)]: p.detach().cpu().clone() for p in self.adapter_params}
        out = {}
        for i, lay in enumerate(self.layers):
            for p, v in zip(lay.params, self._layer_values(i)):
                out[self.param_names[id(p)]] = v.cpu()
            for p in self.constants[i]:   # (frozen: as they were)
                out[self.param_names[id(p)]] = p.detach().cpu().clone()
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Master weights, optimizer state and step; tensors only (safetensors-able)."""
        self._check_open("state_dict")
        return executor_state_dict(self)

    def state_shards(self):
        """`state_dict()` one layer at a time (an iterator of flat tensor dicts)."""
        self._check_open("state_shards")
        return executor_state_shards(self)

    def load_state_dict(self, sd) -> None:
        """From a flat tensor dict, or any mapping that loads tensors on access (one at a time)."""
        self._check_open("load_state_dict")
        load_executor_state_dict(self, sd)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"StreamingExecutor.{what}(): the executor is closed (its threads, buffers and "
                               f"scratch files are released); call sync_model() or state_dict() before close()")

    def close(self) -> None:
        """Release threads, buffers and scratch files. The model's parameters were moved into the
        executor's storage: call sync_model() first to keep the trained weights in the model (a
        closed executor's model has empty parameters, which a new executor refuses, saying so).
        Closing again does nothing; anything else after close() raises, saying so (it crashed on
        released buffers and pools, or read weights a closed executor no longer holds: a review)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            self.wait()
            for st in getattr(self, "states", []):
                if st is not None:
                    st.flush()   # write-backs land (or raise) before the files go
        finally:
            self._release()
            # the adapters and their AdamW state are the model's and torch's from here on
            acct = getattr(self, "acct", None)
            for kind in ("adapters", "adapter_optimizer", "adapter_grads"):
                if acct is not None and acct.by_kind.get(kind):
                    acct.free(acct.by_kind[kind], kind)
            self.trace.flush()
