"""Build (on first use) and load the C++ fused step in csrc/adam8bit.cpp.

The extension is compiled with the machine's C++ compiler through
``torch.utils.cpp_extension.load`` into ``$TORCH_EXTENSIONS_DIR/lazytrain_adam8bit`` (default
``~/.cache/lazytrain/torch_extensions``) and reused afterwards; a changed source rebuilds. When no
compiler (or ninja) is available, or ``LAZYTRAIN_NO_CPP=1`` is set, :func:`load` returns None with
the reason in :func:`unavailable_reason` and the optimizer falls back to the pure-torch kernel.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

_LOG = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("csrc") / "adam8bit.cpp"
_NAME = "lazytrain_adam8bit"
_lock = threading.Lock()
_module: ModuleType | None = None
_reason: str | None = None
_tried = False


def build_dir() -> Path:
    """Where the compiled extension lives (created on demand)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "lazytrain", "torch_extensions"
    )
    return Path(root) / _NAME


def _cflags() -> list[str]:
    # -ffp-contract=off: no FMA contraction, so results match the pure-torch kernel bit for bit.
    # -fopenmp: at::parallel_for is header code; without it the kernel silently runs on one thread.
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fopenmp"]
    if os.environ.get("LAZYTRAIN_CPP_MARCH", "native") != "none":
        flags.append("-march=" + os.environ.get("LAZYTRAIN_CPP_MARCH", "native"))
    return flags


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled extension, building it on first use; None (with a reason) if it cannot be."""
    global _module, _reason, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("LAZYTRAIN_NO_CPP") == "1":
            _reason = "disabled by LAZYTRAIN_NO_CPP=1"
            return None
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            _reason = f"no C++ compiler ({cxx!r} not on PATH)"
            _LOG.warning("lazytrain.optim: %s; using the slower pure-torch kernel", _reason)
            return None
        try:
            from torch.utils import cpp_extension

            cpp_extension.verify_ninja_availability()
        except Exception as exc:  # noqa: BLE001 - any failure means "no fast path", said once
            _reason = f"ninja is required to build the C++ kernel ({exc}); pip install ninja"
            _LOG.warning("lazytrain.optim: %s; using the slower pure-torch kernel", _reason)
            return None
        directory = build_dir()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _reason = f"cannot create the build directory {directory} ({exc}); set TORCH_EXTENSIONS_DIR"
            _LOG.warning("lazytrain.optim: %s; using the slower pure-torch kernel", _reason)
            return None
        fresh = not any(directory.glob(f"{_NAME}*.so"))
        if fresh:
            print(
                f"lazytrain.optim: building the fused 8-bit AdamW C++ kernel into {directory} "
                "(first use only, ~30-60 s)...",
                file=sys.stderr,
                flush=True,
            )
        try:
            _module = cpp_extension.load(
                name=_NAME,
                sources=[str(_SOURCE)],
                extra_cflags=_cflags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=verbose,
            )
        except Exception as exc:  # noqa: BLE001
            _reason = f"C++ kernel build failed: {str(exc).strip().splitlines()[-1][:300]}"
            _LOG.warning("lazytrain.optim: %s; using the slower pure-torch kernel", _reason)
            return None
        if fresh:
            print("lazytrain.optim: C++ kernel built.", file=sys.stderr, flush=True)
        return _module


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when it has not been tried or succeeded)."""
    return _reason
