"""The engines the train recipe can drive, behind one small interface.

    train_step(micro_batches) -> StepStats     one optimizer step over [(input_ids, labels), ...]
                                               (or (input_ids, labels, position_ids): packed rows)
    eval_loss(input_ids, labels, position_ids=None) -> float
    set_lr(lr); state_dict() / load_state_dict(sd)  (flat tensor dicts, safetensors-able)
    model (the HF model, synced on `sync_model()`); close()

- `lazytrain`: lazytrain.runtime.StreamingExecutor, which runs the Plan (streaming, offload,
  recompute, memory accountant, trace).
- `deepspeed`: lazytrain.integrations.deepspeed.DeepSpeedTrainer with a config derived from the Plan.
- `torch`: plain in-memory PyTorch autograd + torch.optim.AdamW — the reference the others are
  measured against (it ignores the Plan; on CPU its `device_peak_bytes` is the process's peak RSS).
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from ..models.adapter import micro_batch_parts, model_inputs

ENGINES = ("lazytrain", "deepspeed", "torch")


class EngineUnavailable(RuntimeError):
    """The requested engine cannot run here; the message says what to do."""


@dataclass(frozen=True)
class StepStats:
    loss: float
    grad_norm: float | None
    skipped: bool
    step_time_s: float
    device_peak_bytes: int
    tokens: int
    predicted_step_time_s: float | None = None
    predicted_device_peak_bytes: int | None = None
    loss_scale: float | None = None   # fp16: the loss scale the step's backward ran with


class Engine(Protocol):
    model: torch.nn.Module

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, ...]],
                   weights: Sequence[float] | None = None) -> StepStats: ...
    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
                  position_ids: torch.Tensor | None = None) -> float: ...
    def set_lr(self, lr: float) -> None: ...
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None: ...
    def sync_model(self) -> None: ...
    def close(self) -> None: ...


def _stats(res: Any) -> StepStats:
    """Normalise an engine's step result (StepResult or similar) to StepStats."""
    g = getattr(res, "grad_norm", None)
    return StepStats(
        loss=float(res.loss), grad_norm=None if g is None else float(g),
        skipped=bool(getattr(res, "skipped", False)), step_time_s=float(res.step_time_s),
        device_peak_bytes=int(getattr(res, "device_peak_bytes", 0) or 0),
        tokens=int(res.tokens),
        predicted_step_time_s=getattr(res, "predicted_step_time_s", None),
        predicted_device_peak_bytes=getattr(res, "predicted_device_peak_bytes", None),
        loss_scale=getattr(res, "loss_scale", None),
    )


# ---- engine=torch: plain PyTorch ---------------------------------------------------------------

def lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
            config: Any = None, position_ids: torch.Tensor | None = None,
            device: torch.device | str | None = None) -> torch.Tensor:
    """`model(input_ids, labels=labels).loss` without a MoE router's auxiliary loss (which a config
    with output_router_logits adds to it): the language-model loss evaluation reports, the inputs
    moved to `device`. `config`: the HF config, when `model` is a wrapper (DeepSpeed's engine)
    that does not carry it."""
    cfg = config if config is not None else getattr(model, "config", None)
    extra = {"output_router_logits": False} if getattr(cfg, "output_router_logits", False) else {}
    return model(**model_inputs(input_ids, labels, position_ids, device), **extra).loss


class TorchEngine:
    """Plain autograd over the whole model in memory, AdamW, global-norm clipping."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, compute_dtype: torch.dtype,
                 lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 max_grad_norm: float | None, optimizer: str = "adamw",
                 master_dtype: torch.dtype = torch.float32,
                 loss_scale: tuple[float, int] = (2.0 ** 16, 2000)) -> None:
        """`loss_scale`: fp16's (initial scale, growth interval) for torch.amp.GradScaler."""
        if optimizer != "adamw":
            raise EngineUnavailable("engine=torch runs 32-bit AdamW only (job.optimizer_state_bits=32); "
                                    "use engine=lazytrain for 8-bit states")
        # fp32 master: fp32 weights + autocast; bf16 master: pure-bf16 training (the model in bf16)
        self.model = model.to(device)
        if master_dtype != torch.float32:   # parameters only: buffers (rotary inv_freq) keep fp32
            # A LoRA model's adapters stay fp32, with fp32 moments, as the streaming executor keeps
            # them (the frozen base is what goes bf16); a review found them cast to bf16 here
            lora = hasattr(model, "peft_config")
            for p in model.parameters():
                if not (lora and p.requires_grad):
                    p.data = p.data.to(master_dtype)
        self.device = device
        self.compute_dtype = compute_dtype if master_dtype == torch.float32 else master_dtype
        # autocast only to run fp32 weights in the compute dtype (a bf16 model runs as it is)
        self.autocast = master_dtype == torch.float32 and compute_dtype != torch.float32
        self.max_grad_norm = max_grad_norm
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        # pure bf16: the fused kernel (fp32 arithmetic, one rounding per update), as the executor;
        # the single-tensor path would round every intermediate to bf16
        pure = master_dtype != torch.float32
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                     foreach=False if not pure else None, fused=True if pure else None)
        # fp16 (fp32 weights under fp16 autocast): PyTorch's own recipe, torch.amp.GradScaler
        self.scaler = torch.amp.GradScaler(device.type, init_scale=loss_scale[0], growth_interval=loss_scale[1]) \
            if self.autocast and self.compute_dtype == torch.float16 else None

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   weights: Sequence[float] | None = None) -> StepStats:
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        total, tokens = 0.0, 0
        autocast = self.autocast
        scaler = self.scaler
        scale_used = float(scaler.get_scale()) if scaler is not None else None
        n = len(micro_batches)
        for k, mb in enumerate(micro_batches):
            x, y, pos = micro_batch_parts(mb, f"micro-batch {k}")
            with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
                loss = self.model(**model_inputs(x, y, pos, self.device)).loss
            w = 1.0 if weights is None else float(weights[k])   # (see StreamingExecutor.train_step)
            out = loss * w / n   # (w = 1: x * 1.0 is x, the plain mean bit for bit)
            (out if scaler is None else scaler.scale(out)).backward()
            total += float(loss.detach()) * w
            tokens += x.numel()
        # optim.max_grad_norm=null: no clipping and no norm, so a non-finite gradient is applied,
        # as by torch's AdamW and the streaming executor (configs/train.yaml); inf: no clipping,
        # but a non-finite norm skips the step
        gn, skipped = None, False
        if scaler is not None:
            scaler.unscale_(self.opt)   # (the clip below sees the true gradients)
        if self.max_grad_norm is not None or scaler is not None:
            # (fp16: the norm is taken without clipping too, as the streaming executor's overflow
            # check takes it, and reported alike)
            mgn = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
            gn = float(torch.nn.utils.clip_grad_norm_(self.params, mgn or float("inf")))
            skipped = not math.isfinite(gn)
        if scaler is not None:
            scaler.step(self.opt)   # skips an overflowed step itself
            scaler.update()
            skipped = float(scaler.get_scale()) < scale_used   # backed off: it overflowed
            from ..runtime.loss_scale import MIN_SCALE

            if float(scaler.get_scale()) < MIN_SCALE:   # (as the executor's: runtime.loss_scale;
                scaler.update(MIN_SCALE)                 # after `skipped`, which the floor would hide)
        elif not skipped:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return StepStats(loss=total / len(micro_batches), grad_norm=gn, skipped=skipped,
                         step_time_s=time.perf_counter() - t0, device_peak_bytes=peak,
                         tokens=tokens, loss_scale=scale_used)

    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
                  position_ids: torch.Tensor | None = None) -> float:
        """The model's mean language-model loss on one batch, no gradients, eval mode (dropout off)."""
        self.model.eval()
        try:
            with torch.no_grad(), torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast):
                return float(lm_loss(self.model, input_ids, labels, position_ids=position_ids, device=self.device))
        finally:
            self.model.train()

    def state_dict(self) -> dict[str, torch.Tensor]:
        # Keyed by parameter name (not index) so a checkpoint survives reordering.
        out: dict[str, torch.Tensor] = {}
        for n, p in self.named:
            out[f"param.{n}"] = p.detach()
            for k, v in self.opt.state.get(p, {}).items():
                out[f"optim.{n}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        if self.scaler is not None:   # (the streaming executor's names for the same two numbers)
            sc = self.scaler.state_dict()
            out["meta.loss_scale"] = torch.tensor(float(sc["scale"]), dtype=torch.float64)
            out["meta.loss_scale_growth_tracker"] = torch.tensor(int(sc["_growth_tracker"]), dtype=torch.int64)
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.named:
                p.copy_(sd[f"param.{n}"])
                st = {k.split(".")[-1]: v.to(p.device) for k, v in sd.items()
                      if k.startswith(f"optim.{n}.") and k.count(".") == n.count(".") + 2}
                if st:
                    self.opt.state[p] = st
        if self.scaler is not None and "meta.loss_scale" in sd:
            from ..runtime.loss_scale import DynamicLossScale

            sc = self.scaler.state_dict()
            # (checked, and the count clamped below a smaller growth interval, as the executor's)
            ls = DynamicLossScale(growth_interval=int(sc["growth_interval"]))
            ls.load_state_dict({"scale": float(sd["meta.loss_scale"]),
                                "growth_tracker": int(sd["meta.loss_scale_growth_tracker"])})
            sc.update(scale=ls.scale, _growth_tracker=ls.growth_tracker)
            self.scaler.load_state_dict(sc)

    def sync_model(self) -> None:
        pass

    def close(self) -> None:
        pass


# ---- engine=lazytrain: the streaming executor --------------------------------------------------

class StreamingEngine:
    """Adapter over lazytrain.runtime.StreamingExecutor (keeps its StepResult fields)."""

    def __init__(self, model: torch.nn.Module, plan, *, device: torch.device | None,
                 nvme_dir: Path | None, optimizer: str, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, max_grad_norm: float | None,
                 trace_path: Path | None, compute_dtype: torch.dtype | None = None,
                 master_dtype: torch.dtype = torch.float32, count_op_temporaries: bool = False,
                 loss_scale: tuple[float, int] = (2.0 ** 16, 2000)) -> None:
        """`loss_scale`: fp16's (initial scale, growth interval) (runtime.loss_scale)."""
        try:
            from ..runtime import StreamingExecutor
            from ..runtime.loss_scale import DynamicLossScale
        except ImportError as e:
            raise EngineUnavailable(f"the streaming executor is not available ({e}); "
                                    f"use engine=torch or engine=deepspeed") from None
        # train mode, as engine=torch and DeepSpeed train: from_pretrained gives an eval-mode
        # model, and a model.path checkpoint's dropout was silently off here (review); the
        # executor runs the model in the mode it is given and probes its structure in it
        model.train()
        self.ex = StreamingExecutor(
            model, plan, device=device, nvme_dir=None if nvme_dir is None else str(nvme_dir),
            optimizer=optimizer, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, trace_path=None if trace_path is None else str(trace_path),
            compute_dtype=compute_dtype, master_dtype=master_dtype,
            count_op_temporaries=count_op_temporaries,
            loss_scale=DynamicLossScale(scale=loss_scale[0], growth_interval=loss_scale[1])
            if compute_dtype == torch.float16 else None)

    @property
    def model(self) -> torch.nn.Module:
        return self.ex.model

    def train_step(self, micro_batches, weights=None):
        return _stats(self.ex.train_step(list(micro_batches), weights))

    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
                  position_ids: torch.Tensor | None = None) -> float:
        return self.ex.eval_loss(input_ids, labels, position_ids)

    def set_lr(self, lr: float) -> None:
        # Updates of the previous step may still be queued (on CUDA they overlap the next
        # forward): each took a copy of the hyper-parameters when it was queued, so they keep
        # their own step's lr (test_executor: queued updates keep their step's lr). Waiting here
        # would serialise them with the next step, outside its timing.
        self.ex.set_lr(lr)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.ex.state_dict()

    def state_shards(self):
        return self.ex.state_shards()

    def load_state_dict(self, sd) -> None:
        self.ex.load_state_dict(sd)

    def sync_model(self) -> None:
        self.ex.sync_model(full_precision=True)   # (for saving: the fp32 masters, as trained)

    def close(self) -> None:
        self.ex.close()


# ---- engine=deepspeed ----------------------------------------------------------------------------

class DeepSpeedEngine:
    """Adapter over lazytrain.integrations.deepspeed.DeepSpeedTrainer (its own checkpoint format)."""

    own_checkpoint_format = True

    def __init__(self, model: torch.nn.Module, plan, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, max_grad_norm: float | None,
                 nvme_dir: Path | None = None, overrides: dict | None = None) -> None:
        try:
            from ..integrations.deepspeed import (DeepSpeedTrainer, DeepSpeedUnavailable, check_available,
                                                  ds_config_from_plan)
        except ImportError as e:
            raise EngineUnavailable(f"the DeepSpeed integration is not available ({e})") from None
        msg = check_available()
        if msg:
            raise EngineUnavailable(msg)
        cfg, self.dropped = ds_config_from_plan(
            plan, overrides=overrides, nvme_dir=None if nvme_dir is None else str(nvme_dir / "deepspeed"))
        try:
            self.tr = DeepSpeedTrainer(model, ds_config=cfg, lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        except DeepSpeedUnavailable as e:
            raise EngineUnavailable(str(e)) from None
        except (AssertionError, ValueError, TypeError) as e:   # DeepSpeed's own config checks
            first = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
            raise EngineUnavailable(f"deepspeed.initialize refused the config: {first}") from e
        self._model = model

    @property
    def model(self) -> torch.nn.Module:
        return getattr(self.tr, "model", self._model)

    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
                  position_ids: torch.Tensor | None = None) -> float:
        return float(self.tr.eval_loss(input_ids, labels, position_ids))

    def train_step(self, micro_batches, weights=None):
        t0 = time.perf_counter()
        res = self.tr.train_step(list(micro_batches), weights)
        if isinstance(res, (float, int)) or torch.is_tensor(res):
            tokens = sum(int(mb[0].numel()) for mb in micro_batches)
            return StepStats(loss=float(res), grad_norm=None, skipped=False,
                             step_time_s=time.perf_counter() - t0,
                             device_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                             tokens=tokens)
        return _stats(res)

    def set_lr(self, lr: float) -> None:
        self.tr.set_lr(lr)

    def save_pretrained(self, d: Path, write: bool = True, base_dir: Path | None = None) -> None:
        """HF dir (full) / PEFT adapter dir (LoRA) gathered from ZeRO-3's partitions (a collective:
        every rank calls it; only those with `write` write files). `base_dir`: LoRA's frozen base
        model too, an HF dir there (from the same gather)."""
        self.tr.save_pretrained(str(d), write=write, base_dir=None if base_dir is None else str(base_dir))

    def save(self, d: Path, client_state: dict) -> None:
        self.tr.save_checkpoint(str(d), client_state)

    def load(self, d: Path) -> dict:
        return self.tr.load_checkpoint(str(d))

    def state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("DeepSpeed checkpoints use DeepSpeedEngine.save")

    def load_state_dict(self, sd) -> None:
        raise NotImplementedError("DeepSpeed checkpoints use DeepSpeedEngine.load")

    def sync_model(self) -> None:
        pass

    def close(self) -> None:
        close = getattr(self.tr, "close", None)
        if close:
            close()
