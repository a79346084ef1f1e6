"""Streamed MoE inference: SSD-resident experts, an expert cache, routing predictors.

    from lazytrain.moe import convert_checkpoint, load_streamed, generate
    convert_checkpoint("HF_DIR", "STORE_DIR")
    res = generate("STORE_DIR", prompt="...", max_new_tokens=64, cache_fraction=0.45, prefetch="gate")
"""

from .api import GenerateResult, generate, record_traces, train_predictor
from .arch import NotMoeModelError, find_moe_layers
from .cache import CacheTooSmallError, ExpertCache
from .convert import convert_checkpoint, convert_model
from .engine import EXPERTS_IMPL, StreamedMoE, load_streamed, register_experts_implementation
from .stats import MoeStats
from .store import ExpertStore, StoreError, StoreMismatchError

__all__ = ["GenerateResult", "generate", "record_traces", "train_predictor", "NotMoeModelError",
           "find_moe_layers", "CacheTooSmallError", "ExpertCache", "convert_checkpoint", "convert_model",
           "EXPERTS_IMPL", "StreamedMoE", "load_streamed", "register_experts_implementation", "MoeStats",
           "ExpertStore", "StoreError", "StoreMismatchError"]
