"""Build (on first use) and load the C++ fused step in csrc/adam8bit.cpp (see lazytrain.cext).

When it cannot be built, :func:`load` returns None with the reason in :func:`unavailable_reason`
and the optimizer falls back to the pure-torch kernel.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from ..cext import Extension

_EXT = Extension("lazytrain_adam8bit", Path(__file__).with_name("csrc") / "adam8bit.cpp",
                 "fused 8-bit AdamW C++ kernel", "the slower pure-torch kernel")


def build_dir() -> Path:
    """Where the compiled extension lives (created on demand)."""
    return _EXT.build_dir()


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled extension, building it on first use; None (with a reason) if it cannot be."""
    return _EXT.load(verbose)


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when it has not been tried or succeeded)."""
    return _EXT.unavailable_reason()
