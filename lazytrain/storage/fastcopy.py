"""Large CPU-to-CPU byte copies with non-temporal stores (csrc/stream_copy.cpp).

A host-tier weight fetch on a CPU compute device is a memcpy whose destination (a streaming buffer)
is out of cache; non-temporal stores skip reading it first. :func:`copy_into` uses the extension
for large contiguous CPU copies of equal byte size and ``Tensor.copy_`` for everything else
(different dtypes, CUDA tensors, small copies, or no C++ compiler).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..cext import Extension

# Below this copy_ is kept: a copy that fits well inside the last-level cache gains little from
# streaming stores (and copy_ leaves its result in cache), and a small model then never waits for
# the first-use build (~20 s here). A 220M Llama's blocks are 25.7 MB, Llama-3-8B's 436 MB.
MIN_BYTES = 16 << 20

_EXT = Extension("lazytrain_stream_copy", Path(__file__).with_name("csrc") / "stream_copy.cpp",
                 "streaming-copy C++ kernel", "torch's copy_")


def available() -> bool:
    """Whether the extension is (or can be) built here."""
    return _EXT.load() is not None


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, with streaming stores when both are large contiguous CPU tensors of the
    same dtype and shape."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.nbytes >= MIN_BYTES
            and dst.is_contiguous() and src.is_contiguous()):
        mod = _EXT.load()
        if mod is not None:
            mod.stream_copy(dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8))
            return
    dst.copy_(src)
