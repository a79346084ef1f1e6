"""Large CPU-to-CPU byte copies with non-temporal stores (csrc/stream_copy.cpp).

A host-tier weight fetch on a CPU compute device is a memcpy whose destination (a streaming buffer)
is out of cache; non-temporal stores skip reading it first. :func:`copy_into` uses the extension
for large contiguous CPU copies between tensors of the same dtype and shape, and ``Tensor.copy_``
for everything else (casts, broadcasts, CUDA tensors, copies under ``MIN_BYTES``, or no C++
compiler: then the build's failure is logged once, and ``LAZYTRAIN_NO_CPP=1`` skips it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..cext import Extension

# Below this copy_ is kept: a copy that fits well inside the last-level cache gains little from
# streaming stores (and copy_ leaves its result in cache), and a small model then never waits for
# the first-use build (~10 s here). A 220M Llama's blocks are 25.7 MB, Llama-3-8B's 436 MB.
MIN_BYTES = 16 << 20

_EXT = Extension("lazytrain_stream_copy", Path(__file__).with_name("csrc") / "stream_copy.cpp",
                 "streaming-copy C++ kernel", "torch's copy_")


def available() -> bool:
    """Whether the extension is (or can be) built here."""
    return _EXT.load() is not None


def _plain(t: torch.Tensor) -> bool:
    """A CPU tensor whose bytes are its values: contiguous, no lazy conjugate/negation, and not
    tracked by autograd (copy_ would record or refuse the write)."""
    return (t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and not t.requires_grad)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, with streaming stores when both are large plain CPU tensors of the same
    dtype and shape (anything else, including a copy onto itself, is left to copy_)."""
    if (dst.dtype == src.dtype and dst.shape == src.shape and dst.nbytes >= MIN_BYTES
            and dst.data_ptr() != src.data_ptr() and _plain(dst) and _plain(src)):
        mod = _EXT.load()
        if mod is not None:
            mod.stream_copy(dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8))
            return
    dst.copy_(src)
