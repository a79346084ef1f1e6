"""The executor's resumable state as a flat dict of tensors (safetensors-able): per layer the fp32
master weights, AdamW moments and step; LoRA adapters and their optimizer state; the step count
and, for fp16, the loss scale."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Mapping

import torch

if TYPE_CHECKING:
    from .executor import StreamingExecutor


def executor_state_dict(ex: "StreamingExecutor") -> dict[str, torch.Tensor]:
    """Master weights, optimizer state and step of `ex`; tensors only (safetensors-able)."""
    sd: dict[str, torch.Tensor] = {}
    for shard in executor_state_shards(ex):
        sd.update(shard)
    return sd


def executor_state_shards(ex: "StreamingExecutor") -> Iterator[dict[str, torch.Tensor]]:
    """The same state, one layer at a time (then adapters and the step): a checkpoint writer that
    saves each shard as it comes holds one layer's state in RAM, not the whole model's (which may
    live on NVMe)."""
    ex.wait()
    for st in ex.states:
        if st is None:
            continue
        sd: dict[str, torch.Tensor] = {}
        if ex.opt8 is not None:  # 8-bit: master weights here, codes + absmax + step from AdamW8bit
            sd[f"layer.{st.name}.master"] = st.load_tensor("master")
            osd = ex.opt8[st.name].state_dict()
            for k, v in next(iter(osd["state"].values()), {}).items():
                sd[f"layer8.{st.name}.{k}"] = v.detach().cpu().clone() if torch.is_tensor(v) else torch.tensor(v)
            sd[f"layer8.{st.name}.skipped_steps"] = torch.tensor(osd["lazytrain"]["skipped_steps"])
            yield sd
            continue
        for what in ("master", "exp_avg", "exp_avg_sq"):
            sd[f"layer.{st.name}.{what}"] = st.load_tensor(what)
        sd[f"layer.{st.name}.step"] = st.step.clone()
        yield sd
    sd = {"meta.step": torch.tensor(ex.step_count, dtype=torch.int64)}
    if ex.loss_scale is not None:   # fp16: resumed steps scale (and skip) as uninterrupted ones
        sd["meta.loss_scale"] = torch.tensor(ex.loss_scale.scale, dtype=torch.float64)
        sd["meta.loss_scale_growth_tracker"] = torch.tensor(ex.loss_scale.growth_tracker, dtype=torch.int64)
    if ex.adapter_opt is not None:
        for p in ex.adapter_params:
            name = ex.param_names[id(p)]
            sd[f"adapter.{name}"] = p.detach().cpu().clone()
            state = ex.adapter_opt.state.get(p, {})
            for k, v in state.items():
                sd[f"adapter_state.{name}.{k}"] = v.detach().cpu().clone()
    yield sd

def load_executor_state_dict(ex: "StreamingExecutor", sd: Mapping[str, torch.Tensor]) -> None:
    ex._settle()   # (a failed update or write before it is replaced here, not raised: review)
    ex.streamer.invalidate()
    ex.step_count = int(sd["meta.step"])
    if ex.loss_scale is not None and "meta.loss_scale" in sd:   # (a bf16 run's state has none: the default)
        ex.loss_scale.load_state_dict({"scale": float(sd["meta.loss_scale"]),
                                       "growth_tracker": int(sd["meta.loss_scale_growth_tracker"])})
    for i, st in enumerate(ex.states):
        if st is None:
            continue
        if ex.opt8 is not None:
            _load_8bit_layer(ex, i, st, sd)
            continue
        for what in ("master", "exp_avg", "exp_avg_sq"):
            key = f"layer.{st.name}.{what}"
            if key not in sd:
                raise KeyError(f"state dict has no {key} (saved from a different model or plan?)")
            st.store_tensor(what, sd[key])
        st.set_step(sd[f"layer.{st.name}.step"])
        ex._publisher(i)(st.master())
    if ex.adapter_opt is not None:
        for p in ex.adapter_params:
            name = ex.param_names[id(p)]
            p.data.copy_(sd[f"adapter.{name}"].to(p.device))
            state = {}
            for k in ("step", "exp_avg", "exp_avg_sq"):
                key = f"adapter_state.{name}.{k}"
                if key in sd:
                    v = sd[key]
                    state[k] = v.clone() if k == "step" else v.to(p.device).clone()
            if state:
                ex.adapter_opt.state[p] = state



def _load_8bit_layer(ex: "StreamingExecutor", i: int, st, sd: Mapping[str, torch.Tensor]) -> None:
    key = f"layer.{st.name}.master"
    if key not in sd:
        raise KeyError(f"state dict has no {key} (saved from a different model or plan?)")
    st.store_tensor("master", sd[key])
    opt = ex.opt8[st.name]
    prefix = f"layer8.{st.name}."
    saved = {k[len(prefix):]: sd[k] for k in sd if k.startswith(prefix)}  # keys only: sd may be lazy
    if "step" not in saved and "skipped_steps" not in saved:
        raise KeyError(f"state dict has no 8-bit optimizer state for {st.name} (saved with optimizer=adamw?)")
    osd = opt.state_dict()
    osd["lazytrain"]["skipped_steps"] = int(saved.pop("skipped_steps", torch.tensor(0)))
    state = {k: (int(v) if k == "step" else v) for k, v in saved.items()}
    # no state yet: saved before the first update that ran (every step so far skipped, an fp16
    # overflow), which was refused as a checkpoint of another optimizer (review)
    osd["state"] = {0: state} if state else {}
    opt.load_state_dict(osd)
    ex._publisher(i)(st.master())
