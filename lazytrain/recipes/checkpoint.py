"""Atomic training checkpoints: tensors as safetensors, everything else as JSON.

Layout under `<output_dir>/checkpoints/`:
    step_000050/engine.safetensors   engine state (master weights / adapters + optimizer state), or
    step_000050/engine-00000.safetensors ...  the same in shards (one per layer) when the engine
                                     streams its state: only one layer's state is in RAM at a time
    step_000050/rng.safetensors      torch CPU (and CUDA) generator states
    step_000050/state.json           step, data position, python RNG, scheduler inputs, metadata
    latest                           text file naming the newest complete checkpoint dir

A checkpoint is written into a temp dir, every file fsync'ed, the dir renamed into place and the
parent fsync'ed; only then is `latest` replaced (temp file, fsync, rename). A crash at any point
leaves the previous checkpoint and `latest` intact. Engines with their own format (DeepSpeed)
write into `step_*/engine/` inside the same temp dir, so they get the same atomicity.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..storage.aligned_io import DiskIOError

LATEST = "latest"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` via a temp file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")   # unique: several processes may write
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_path(path.parent)
    except OSError as e:
        raise DiskIOError(e.errno, f"write {path}: {e.strerror}") from e


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, json) capturing torch's and Python's global generators."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    version, state, gauss = random.getstate()
    return tensors, {"python": [version, list(state), gauss]}


def set_rng_state(tensors: Mapping[str, torch.Tensor], js: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted((k for k in tensors if k.startswith("torch_cuda_")),
                                             key=lambda k: int(k.rsplit("_", 1)[1]))]
        if states:
            torch.cuda.set_rng_state_all(states)
    version, state, gauss = js["python"]
    random.setstate((version, tuple(state), gauss))


def _contiguous(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses views/shared storage: clone only what is not a standalone contiguous tensor
    # (a state dict is already a copy; cloning it all again would double the checkpoint's RAM).
    out = {}
    for k, v in sd.items():
        v = v.detach().cpu()
        whole = (v.is_contiguous() and v.storage_offset() == 0
                 and v.untyped_storage().nbytes() == v.numel() * v.element_size())
        out[k] = v if whole else v.contiguous().clone()
    return out


class ShardedTensors(Mapping):
    """A read-only mapping over a checkpoint's engine-*.safetensors shards that loads each tensor
    on access (memory-mapped), so resuming holds one tensor at a time, not the whole state."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise DiskIOError(0, f"read checkpoint shard {f}: {e}") from e
            self._open[f] = h
            for k in h.keys():
                self._where[k] = f

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._open[self._where[key]].get_tensor(key)

    def __contains__(self, key: object) -> bool:   # without loading the tensor
        return key in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def save_checkpoint(ckpt_root: Path, step: int, state: Mapping[str, Any],
                    engine_tensors: Mapping[str, torch.Tensor] | None = None,
                    engine_writer: Callable[[Path], None] | None = None,
                    keep_last: int = 2, rank: int = 0, world: int = 1,
                    barrier: Callable[[], None] | None = None) -> Path:
    """Write checkpoint `step` atomically; returns its directory.

    `engine_tensors` (a flat tensor dict) is saved as engine.safetensors; an iterator of such dicts
    as engine-00000.safetensors, ..., each written as it comes; or `engine_writer(dir)` writes an
    engine's own files into `dir` (DeepSpeed). Older checkpoints beyond `keep_last` are removed
    after the new one is in place.

    Several processes (`world` > 1, DeepSpeed under a launcher) call this together: rank 0 makes
    the temp dir, every rank runs `engine_writer` (a collective save) and writes its own RNG state
    (rng-rank<R>.*), and rank 0 alone renames the dir and moves `latest`; `barrier` orders them.
    """
    main = rank == 0
    sync = barrier if (barrier is not None and world > 1) else (lambda: None)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".step_{step:06d}.tmp"
    if main and tmp.exists():
        shutil.rmtree(tmp)
    try:
        if main:
            tmp.mkdir()
            if engine_writer is not None:
                (tmp / "engine").mkdir()
        sync()
        if isinstance(engine_tensors, Mapping):
            save_file(_contiguous(engine_tensors), str(tmp / "engine.safetensors"))
        elif engine_tensors is not None:
            for k, shard in enumerate(engine_tensors):
                save_file(_contiguous(shard), str(tmp / f"engine-{k:05d}.safetensors"))
        if engine_writer is not None:
            engine_writer(tmp / "engine")
        rng_t, rng_js = rng_state()
        if main:
            save_file(_contiguous(rng_t), str(tmp / "rng.safetensors"))
        else:
            save_file(_contiguous(rng_t), str(tmp / f"rng-rank{rank}.safetensors"))
            (tmp / f"rng-rank{rank}.json").write_text(json.dumps(rng_js))
        sync()
        if main:
            (tmp / "state.json").write_text(json.dumps({**state, "step": step, "rng": rng_js,
                                                        "world_size": world}, indent=1))
            fsync_tree(tmp)
            if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_path(ckpt_root)
    except (OSError, SafetensorError) as e:
        # (safetensors reports a full disk as its own SafetensorError, not an OSError)
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, DiskIOError):
            raise
        errno, why = DiskIOError.reason(e)
        raise DiskIOError(errno, f"write checkpoint {tmp} ({why}); the last checkpoint is intact") from e
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)   # e.g. the engine failed while streaming its state
        raise
    if main:
        atomic_write_text(ckpt_root / LATEST, final.name + "\n")
        _prune(ckpt_root, keep_last, keep=final)
    sync()
    return final


def step_dirs(ckpt_root: Path) -> list[Path]:
    """The `step_<N>` checkpoint dirs under `ckpt_root`, oldest step first (by number: names
    sort wrongly past step 999999)."""
    found = []
    for p in ckpt_root.glob("step_*"):
        tail = p.name[len("step_"):]
        if tail.isdigit() and p.is_dir():
            found.append((int(tail), p))
    return [p for _, p in sorted(found)]


def _prune(ckpt_root: Path, keep_last: int, keep: Path) -> None:
    """Remove all but the newest `keep_last` checkpoints; never `keep` (the one just written,
    which `latest` names)."""
    if keep_last <= 0:
        return
    for old in step_dirs(ckpt_root)[:-keep_last]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint dir, or None.

    That is the one `latest` names. If `latest` is missing, unreadable or names a dir that is
    gone, it is the highest-numbered `step_*` dir holding its state.json: a dir is renamed into
    place only once every file in it is written, so such a dir is complete."""
    ptr = ckpt_root / LATEST
    try:
        d = ckpt_root / ptr.read_text(encoding="utf-8").strip()
        if d.parent == ckpt_root and d.name.startswith("step_") and (d / "state.json").is_file():
            return d
    except (OSError, UnicodeDecodeError):
        pass
    complete = [p for p in step_dirs(ckpt_root) if (p / "state.json").is_file()]
    return complete[-1] if complete else None


def _damaged(path: Path, e: BaseException) -> DiskIOError:
    return DiskIOError(getattr(e, "errno", 0) or 0, f"read checkpoint file {path}: {e}; the checkpoint "
                       f"is damaged (remove {path.parent} to resume from the one before it)")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:   # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise _damaged(path, e) from e


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise _damaged(path, e) from e


def read_state(ckpt_dir: Path) -> dict[str, Any]:
    """The checkpoint's state.json, without touching any RNG."""
    return _read_json(ckpt_dir / "state.json")


def load_checkpoint(ckpt_dir: Path, rank: int = 0) -> tuple[dict[str, Any], Mapping[str, torch.Tensor] | None]:
    """(state json, engine tensors or None); restores the global RNG states (this rank's).
    A damaged or unreadable file raises DiskIOError naming it."""
    state = _read_json(ckpt_dir / "state.json")
    if rank and (ckpt_dir / f"rng-rank{rank}.safetensors").is_file():
        rng_t, rng_js = (_read_tensors(ckpt_dir / f"rng-rank{rank}.safetensors"),
                         _read_json(ckpt_dir / f"rng-rank{rank}.json"))
    else:
        rng_t, rng_js = _read_tensors(ckpt_dir / "rng.safetensors"), state.get("rng")
    eng = ckpt_dir / "engine.safetensors"
    tensors: Mapping[str, torch.Tensor] | None
    if eng.is_file():
        tensors = _read_tensors(eng)
    else:
        shards = sorted(ckpt_dir.glob("engine-*.safetensors"))
        tensors = ShardedTensors(shards) if shards else None
    try:   # (after every read: a damaged file leaves the RNG states as they were)
        set_rng_state(rng_t, rng_js)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise DiskIOError(0, f"restore the RNG states saved in {ckpt_dir}: {e}; the checkpoint is "
                             f"damaged (remove {ckpt_dir} to resume from the one before it)") from e
    return state, tensors
