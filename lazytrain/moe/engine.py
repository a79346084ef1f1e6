"""Streamed MoE inference: the HF model with non-expert weights resident and experts served by the
expert cache, plugged in through transformers' experts-implementation interface.

We register `lazytrain_stream` in `ExpertsInterface` and select it with
`model.set_experts_implementation(...)`; every experts module then calls `_stream_experts_forward`
with the model's own routing (top_k_index, top_k_weights). We load those experts, remap expert ids to
cache slots, and run the model's original experts kernel (grouped_mm / batched_mm / eager) on
slot-indexed views of the cache pool. Same kernel, same weights, same routing: the output is the
all-resident model's output, token for token.

With the grouped_mm and batched_mm kernels the views are the pool's ([slots, ...], strided over the
span of the routed slots) and expert ids are remapped to slot ids: the kernel reads the routed slots
in place and no expert weight is copied (grouped_mm, which visits every slot of the span, gathers
instead when the span is mostly other slots: see _proxy). Both kernels sum a token's top-k outputs
by position, so the order of the groups (slot order, not expert order) does not change which
rows are summed; in fp32 the grouped_mm path can still differ from the all-resident model in the
last bit (a review: up to 1.8e-7 in the logits at hidden 64, none at 256; bf16 and fp16 equal):
transformers sorts the routed rows with an unstable sort, so slot ids put rows at other positions
within a group's GEMM, which CPU BLAS blocks and rounds differently. Tokens were equal throughout.
The eager kernel adds each expert's output in the loop's order (expert order), so it gets the
routed experts gathered into contiguous [n_routed, ...] tensors under ids 0..n-1 (sorted: the same
order).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from .arch import MoeLayer, NotMoeModelError, build_meta_model, find_moe_layers, load_dtypes
from .cache import ExpertCache
from .convert import check_store_source, read_hf_config, refuse_quantized
from .policies import Forecast, make_policy
from .predictor import Oracle, PredictorHeads, SpeculativeGate, TrainedPredictor
from .stats import MoeCounters, MoeStats
from .store import ExpertStore, StoreError, StoreMismatchError

_LOG = logging.getLogger(__name__)

EXPERTS_IMPL = "lazytrain_stream"
ZERO_COPY_KERNELS = ("grouped_mm", "batched_mm")   # read the pool's slots in place
SLOT_OVERHEAD_BYTES = 128 << 10   # grouped_mm's cost of one unrouted slot in its views, as copy bytes


def _stream_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    return self._lazytrain_engine.forward_layer(self, hidden_states, top_k_index, top_k_weights)


def register_experts_implementation() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPL, _stream_experts_forward)


def _base_forward(model: nn.Module, experts: nn.Module):
    """The kernel the all-resident model would use (its configured experts implementation)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = model.config._experts_implementation
    if name in (None, "eager", EXPERTS_IMPL) or name not in ALL_EXPERTS_FUNCTIONS:
        return type(experts).forward.__wrapped__, "eager"
    return ALL_EXPERTS_FUNCTIONS[name], name


class StreamedMoE:
    """A model whose experts stream from an ExpertStore through an ExpertCache."""

    def __init__(self, model: nn.Module, layers: list[MoeLayer], store: ExpertStore, cache: ExpertCache,
                 predictor=None, auto_lookahead: int = 0) -> None:
        self.model, self.layers, self.store, self.cache = model, layers, store, cache
        self.predictor = predictor
        self.auto_lookahead = auto_lookahead        # 0: fixed; else the most layers to look ahead
        self._t_prev, self.layer_s_ema = None, 0.0
        self.step = 0
        self.phase = "prefill"
        self.counters = {"prefill": MoeCounters(), "decode": MoeCounters()}
        self.record: list[tuple[int, tuple[int, ...]]] | None = None     # routing per layer call
        self.record_hidden: list | None = None                           # (layer, x, topk) for training
        self._proxies: dict[int, dict] = {}
        self._base, self.base_name = _base_forward(model, layers[0].experts)
        self.zero_copy = self.base_name in ZERO_COPY_KERNELS   # see the module docstring
        self.slot_overhead_bytes = SLOT_OVERHEAD_BYTES
        for ml in layers:
            ml.experts._lazytrain_engine = self
            ml.experts._lazytrain_layer = ml.index
        register_experts_implementation()
        model.set_experts_implementation(EXPERTS_IMPL)

    @property
    def total_experts(self) -> int:
        return sum(ml.num_experts for ml in self.layers)

    def _proxy(self, experts: nn.Module, layer: int, slots: list[int]) -> tuple[SimpleNamespace, list[int]]:
        """Stands in for the experts module: same flags and activation; weights = the cache pool's
        views of the layer (zero-copy kernels) or the routed experts gathered into contiguous
        [n_routed, ...] tensors. Returns it and the id each routed expert has in it."""
        flags = self._proxies.get(layer)
        if flags is None:
            # flags a transformers release may not have (5.17 lacks the post-expert norm) get the
            # value that means "absent", which is what that release's kernels assume
            flags = dict(has_gate=experts.has_gate, has_bias=getattr(experts, "has_bias", False),
                         is_transposed=experts.is_transposed,
                         has_post_expert_norm=getattr(experts, "has_post_expert_norm", False),
                         post_expert_norm=getattr(experts, "post_expert_norm", None),
                         _is_expert_parallel=False, act_fn=getattr(experts, "act_fn", None),
                         _apply_gate=experts._apply_gate,
                         config=experts.config, training=False)
            self._proxies[layer] = flags
        views = self.cache.layer_views(layer)
        if self.zero_copy:
            lo, hi = min(slots), max(slots)
            span = hi - lo + 1
            # grouped_mm visits every expert of the tensor it is given, routed or not: on the CPU an
            # empty group costs 5-10 us (measured), as long as a ~100 KB copy. The views cover the
            # routed slots' span only, and a span mostly of other slots (few routed, far apart: a
            # decode step in a big cache) is cheaper gathered: the unrouted slots' overhead against
            # the copy of the routed ones (whose groups both ways pay).
            if self.base_name != "grouped_mm" or \
                    (span - len(slots)) * self.slot_overhead_bytes <= len(slots) * self.cache.slot_bytes:
                return SimpleNamespace(num_experts=span, **flags, **{k: v[lo:hi + 1] for k, v in views.items()}), \
                    [s - lo for s in slots]
        idx = torch.tensor(slots, dtype=torch.long, device=self.cache.pool.device)
        weights = {name: v.index_select(0, idx) for name, v in views.items()}
        return SimpleNamespace(num_experts=len(slots), **flags, **weights), list(range(len(slots)))

    def _run(self, experts: nn.Module, x: torch.Tensor, l: int, ids: list[int], slots: list[int],
             top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        proxy, remap = self._proxy(experts, l, slots)
        lut = torch.zeros(self.layers[l].num_experts, dtype=top_k_index.dtype, device=top_k_index.device)
        lut[ids] = torch.tensor(remap, dtype=top_k_index.dtype, device=lut.device)
        return self._base(proxy, x, lut[top_k_index], top_k_weights)

    @torch.no_grad()
    def forward_layer(self, experts: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
        l = experts._lazytrain_layer
        c = self.counters[self.phase]
        step, self.step = self.step, self.step + 1
        if l == 0:
            c.tokens += x.shape[0]
        ids = torch.unique(top_k_index).tolist()                  # one sync: the routing decision
        if self.record is not None:
            self.record.append((l, tuple(ids)))
        if self.record_hidden is not None:
            self.record_hidden.append((l, x.detach().float().clone(), top_k_index.clone()))
        try:
            slots = self._routed(experts, x, l, ids, top_k_index, step, c)
            if self.zero_copy:
                try:
                    return self._run(experts, x, l, ids, slots, top_k_index, top_k_weights)
                except torch.OutOfMemoryError:
                    raise
                except RuntimeError as e:
                    # A device whose kernel refuses views strided over the pool's slots (only the
                    # CPU path is tested here): gather from now on.
                    if self.cache.pool.device.type == "cpu":
                        raise
                    _LOG.warning("%s experts kernel on %s refused the cache pool's strided views (%s); "
                                 "gathering the routed experts instead", self.base_name,
                                 self.cache.pool.device, str(e).splitlines()[0] if str(e) else type(e).__name__)
                    self.zero_copy = False
            return self._run(experts, x, l, ids, slots, top_k_index, top_k_weights)
        finally:
            # The routed slots stay pinned while the kernel is queued on them, and never past this
            # layer: an error in a read or a wait (a transient EIO, Ctrl-C in a stall) must not leave
            # slots pinned, or every later call would find the cache "too small". (On CUDA the
            # kernel may run after this; the next layer's routing sync orders it before any slot
            # is refilled.)
            self.cache.unpin()

    def _routed(self, experts: nn.Module, x: torch.Tensor, l: int, ids: list[int], top_k_index: torch.Tensor,
                step: int, c) -> list[int]:
        """Pin and load layer `l`'s routed experts `ids` (prefetching ahead meanwhile); their slots."""
        waits = self.cache.acquire(l, ids, step, c)
        if self.auto_lookahead and x.shape[0] == 1:
            self._tune_lookahead()
        if self.predictor is not None and x.shape[0] == 1:
            # Issue next-layer reads *before* waiting, so they overlap this layer's compute.
            t0 = time.perf_counter()
            forecast = self.cache.policy if isinstance(self.cache.policy, Forecast) else None
            for target, experts_ in self.predictor.predict(l, x, top_k_index, step):
                self.cache.prefetch(target, experts_, deadline=step + target - l, now=step, c=c)
                if forecast is not None:
                    for e in experts_:
                        forecast.predict((target, e), step + target - l)
            c.predictor_s += time.perf_counter() - t0
        self.cache.wait(waits, c)
        if isinstance(self.cache.policy, Forecast):
            self.cache.policy.observe_layer(l, ids, self.layers[l].num_experts)
        return self.cache.slots(l, ids)

    def _tune_lookahead(self) -> None:
        """Look as many layers ahead as one layer's reads take layers of compute (SeqMoE: one layer's
        compute hides only ~1.4 expert transfers on PCIe 4, so one layer ahead is often too late)."""
        import math

        now = time.perf_counter()
        if self._t_prev is not None and now - self._t_prev < 1.0:
            dt = now - self._t_prev
            self.layer_s_ema = dt if self.layer_s_ema == 0 else 0.9 * self.layer_s_ema + 0.1 * dt
        self._t_prev = now
        if self.layer_s_ema > 0 and self.cache.read_s_ema > 0:
            need_s = self.cache.read_s_ema * self.layers[0].top_k / self.cache.io_workers
            la = min(self.auto_lookahead, max(1, math.ceil(need_s / self.layer_s_ema)))
            target = getattr(self.predictor, "gate", self.predictor)
            if target is not None:
                target.lookahead = la

    # ---- generation ---------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.counters = {"prefill": MoeCounters(), "decode": MoeCounters()}
        self._bytes0 = self.cache.counters.bytes_read

    def stats(self, phase: str = "decode") -> MoeStats:
        host = self.cache.host.num_slots if self.cache.host is not None else 0
        return MoeStats.from_counters(self.counters[phase], self.cache.num_slots, self.total_experts,
                                      self.cache.slot_bytes, self.store.io_mode, host_cache_slots=host)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """Greedy generation; prefill and decode counters are kept apart (decode = steady state)."""
        from transformers.generation.streamers import BaseStreamer

        vocab = self.model.get_input_embeddings().num_embeddings
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]
        if bad.numel():      # else an IndexError deep in the embedding, after the prefill started
            raise ValueError(f"prompt id {bad[0].item()} is outside the vocabulary [0, {vocab})")
        eng = self

        class _Phase(BaseStreamer):
            def __init__(self) -> None:
                self.calls, self.t_decode0 = 0, None

            def put(self, value) -> None:
                self.calls += 1
                if self.calls == 2:        # first generated token is out: prefill is over
                    eng._close_phase("prefill")
                    eng.phase = "decode"
                    self.t_decode0 = time.perf_counter()

            def end(self) -> None:
                pass

        self.phase = "prefill"
        streamer = _Phase()
        t0 = time.perf_counter()
        self._phase_t0, self._phase_bytes0 = t0, self.cache.counters.bytes_read
        out = self.model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False,
                                  streamer=streamer, **kwargs)
        self._close_phase(self.phase)
        self.phase = "prefill"
        return out

    def _close_phase(self, phase: str) -> None:
        now = time.perf_counter()
        c = self.counters[phase]
        c.wall_s += now - self._phase_t0
        c.bytes_read += self.cache.counters.bytes_read - self._phase_bytes0
        self._phase_t0, self._phase_bytes0 = now, self.cache.counters.bytes_read

    def close(self) -> None:
        self.cache.close()
        self.store.close()


def _rebuild_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq, ...) are not in any checkpoint: rebuild those modules
    from their config on the real device."""
    for name, m in list(model.named_modules()):
        if not any(b.is_meta for b in m.buffers(recurse=False)):
            continue
        if any(p.is_meta for p in m.parameters(recurse=False)) or not hasattr(m, "config"):
            raise StoreError(f"{name}: buffers without weights in the store; cannot rebuild")
        with torch.device(device):
            new = type(m)(config=m.config)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)


def check_cache_fraction(fraction) -> float:
    """moe.cache_fraction as a float in (0, 1], or a ValueError naming the setting."""
    try:
        f = float(fraction)
    except (TypeError, ValueError):
        raise ValueError(f"moe.cache_fraction must be a number in (0, 1], got {fraction!r}") from None
    if not (math.isfinite(f) and 0.0 < f <= 1.0):
        raise ValueError(f"moe.cache_fraction must be in (0, 1] (share of all experts kept in device "
                         f"slots), got {fraction}")
    return f


def check_host_cache(fraction, slots) -> float:
    """Validate the host-tier settings before anything is loaded; returns the fraction as a float."""
    try:
        f = float(fraction if fraction is not None else 0.0)
    except (TypeError, ValueError):
        raise ValueError(f"moe.host_cache_fraction must be a number in [0, 1], got {fraction!r}") from None
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"moe.host_cache_fraction must be in [0, 1] (share of all experts kept in "
                         f"host RAM; 0 = no host tier), got {fraction}")
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 0):
        raise ValueError(f"moe.host_cache_slots must be a non-negative integer or null, got {slots!r}")
    return f


def check_device(device) -> None:
    """Validate moe.device before anything is loaded: a bad one would otherwise fail deep inside
    safetensors or the pinned-memory allocator, with a message that does not name the setting."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"moe.device must be cpu or cuda (or cuda:N), got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"moe.device={device} but CUDA is not available on this machine; use moe.device=cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"moe.device={device} but this machine has {torch.cuda.device_count()} CUDA device(s)")


def _check_count(name: str, value) -> None:
    """Slot counts and queue bounds come from the command line: refuse strings and floats here
    rather than as a TypeError inside the cache."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"moe.{name} must be a positive integer or null, got {value!r}")


def load_streamed(store_dir: str | Path, *, model_path: str | Path | None = None,
                  cache_slots: int | None = None, cache_fraction: float = 0.45, eviction: str = "lru",
                  prefetch: str = "gate", predictor_path: str | Path | None = None,
                  lookahead: int | str = 1,
                  prefetch_extra: int = 0, device: str = "cpu", io_workers: int = 2,
                  queue_depth: int | None = None, verify: str = "first", direct: bool = True,
                  future: list | None = None, host_cache_fraction: float = 0.0,
                  host_cache_slots: int | None = None) -> StreamedMoE:
    """Build the model from the store (non-expert weights only) and attach the expert cache.

    prefetch: none | gate (speculative gate) | predictor (trained heads, `predictor_path`) | oracle.
    lookahead: layers predicted ahead, or "auto" (from measured read time vs layer time, at most 4).
    eviction: lru | lfu | forecast (| belady with `future`, benchmark only).
    host_cache_fraction / host_cache_slots: optional host-RAM tier (pinned on CUDA) between the device
    slots and NVMe, as a share of all experts or an exact slot count (which wins); 0 = no host tier.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    host_fraction = check_host_cache(host_cache_fraction, host_cache_slots)
    if not cache_slots:
        cache_fraction = check_cache_fraction(cache_fraction)
    check_device(device)
    if verify not in ("first", "always", "never"):   # (checked by the cache too, after the model loaded)
        raise ValueError(f"moe.verify must be first|always|never, got {verify!r}")
    if isinstance(prefetch_extra, bool) or not isinstance(prefetch_extra, int) or prefetch_extra < 0:
        # (a negative one crashed mid-generation, 1.5 in topk)
        raise ValueError(f"moe.prefetch_extra must be a whole number >= 0, got {prefetch_extra!r}")
    _check_count("cache_slots", cache_slots)
    _check_count("queue_depth", queue_depth)
    store = ExpertStore(store_dir, direct=direct)
    cache = None
    try:
        hf_config, src = store.hf_config, store.dir
        if model_path is not None:
            src = Path(model_path).expanduser()
            hf_config = read_hf_config(src)
        # (a store converted from one before 2026-12-02 holds its raw codes as weights)
        refuse_quantized(hf_config, f"model.path {src}" if model_path is not None else f"expert store {src}")
        model = build_meta_model(hf_config)
        find_moe_layers(model)                 # NotMoeModelError before anything else
        # from_config derives the generation config from config.json alone; the checkpoint's
        # generation_config.json (eos id lists, repetition penalty, ...) is what from_pretrained uses,
        # so without it generate() would differ from the plain model. Same precedence as the tokenizer.
        gen_dir = next((d for d in (src, store.dir) if (d / "generation_config.json").is_file()), None)
        if gen_dir is not None:
            model.generation_config = GenerationConfig.from_pretrained(str(gen_dir))
        if verify != "never":
            store.verify_non_expert()
        try:
            sd = load_file(str(store.non_expert_path), device=str(device))
        except SafetensorError as e:
            raise StoreError(f"{store.non_expert_path}: not a readable safetensors file ({e}); "
                             "reconvert") from None
        # The experts' dtype is the model's: the first floating tensor of the file may be one HF
        # keeps in fp32 in a bf16 checkpoint (glm4_moe, dots1, ernie4_5_moe keep their router
        # weights so; safetensors orders tensors by dtype).
        dtype = getattr(torch, store.layers[0].tensors[0].dtype) if store.layers else \
            next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)
        if dtype != model.dtype:   # (built in the config's; a store converted before 2026-12-01 may differ)
            model = build_meta_model(hf_config, dtype)
        layers = find_moe_layers(model)
        store.check_model(layers)
        expert_keys = {f"{ml.experts_name}.{t.name}" for ml in layers for t in ml.tensors}
        expected = {k: v for k, v in model.state_dict().items() if k not in expert_keys}
        bad = [f"{k}: store {list(sd[k].shape)}, model {list(v.shape)}"
               for k, v in expected.items() if k in sd and tuple(sd[k].shape) != tuple(v.shape)]
        if bad:
            raise StoreMismatchError(f"expert store {store.dir} does not match the model: "
                                     + "; ".join(bad[:4]))
        if model_path is not None:
            # model.path's weights are never loaded (the store's are): refuse a store of others
            check_store_source(src, store, model)
        # Each weight in the dtype from_pretrained gives it (assign=True keeps a tensor's own):
        # a checkpoint may store some in another (fp32 norms or router in a bf16 checkpoint,
        # which from_pretrained casts; until 2026-12-01 a dtype error mid-generate, a review),
        # and what HF keeps in fp32 stays so.
        want = load_dtypes(model, dtype)
        sd = {k: v.to(want[k]) if k in want and v.is_floating_point() and v.dtype != want[k] else v
              for k, v in sd.items()}
        model.load_state_dict(sd, strict=False, assign=True)
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        missing = [k for k, v in model.state_dict().items() if k not in expert_keys and v.is_meta]
        if missing:
            raise StoreMismatchError(f"{store.non_expert_path} lacks {len(missing)} weights, "
                                     f"e.g. {', '.join(missing[:3])}; reconvert")
        for ml in layers:   # expert parameters never get memory: the cache pool serves them
            for t in ml.tensors:
                setattr(ml.experts, t.name, nn.Parameter(torch.empty(0, dtype=dtype, device=device),
                                                         requires_grad=False))
        _rebuild_meta_buffers(model, torch.device(device))
        model.eval()
        model.requires_grad_(False)   # inference only: a direct eng.model(...) call builds no graph

        auto = 0
        if lookahead == "auto":
            auto, lookahead = 4, 1
        elif not isinstance(lookahead, int) or lookahead < 1:
            raise ValueError(f"moe.lookahead must be a positive integer or auto, got {lookahead!r}")
        total = sum(ml.num_experts for ml in layers)
        slots = cache_slots
        if not slots:
            # A share is approximate by nature: raised to the cache's minimum (one layer's experts,
            # all of which a prompt can route to) rather than refused, which a model with one or two
            # MoE layers would otherwise be at the default share. An exact cache_slots below it is
            # refused by the cache.
            slots, least = round(cache_fraction * total), max(ml.num_experts for ml in layers)
            if slots < least:
                _LOG.warning("lazytrain: moe.cache_fraction=%s gives %d of %d experts, fewer than one "
                             "layer's %d; using %d slots (the minimum)", cache_fraction, slots, total,
                             least, least)
                slots = least
        policy = make_policy(eviction, len(layers), future)
        depth = queue_depth or max(4, 2 * max(ml.top_k for ml in layers) * max(lookahead, auto, 1))
        slots = min(slots, total)
        host = host_cache_slots if host_cache_slots is not None else round(host_fraction * total)
        host = min(host, total - slots)      # exclusive tiers: more than the rest would stay empty
        # The predictor before the cache: a bad prefetch setting then fails before any I/O thread exists.
        if prefetch == "none":
            pred = None
        elif prefetch == "gate":
            pred = SpeculativeGate(layers, lookahead, prefetch_extra)
        elif prefetch == "predictor":
            if predictor_path is None:
                raise ValueError("moe.prefetch=predictor needs moe.predictor=FILE "
                                 "(train one with `lazytrain moe train-predictor`)")
            pred = TrainedPredictor(PredictorHeads.load(predictor_path), layers, lookahead, prefetch_extra)
        elif prefetch == "oracle":
            if future is None:
                raise ValueError("prefetch=oracle needs the recorded future routing (benchmark only)")
            pred = Oracle(future, lookahead)
        else:
            raise ValueError(f"unknown moe.prefetch {prefetch!r}; valid: none, gate, predictor")
        cache = ExpertCache(store, slots, policy, device=device, io_workers=io_workers,
                            queue_depth=depth, verify=verify, host_slots=host)
        return StreamedMoE(model, layers, store, cache, pred, auto_lookahead=auto if pred else 0)
    except BaseException:
        if cache is not None:
            cache.close()            # its I/O threads would otherwise keep it and its pool alive
        store.close()
        raise


__all__ = ["StreamedMoE", "load_streamed", "register_experts_implementation", "EXPERTS_IMPL",
           "NotMoeModelError"]
