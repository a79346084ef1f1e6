"""Build (on first use) and load this package's small C++ extensions.

Each extension is compiled with the machine's C++ compiler through
``torch.utils.cpp_extension.load`` into ``$TORCH_EXTENSIONS_DIR/<name>`` (default
``~/.cache/lazytrain/torch_extensions``) and reused afterwards; a changed source rebuilds. When no
compiler (or ninja) is available, or ``LAZYTRAIN_NO_CPP=1`` is set, :meth:`Extension.load`
returns None with the reason in :meth:`Extension.unavailable_reason`, and the caller falls back to
plain torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

_LOG = logging.getLogger(__name__)


def extensions_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "lazytrain", "torch_extensions"
    )
    return Path(root)


def cflags() -> list[str]:
    # -ffp-contract=off: no FMA contraction, so results match the pure-torch kernels bit for bit.
    # -fopenmp: at::parallel_for is header code; without it a kernel silently runs on one thread.
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fopenmp"]
    if os.environ.get("LAZYTRAIN_CPP_MARCH", "native") != "none":
        flags.append("-march=" + os.environ.get("LAZYTRAIN_CPP_MARCH", "native"))
    return flags


def _cpu_features() -> str:
    """The CPU's feature flags (Linux /proc/cpuinfo), else the machine type."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[Path | None]:
    """Hold an flock on `directory` while torch builds or loads the extension there.

    torch's own lock (``directory/lock``, a file created with O_EXCL and removed when done) is taken
    by every process's first load, and one killed while holding it (OOM killer, pre-emption) left it
    behind: every later load then waited for it forever, silently. The kernel releases an flock
    with its process, so whoever holds this one is alive, and a ``lock`` file found while holding
    it was left by a dead process (every loader of the dir takes this flock first): it is removed
    and yielded (else None). Where flock is unsupported, nothing is locked or removed."""
    from .storage.filemode import hold_flock

    lock = directory / ".lazytrain-build.lock"
    try:
        fd = hold_flock(lock)
    except BlockingIOError:
        print(f"lazytrain: waiting for another process building or loading {directory.name}...",
              file=sys.stderr, flush=True)
        fd = hold_flock(lock, wait=True)
    try:
        stale = directory / "lock"
        if fd is not None and stale.exists():
            stale.unlink(missing_ok=True)
            yield stale
        else:
            yield None
    finally:
        if fd is not None:
            os.close(fd)   # (releases the flock)


class Extension:
    """One C++ source built on first use (thread-safe; tried once per process)."""

    def __init__(self, name: str, source: Path, what: str, fallback: str) -> None:
        self.name, self.source, self.what, self.fallback = name, source, what, fallback
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._reason: str | None = None
        self._tried = False

    def build_dir(self) -> Path:
        """Where the compiled extension lives (created on demand): one dir per torch and Python
        version, so environments with different torch builds sharing a home do not rebuild over the
        library another one has loaded (a process that loads it mid-rebuild gets a mismatched ABI)."""
        import hashlib

        import torch

        # the flags too, and for -march=native the CPU's features: code built on one CPU can be
        # illegal instructions on another machine sharing the home directory
        key = " ".join(cflags())
        if "-march=native" in key:
            key += " " + _cpu_features()
        flags = hashlib.sha1(key.encode()).hexdigest()[:8]
        # and the source's content: checkouts with other versions of it (a branch, an older clone)
        # each keep their build instead of rebuilding over one another's at every switch
        try:
            src = hashlib.sha1(self.source.read_bytes()).hexdigest()[:8]
        except OSError:   # (load() then fails on the missing source, saying so)
            src = "nosource"
        tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{flags}-{src}"
        return extensions_root() / f"{self.name}-{tag.replace('+', '_')}"

    def _fail(self, reason: str) -> None:
        self._reason = reason
        _LOG.warning("lazytrain: %s; using %s", reason, self.fallback)

    def load(self, verbose: bool = False) -> ModuleType | None:
        """The compiled extension, building it on first use; None (with a reason) if it cannot be."""
        with self._lock:
            if self._tried:
                return self._module
            self._tried = True
            if os.environ.get("LAZYTRAIN_NO_CPP") == "1":
                self._reason = "disabled by LAZYTRAIN_NO_CPP=1"
                return None
            cxx = os.environ.get("CXX", "c++")
            if shutil.which(cxx) is None:
                self._fail(f"no C++ compiler ({cxx!r} not on PATH) for the {self.what}")
                return None
            try:
                from torch.utils import cpp_extension

                cpp_extension.verify_ninja_availability()
            except Exception as exc:  # noqa: BLE001 - any failure means "no fast path", said once
                self._fail(f"ninja is required to build the {self.what} ({exc}); pip install ninja")
                return None
            directory = self.build_dir()
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._fail(f"cannot create the build directory {directory} ({exc}); set TORCH_EXTENSIONS_DIR")
                return None
            try:
                with _build_lock(directory) as stale:
                    if stale:
                        _LOG.warning("lazytrain: removed %s, left by a process killed while it loaded "
                                     "the %s (torch would have waited for it forever)", stale, self.what)
                    # Built from a copy inside the build dir: torch's build file names the source's
                    # path, so each checkout's own path made the others' builds stale (~30 s each).
                    src = directory / self.source.name
                    if not src.is_file() or src.read_bytes() != self.source.read_bytes():
                        tmp = src.with_name(f".{src.name}.{os.getpid()}")
                        shutil.copyfile(self.source, tmp)
                        os.replace(tmp, src)
                    fresh = not any(directory.glob(f"{self.name}*.so"))
                    if fresh:
                        print(f"lazytrain: building the {self.what} into {directory} (first use only, "
                              f"~10-30 s)...", file=sys.stderr, flush=True)
                    self._module = cpp_extension.load(
                        name=self.name,
                        sources=[str(src)],
                        extra_cflags=cflags(),
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(directory),
                        verbose=verbose,
                    )
            except Exception as exc:  # noqa: BLE001
                self._fail(f"{self.what} build failed: {str(exc).strip().splitlines()[-1][:300]}")
                return None
            if fresh:
                print(f"lazytrain: {self.what} built.", file=sys.stderr, flush=True)
            return self._module

    def unavailable_reason(self) -> str | None:
        """Why :meth:`load` returned None (None when it has not been tried or succeeded)."""
        return self._reason
