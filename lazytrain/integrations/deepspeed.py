"""DeepSpeed ZeRO-3 as lazytrain's scale-out engine and its side-by-side peer.

    msg = check_available()                       # None, or one line saying what to install
    cfg, dropped = ds_config_from_plan(plan)      # see ds_config.py
    tr = DeepSpeedTrainer(model, ds_config=cfg, lr=3e-4, max_grad_norm=1.0)
    res = tr.train_step([(input_ids, labels), ...])   # one optimizer step; float(res) is the loss
    tr.save_checkpoint(dir, client_state); client_state = tr.load_checkpoint(dir)
    tr.trainable_state()                          # fp32 master weights of what trains

One process without a launcher (tests, CPU): the rank/world environment is filled in and gloo (CPU)
or nccl (CUDA) is initialised. Under `deepspeed --num_gpus N` or `torchrun` the launcher's
environment is used unchanged, so the same config scales out.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import resource
import socket
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..models.adapter import micro_batch_parts, model_inputs
from .ds_config import ds_config_from_plan, uses_nvme

__all__ = ["check_available", "ds_config_from_plan", "DeepSpeedTrainer", "DeepSpeedStepResult",
           "DeepSpeedUnavailable", "INSTALL_HINT"]

INSTALL_HINT = "install it with `make bench-deps` (or `.venv/bin/pip install deepspeed==0.19.8`)"

# DeepSpeed JIT-builds its C++ ops (cpu_adam ~45 s, async_io ~2 min); keep them across runs.
DEFAULT_EXTENSIONS_DIR = Path.home() / ".cache" / "lazytrain" / "torch_extensions"


class DeepSpeedUnavailable(RuntimeError):
    """DeepSpeed (or one of the ops a config needs) cannot run here; the message says what to do."""


def _prepare_env() -> None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR))


def check_available(nvme: bool = False) -> str | None:
    """None if DeepSpeed can run here, else one line saying what to install.

    `nvme=True` also checks the async_io op NVMe offload needs (libaio headers).
    """
    _prepare_env()
    try:
        import deepspeed  # noqa: F401
        from deepspeed.accelerator import get_accelerator
    except ImportError as e:
        return f"DeepSpeed is not importable ({e}); {INSTALL_HINT}"
    except Exception as e:  # a broken install raises all sorts of things at import
        return f"DeepSpeed failed to import ({type(e).__name__}: {e}); reinstall: {INSTALL_HINT}"
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        import shutil
        if not (shutil.which("c++") or shutil.which("g++")):
            return ("DeepSpeed's CPU Adam op is built with a C++ compiler and none was found; "
                    "install one (Debian: `apt-get install -y g++`)")
    if nvme:
        try:
            builder = acc.create_op_builder("AsyncIOBuilder")
            ok = builder is not None and builder.is_compatible(verbose=False)
        except Exception:
            ok = False
        if not ok:
            return ("DeepSpeed NVMe offload needs the async_io op, which needs libaio: "
                    "install Debian's libaio-dev (`apt-get install -y libaio-dev`)")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> None:
    """Initialise torch.distributed once: launcher env if present, else a one-process group."""
    import deepspeed
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return
    defaults = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)
    # One per collective on every step; says nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks, found by structure (transformers' checkpointable layer class)."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def apply_recompute(model: torch.nn.Module, recompute_blocks: Sequence[int]) -> int:
    """Activation checkpointing on exactly the listed decoder blocks (non-reentrant torch checkpoint,
    the form ZeRO-3's parameter hooks support). Returns how many blocks recompute."""
    blocks = decoder_blocks(model)
    wanted = set(int(i) for i in recompute_blocks)
    bad = sorted(i for i in wanted if not 0 <= i < len(blocks))
    if bad:
        raise ValueError(f"recompute_blocks {bad} out of range: the model has {len(blocks)} decoder blocks")
    ckpt = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for i, b in enumerate(blocks):
        b.gradient_checkpointing = i in wanted
        b._gradient_checkpointing_func = ckpt
    return len(wanted)


def _fp16_loss_scale(engine) -> float | None:
    """DeepSpeed's current fp16 loss scale (its fp16 and ZeRO optimizers keep it as `cur_scale`);
    None without fp16 (metrics.jsonl logs it as the other engines' `loss_scale`)."""
    try:
        if not engine.fp16_enabled():
            return None
        scale = getattr(engine.optimizer, "cur_scale", None)
        return None if scale is None else float(scale)
    except (AttributeError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class DeepSpeedStepResult:
    """One optimizer step; the same fields the streaming executor's StepResult reports."""
    loss: float                 # mean over micro-batches
    grad_norm: float | None     # global norm before clipping
    skipped: bool
    step_time_s: float
    device_peak_bytes: int      # CUDA: max allocated; CPU: the process's peak RSS
    tokens: int
    loss_scale: float | None = None   # fp16: DeepSpeed's dynamic loss scale this step's backward ran with

    def __float__(self) -> float:
        return self.loss


class ResumeUnsupported(ValueError):
    """A checkpoint this DeepSpeed setup cannot load correctly (said whole, with what to do)."""


class DeepSpeedTrainer:
    """A Hugging Face causal LM (PEFT-wrapped for LoRA: only its trainable parameters train) run by
    `deepspeed.initialize` with a ZeRO-3 config. Optimizer: DeepSpeed's AdamW (DeepSpeedCPUAdam when
    the optimizer is offloaded); clipping: DeepSpeed's `gradient_clipping`."""

    def __init__(self, model: torch.nn.Module, *, ds_config: Mapping[str, Any], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float | None = None) -> None:
        msg = check_available(nvme=uses_nvme(ds_config))
        if msg:
            raise DeepSpeedUnavailable(msg)
        import deepspeed
        _quiet_deepspeed()
        cfg = copy.deepcopy(dict(ds_config))
        extra = cfg.pop("lazytrain", {}) or {}
        cfg.setdefault("optimizer", {"type": "AdamW", "params": {
            "lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay}})
        cfg["gradient_clipping"] = float(max_grad_norm) if max_grad_norm else 0.0
        cfg.setdefault("train_micro_batch_size_per_gpu", 1)
        cfg.setdefault("gradient_accumulation_steps", 1)
        for sec in ("offload_param", "offload_optimizer"):
            path = cfg.get("zero_optimization", {}).get(sec, {}).get("nvme_path")
            if path and cfg["zero_optimization"][sec].get("device") == "nvme":
                try:
                    Path(path).mkdir(parents=True, exist_ok=True)
                except OSError as e:   # (a traceback, after the model was built; review)
                    raise ValueError(f"zero_optimization.{sec}.nvme_path {path} cannot be made: "
                                     f"{e.strerror or e}") from None
        self.recompute_blocks = apply_recompute(model, extra.get("recompute_blocks", []))
        self.ds_config = cfg
        init_distributed()
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (LoRA: wrap it with PEFT first)")
        # ZeRO-3 swaps torch.nn.functional.linear for its own autograd function, process-wide, and
        # never swaps it back: restored in close(), so what runs next in this process (another
        # engine, a plain model) saves and computes what it would have
        self._linear = torch.nn.functional.linear
        try:
            self.engine, self.optimizer, _, _ = deepspeed.initialize(
                model=model, model_parameters=params, config=cfg)
        except BaseException:   # (it may have swapped it before failing)
            torch.nn.functional.linear = self._linear
            raise
        self.model = self.engine.module
        self._cuda = torch.cuda.is_available()

    # ---- training --------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for g in self.engine.optimizer.param_groups:
            g["lr"] = lr

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, ...]],
                   weights: Sequence[float] | None = None) -> DeepSpeedStepResult:
        """One optimizer step over `gradient_accumulation_steps` micro-batches of (input_ids, labels)
        or (input_ids, labels, position_ids) (packed rows);
        `weights`: each micro-batch's in the step's mean loss (default 1; see
        lazytrain.runtime.StreamingExecutor.train_step)."""
        gas = self.engine.gradient_accumulation_steps()
        if len(micro_batches) != gas:
            raise ValueError(f"got {len(micro_batches)} micro-batches; the DeepSpeed config accumulates "
                             f"{gas} (job.grad_accum)")
        t0 = time.perf_counter()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        self.engine.train()
        dev = self.engine.device
        scale = _fp16_loss_scale(self.engine)   # (before the step: an overflow backs it off)
        total, tokens = 0.0, 0
        for k, mb in enumerate(micro_batches):
            x, y, pos = micro_batch_parts(mb, f"micro-batch {k}")
            out = self.engine(**model_inputs(x, y, pos, dev))
            w = 1.0 if weights is None else float(weights[k])
            self.engine.backward(out.loss * w)   # DeepSpeed scales by 1/gas itself
            self.engine.step()                   # applies the update at the accumulation boundary
            total += float(out.loss.detach()) * w
            tokens += int(x.numel())
        gn = self.engine.get_global_grad_norm()
        gn = None if gn is None else float(gn)
        skipped = (gn is not None and not math.isfinite(gn)) or not self.engine.was_step_applied()
        peak = (torch.cuda.max_memory_allocated() if self._cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return DeepSpeedStepResult(loss=total / gas, grad_norm=gn, skipped=skipped,
                                   step_time_s=time.perf_counter() - t0, device_peak_bytes=int(peak),
                                   tokens=tokens, loss_scale=scale)

    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor,
                  position_ids: torch.Tensor | None = None) -> float:
        """The model's mean language-model loss on one batch, no gradients, eval mode. Every rank
        runs it (ZeRO-3 gathers each layer's parameters from all ranks)."""
        from ..recipes.engines import lm_loss

        self.engine.eval()
        try:
            with torch.no_grad():
                dev = self.engine.device
                return float(lm_loss(self.engine, input_ids, labels, getattr(self.engine.module, "config", None),
                                     position_ids, dev))
        finally:
            self.engine.train()

    # ---- checkpoints (DeepSpeed's own format: one dir per step + a `latest` file) ---------------
    def save_checkpoint(self, directory: str | os.PathLike, client_state: Mapping[str, Any] | None = None) -> None:
        self.engine.save_checkpoint(str(directory), client_state=dict(client_state or {}))

    def load_checkpoint(self, directory: str | os.PathLike) -> dict[str, Any]:
        d = Path(directory)
        if (self.ds_config.get("zero_optimization") or {}).get("offload_optimizer", {}).get("device") == "nvme":
            # DeepSpeed 0.19's ZeRO-3 load purges the NVMe-swapped optimizer state and the next
            # swap-in overwrites what it restored: such a run went on from its initial weights,
            # printing "resumed" (review; its checkpoint on disk is right)
            raise ResumeUnsupported(
                "this run's optimizer state is on NVMe (zero_optimization.offload_optimizer.device=nvme), "
                "which DeepSpeed 0.19 does not restore on load (the run would go on from its initial "
                "weights); resume it with the optimizer on the host: "
                "+deepspeed.zero_optimization.offload_optimizer.device=cpu")
        if not (d / "latest").is_file():
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {d} (missing {d / 'latest'})")
        path, client_state = self.engine.load_checkpoint(str(d), load_optimizer_states=True,
                                                         load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed could not load the checkpoint in {d}")
        _resync_cpu_adam(self.engine)
        return dict(client_state or {})

    # ---- weights out -------------------------------------------------------------------------
    def trainable_state(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """fp32 master weights of every trainable parameter (full FT: the whole model; LoRA: the
        adapters), gathered from ZeRO-3's partitions, keyed by `model.named_parameters()` names.
        The gathers are collective; `keep=False` (ranks that write nothing) takes part without
        keeping host copies."""
        from deepspeed.utils import safe_get_full_fp32_param
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                full = safe_get_full_fp32_param(p)
                if keep:
                    out[name] = full.detach().to("cpu", copy=True).reshape(p.ds_shape)
        return out

    def full_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The whole `model.state_dict()` gathered to CPU (compute dtype; trainable parameters
        replaced by their fp32 masters), ready for `model.save_pretrained(dir, state_dict=...)`.
        Collective; with `keep=False` nothing is copied to the host (an empty dict)."""
        import deepspeed
        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            sd = ({k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
                  if keep else {})
        masters = self.trainable_state(keep=keep)
        # named_parameters() lists a tied weight once (under its first name, the embedding's):
        # every alias of it gets the master, or the file holds the fp32 embedding next to a
        # compute-dtype lm_head and from_pretrained unties them ("different values")
        first = {id(p): n for n, p in self.model.named_parameters()}
        for alias, p in self.model.named_parameters(remove_duplicate=False):
            if first[id(p)] in masters and alias in sd:
                sd[alias] = masters[first[id(p)]]
        for k in sd:
            if k in masters:
                sd[k] = masters[k]
        return sd

    def save_pretrained(self, directory: str | os.PathLike, write: bool = True,
                        base_dir: str | os.PathLike | None = None) -> None:
        """HF dir (full FT) or PEFT adapter dir (LoRA) from the gathered weights, safetensors.
        Gathering is collective: under a launcher every rank calls this, one with `write`.
        `base_dir` (a PEFT model): its frozen base model too, as an HF dir, from the same gather."""
        sd = self.full_state_dict(keep=write)
        if write:
            self.model.save_pretrained(str(directory), state_dict=sd)
            if base_dir is not None:
                from ..models.lora import save_base_model
                save_base_model(self.model, base_dir, peft_state=sd)

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()
        torch.nn.functional.linear = self._linear


def _resync_cpu_adam(engine: Any) -> None:
    """Make DeepSpeedCPUAdam's bias correction after a resume bit-identical to an uninterrupted run.

    Its C++ side keeps beta^t as a running float product (`beta_t *= beta` each step) but restarts
    from `pow(beta, t)` after a load, which differs in the last bit and lets resumed losses drift
    from step t+2 on. Replaying the t increments on a 1-element dummy rebuilds the same product.
    """
    basic = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    fused = hasattr(basic, "multi_tensor_adam") and not torch.cuda.is_available()
    if basic is None or not (fused or hasattr(basic, "ds_opt_adam")):
        return
    g = basic.param_groups[0]
    beta1, beta2 = g["betas"]
    p, grad, m, v = (torch.zeros(1) for _ in range(4))
    steps = [int(s["step"]) for s in basic.state.values() if isinstance(s, dict) and "step" in s]
    if fused:
        # The optimizer not offloaded (offload_optimizer none: LoRA's plans here) is FusedAdam,
        # whose CPU build runs the same C++ Adam with the same running products: resumed LoRA
        # losses were 2e-4 off an uninterrupted run's from the second step on (review).
        n = max(steps) if steps else 0

        def replay(t: int) -> None:
            basic.multi_tensor_adam(2048 * 32, basic._dummy_overflow_buf, [[grad], [p], [m], [v]], 0.0, beta1,
                                    beta2, g["eps"], t, basic.adam_w_mode, 1 if g["bias_correction"] else 0, 0.0)
    else:
        n = max(steps) if steps else int(getattr(engine, "global_steps", 0))

        def replay(t: int) -> None:
            basic.ds_opt_adam.adam_update(basic.opt_id, t, 0.0, beta1, beta2, g["eps"], 0.0,
                                          g.get("bias_correction", True), p, grad, m, v)
    for t in range(1, n + 1):   # lr 0 on a dummy: only the running beta products change
        replay(t)
