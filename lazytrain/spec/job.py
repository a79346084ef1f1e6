"""JobSpec: what one training step does."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from .units import dtype_bytes

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# what the executor and the engines compute in (spec.units also sizes int8/fp8, which nothing here
# trains in: a plan for them was a plan no job could run)
COMPUTE_DTYPES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def short_dtype(name: str) -> str:
    """A compute dtype's one spelling: bf16 | fp16 | fp32 (an unknown name as it is)."""
    return _SHORT.get(name, name)


@dataclass(frozen=True)
class JobSpec:
    batch_size: int = 1                 # sequences per micro-batch
    seq_len: int = 512
    grad_accum: int = 1                 # micro-batches per optimizer step
    mode: str = "full"                  # "full" | "lora"
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    compute_dtype: str = "bf16"
    master_dtype: str = "fp32"
    optimizer_state_bits: int = 32      # 32 or 8
    clip_grad: bool = False             # gradient clipping: updates wait for the global norm, i.e.
                                        # run after the whole backward, overlapping the next forward
    loss_chunk_tokens: int = 0          # > 0: the loss runs over chunks of this many tokens, each
                                        # chunk's logits recomputed in backward (models/chunked_loss.py):
                                        # ~chunk x vocab bytes instead of 12 x tokens x vocab; 0: the
                                        # model's own loss
    packed_rows: bool = False           # sequences hold several rows (prompt/completion, chat) that
                                        # attend only to themselves: transformers gives every
                                        # attention block an explicit mask, which SDPA saves

    def __post_init__(self) -> None:
        for k in ("batch_size", "seq_len", "grad_accum", "lora_rank", "optimizer_state_bits", "loss_chunk_tokens"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool):   # "abc" failed a comparison, 1.5 planned
                raise ValueError(f"job.{k} must be an integer, got {v!r}")
        for k in ("clip_grad", "packed_rows"):
            if not isinstance(getattr(self, k), bool):   # ('no' is a true string)
                raise ValueError(f"job.{k} must be true or false, got {getattr(self, k)!r}")
        if self.mode not in ("full", "lora"):
            raise ValueError(f"job.mode must be 'full' or 'lora', got {self.mode!r}")
        if self.optimizer_state_bits not in (8, 32):
            raise ValueError(f"job.optimizer_state_bits must be 8 or 32, got {self.optimizer_state_bits}")
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"job.loss_chunk_tokens must be >= 0 (0: off), got {self.loss_chunk_tokens}")
        for k in ("batch_size", "seq_len", "grad_accum"):
            if getattr(self, k) < 1:
                raise ValueError(f"job.{k} must be >= 1, got {getattr(self, k)}")
        if self.mode == "lora" and self.lora_rank < 1:
            raise ValueError(f"job.lora_rank must be >= 1, got {self.lora_rank}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"job.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, "
                             f"got {self.compute_dtype!r}")
        # one spelling from here on (DeepSpeed's config took "float16" for no fp16 at all: review)
        object.__setattr__(self, "compute_dtype", short_dtype(self.compute_dtype))
        alpha = self.lora_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"job.lora_alpha must be a number > 0, got {alpha!r}")
        if self.master_dtype not in ("fp32", "bf16"):
            raise ValueError(f"job.master_dtype must be fp32 (mixed precision) or bf16 (pure-bf16 "
                             f"training), got {self.master_dtype!r}")
        if self.master_dtype == "bf16" and self.optimizer_state_bits == 8:
            raise ValueError("job.optimizer_state_bits=8 keeps an fp32 master copy; use "
                             "job.master_dtype=fp32 with it")
        targets = self.lora_targets
        if isinstance(targets, str):   # job.lora_targets=q_proj (or "q_proj,v_proj"): names, not letters
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        object.__setattr__(self, "lora_targets", tuple(targets))

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_micro_batch * self.grad_accum

    @property
    def compute_bytes(self) -> int:
        return dtype_bytes(self.compute_dtype)

    @property
    def master_bytes(self) -> int:
        return dtype_bytes(self.master_dtype)

    @property
    def optimizer_state_bytes_per_param(self) -> float:
        """m and v: 2 x 4 bytes in fp32 (2 x 2 with a bf16 master: pure-bf16 training keeps the
        moments in the parameters' dtype, as torch's AdamW does); 2 x (1 byte + an fp32 absmax per
        256-block) in 8-bit (AdamW8bit's default block)."""
        if self.optimizer_state_bits == 8:
            return 2.0 * (1 + 4 / 256)
        return 2.0 * min(4, self.master_bytes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobSpec":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown job keys {unknown}; valid: {sorted(known)}")
        d = dict(d)
        if "lora_targets" in d and not isinstance(d["lora_targets"], str):
            d["lora_targets"] = tuple(d["lora_targets"])
        return cls(**d)
