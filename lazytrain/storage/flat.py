"""One flat buffer per layer: a layout maps each parameter to a slice, so one transfer moves a layer."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from .aligned_io import round_up


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a layer lives inside its flat buffer (offsets/numels in elements)."""
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.offsets[-1] + self.numels[-1] if self.names else 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def padded_nbytes(self) -> int:
        """Size rounded up for O_DIRECT transfers."""
        return round_up(max(self.nbytes, 1))

    @classmethod
    def of(cls, named: list[tuple[str, nn.Parameter]], dtype: torch.dtype) -> "FlatLayout":
        names, shapes, offsets, numels, off = [], [], [], [], 0
        for name, p in named:
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(off)
            numels.append(p.numel())
            off += p.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), tuple(numels), dtype)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor views into `flat` (a 1-D tensor of this layout's dtype). One as_strided per
        tensor: half the cost of slice + view, and the executor makes these for every layer use."""
        if flat.dim() != 1 or flat.stride(0) != 1:
            raise ValueError(f"FlatLayout.views needs a contiguous 1-D tensor, got shape "
                             f"{tuple(flat.shape)} stride {tuple(flat.stride())}")
        if flat.numel() < self.numel:
            raise ValueError(f"FlatLayout.views: the flat tensor has {flat.numel()} elements, the layout "
                             f"needs {self.numel}")
        base = flat.storage_offset()
        return [flat.as_strided(s, st, base + o) for s, st, o in zip(self.shapes, self._strides, self.offsets)]

    @functools.cached_property
    def _strides(self) -> tuple[tuple[int, ...], ...]:
        """Contiguous strides of each shape."""
        out = []
        for shape in self.shapes:
            st, acc = [], 1
            for d in reversed(shape):
                st.append(acc)
                acc *= d
            out.append(tuple(reversed(st)))
        return tuple(out)

    def gather(self, tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy each tensor into its slice of `flat` (casting to the flat buffer's dtype)."""
        for t, o, n in zip(tensors, self.offsets, self.numels):
            flat[o:o + n].copy_(t.reshape(-1))


def typed(buf: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first `numel` elements of a uint8 buffer viewed as `dtype`."""
    size = dtype.itemsize
    return buf[:numel * size].view(dtype)
