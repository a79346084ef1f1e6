"""One flat buffer per layer: a layout maps each parameter to a slice, so one transfer moves a layer."""

from __future__ import annotations

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
        """Per-tensor views into `flat` (a 1-D tensor of this layout's dtype)."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def gather(self, tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy each tensor into its slice of `flat` (casting to the flat buffer's dtype)."""
        for t, o, n in zip(tensors, self.offsets, self.numels):
            flat[o:o + n].copy_(t.reshape(-1))


def typed(buf: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first `numel` elements of a uint8 buffer viewed as `dtype`."""
    size = dtype.itemsize
    return buf[:numel * size].view(dtype)
