"""Atomic training checkpoints: tensors as safetensors, everything else as JSON.

Layout under `<output_dir>/checkpoints/`:
    step_000050/engine.safetensors   engine state (master weights / adapters + optimizer state), or
    step_000050/engine-00000.safetensors ...  the same in shards (one per layer) when the engine
                                     streams its state: only one layer's state is in RAM at a time
    step_000050/rng.safetensors      torch CPU (and CUDA) generator states
    step_000050/state.json           step, data position, python RNG, scheduler inputs, metadata,
                                     and the size and crc32 of every file above ("file_checksums")
                                     and of its own content ("state_crc32")
    latest                           text file naming the newest complete checkpoint dir

A checkpoint is written into a temp dir, every file fsync'ed, the dir renamed into place and the
parent fsync'ed; only then is `latest` replaced (temp file, fsync, rename). A crash at any point
leaves the previous checkpoint and `latest` intact. Engines with their own format (DeepSpeed)
write into `step_*/engine/` inside the same temp dir, so they get the same atomicity.

Integrity: each file resume reads (engine*.safetensors, rng*.safetensors, rng-rank<R>.json) has its
size and crc32 recorded in state.json, hashed as it is written (the header read back, the tensor
data from memory), and checked before it is used: a damaged or truncated file raises
DiskIOError naming it. DeepSpeed's own `engine/` dir is not checksummed (DeepSpeed loads it itself).
Checkpoints written before checksums were recorded load as before, unchecked.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..storage.aligned_io import DiskIOError
from ..storage.atomic import atomic_write_text  # noqa: F401 (callers use ckpt.atomic_write_text)
from ..storage.atomic import fsync_path as _fsync_path
from ..storage.atomic import jsonl_temps
from ..storage.filemode import share_like_umask

LATEST = "latest"
FILE_SUMS = "file_checksums"   # state.json: {file name: {"bytes": size, "crc32": crc}}
STATE_SUM = "state_crc32"      # state.json: crc32 of the rest of state.json (canonical JSON)
_CHUNK = 4 << 20


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


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


def file_digest(path: Path) -> dict[str, int]:
    """{"bytes": size, "crc32": crc} of a file, read in 4 MiB chunks."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    crc = size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {"bytes": size, "crc32": crc}


def written_digest(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """`file_digest` of a safetensors file just written from `tensors`, reading only its header
    back: the data section is the tensors' bytes in the header's offset order, hashed from memory
    (a checkpoint larger than the page cache would otherwise be read back from disk)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        head += f.read(n)
    index = json.loads(head[8:])
    crc, end = zlib.crc32(head), 0
    for name, meta in sorted(((k, v) for k, v in index.items() if k != "__metadata__"),
                             key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, stop = meta["data_offsets"]
        if begin != end:   # (safetensors packs them back to back; anything else: hash the file)
            return file_digest(path)
        t = tensors[name]
        if t.numel():
            crc = zlib.crc32(memoryview(t.reshape(-1).view(torch.uint8).numpy()), crc)
        end = stop
    return {"bytes": len(head) + end, "crc32": crc}


def _state_crc(state: Mapping[str, Any]) -> int:
    """crc32 of `state` (without STATE_SUM) as canonical JSON; the same after a JSON round trip."""
    rest = {k: v for k, v in state.items() if k != STATE_SUM}
    return zlib.crc32(json.dumps(json.loads(json.dumps(rest)), sort_keys=True).encode())


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


def remove_stale_temps(out: Path, final_tmp: str) -> list[str]:
    """Delete what a killed run left half-written in output dir `out`, which nothing else removes
    (review): in `checkpoints/` a `.step_*.tmp` dir (a whole checkpoint's engine state, ~100 GB for
    an 8B full fine-tune) and `.latest.*.tmp`; in `out` the temp copies of metrics.jsonl /
    trace.jsonl a resume trims through (a whole trace each) and the final model's temp dir
    `final_tmp`. Call with the output dir's lock held. Returns their paths below `out`."""
    gone = []
    ckpt_root = out / "checkpoints"
    for p in (sorted(ckpt_root.glob(".step_*.tmp")) + sorted(ckpt_root.glob(".latest.*.tmp"))
              + jsonl_temps(out) + sorted(out.glob(final_tmp))):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        gone.append(str(p.relative_to(out)))
    return gone


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
    sums: dict[str, dict[str, int]] = {}   # (rank 0's) size and crc32 of every file resume reads
    # the file being written, named by a write error (safetensors' and a failed fsync's carry no
    # file name: a full disk was reported at the temp dir; review)
    writing: list[Path] = []

    def save(tensors: Mapping[str, torch.Tensor], name: str) -> None:
        contiguous = _contiguous(tensors)
        writing[:] = [tmp / name]
        save_file(contiguous, str(tmp / name))
        if main:   # the tensors' bytes hashed from memory: a large file is not read back from disk
            sums[name] = written_digest(tmp / name, contiguous)
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
            save(engine_tensors, "engine.safetensors")
        elif engine_tensors is not None:
            for k, shard in enumerate(engine_tensors):
                save(shard, f"engine-{k:05d}.safetensors")
        if engine_writer is not None:
            writing[:] = [tmp / "engine"]
            engine_writer(tmp / "engine")
        rng_t, rng_js = rng_state()
        if main:
            save(rng_t, "rng.safetensors")
        else:
            save(rng_t, f"rng-rank{rank}.safetensors")
            (tmp / f"rng-rank{rank}.json").write_text(json.dumps(rng_js))
        sync()
        if main:
            for f in sorted(tmp.iterdir()):   # the other ranks' (small) rng-rank<R>.* files
                if f.is_file() and f.name.startswith("rng-rank") and f.name not in sums:
                    sums[f.name] = file_digest(f)
            full = {**state, "step": step, "rng": rng_js, "world_size": world, FILE_SUMS: sums}
            full[STATE_SUM] = _state_crc(full)
            writing[:] = [tmp / "state.json"]
            (tmp / "state.json").write_text(json.dumps(full, indent=1))
            share_like_umask(tmp)   # safetensors writes its files 0600 (see storage/filemode.py)
            writing[:] = [tmp]
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
        where = f"{e.filename}" if isinstance(e, OSError) and e.filename else f"{writing[0] if writing else tmp}"
        raise DiskIOError(errno, f"write checkpoint {where} ({why}); {earlier_checkpoints(ckpt_root, final)}") from e
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)   # e.g. the engine failed while streaming its state
        raise
    if main:
        atomic_write_text(ckpt_root / LATEST, final.name + "\n")
        _prune(ckpt_root, keep_last, keep=final)
    sync()
    return final


def earlier_checkpoints(ckpt_root: Path, writing: Path | None = None) -> str:
    """What a failed write leaves to resume from, in words ("the last checkpoint is intact" was
    said when none had been written: a review)."""
    done = [d for d in step_dirs(ckpt_root) if d != writing]
    return (f"the last checkpoint, {done[-1].name}, is intact" if done
            else "no checkpoint was written before it")


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


def _damaged(path: Path, e: BaseException | str) -> DiskIOError:
    return DiskIOError(getattr(e, "errno", 0) or 0, f"read checkpoint file {path}: {e}; the checkpoint "
                       f"is damaged (remove {path.parent} to resume from the one before it)")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:   # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise _damaged(path, e) from e


def _read_state(ckpt_dir: Path) -> dict[str, Any]:
    path = ckpt_dir / "state.json"
    state = _read_json(path)
    if not isinstance(state, dict):
        raise _damaged(path, "not a JSON object")
    want = state.get(STATE_SUM)
    if want is not None and _state_crc(state) != want:   # (older checkpoints have no checksum)
        raise _damaged(path, "checksum mismatch")
    sums = state.get(FILE_SUMS)
    if sums is not None and not (isinstance(sums, dict) and all(
            isinstance(r, dict) and isinstance(r.get("bytes"), int) and isinstance(r.get("crc32"), int)
            for r in sums.values())):
        raise _damaged(path, f"malformed {FILE_SUMS}")
    return state


def _verify(ckpt_dir: Path, sums: Mapping[str, Mapping[str, int]] | None, names: list[str]) -> None:
    """Check the recorded size and crc32 of each of `names` (those recorded; none in a checkpoint
    written before checksums were). A missing, truncated or altered file raises DiskIOError."""
    if sums is None:
        return
    for name in names:
        rec = sums.get(name)
        if rec is None:
            continue
        path = ckpt_dir / name
        try:
            size = path.stat().st_size
            if size != rec["bytes"]:
                raise _damaged(path, f"{size} bytes, {rec['bytes']} when written")
            got = file_digest(path)
        except DiskIOError:
            raise
        except OSError as e:
            raise _damaged(path, e) from e
        if got["crc32"] != rec["crc32"]:   # (sizes matched above)
            raise _damaged(path, f"checksum mismatch (crc32 {got['crc32']:08x}, "
                                 f"{rec['crc32']:08x} when written)")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise _damaged(path, e) from e


def read_state(ckpt_dir: Path) -> dict[str, Any]:
    """The checkpoint's state.json (its own checksum verified), without touching any RNG."""
    return _read_state(ckpt_dir)


def _is_engine_file(name: str) -> bool:
    return name == "engine.safetensors" or (name.startswith("engine-") and name.endswith(".safetensors"))


def load_checkpoint(ckpt_dir: Path, rank: int = 0) -> tuple[dict[str, Any], Mapping[str, torch.Tensor] | None]:
    """(state json, engine tensors or None); restores the global RNG states (this rank's).
    Every file read is first checked against the size and crc32 recorded at save (where recorded).
    A damaged, truncated, missing or unreadable file raises DiskIOError naming it."""
    state = _read_state(ckpt_dir)
    sums = state.get(FILE_SUMS)
    own_rng = f"rng-rank{rank}.safetensors"
    if rank and ((ckpt_dir / own_rng).is_file() or (sums is not None and own_rng in sums)):
        rng_names = [own_rng, f"rng-rank{rank}.json"]
    else:
        rng_names = ["rng.safetensors"]
    if sums is not None:   # the engine files as written (a missing one is reported, not skipped)
        eng_names = sorted(n for n in sums if _is_engine_file(n))
    elif (ckpt_dir / "engine.safetensors").is_file():
        eng_names = ["engine.safetensors"]
    else:
        eng_names = sorted(p.name for p in ckpt_dir.glob("engine-*.safetensors"))
    _verify(ckpt_dir, sums, rng_names + eng_names)
    if len(rng_names) == 2:
        rng_t, rng_js = _read_tensors(ckpt_dir / rng_names[0]), _read_json(ckpt_dir / rng_names[1])
    else:
        rng_t, rng_js = _read_tensors(ckpt_dir / "rng.safetensors"), state.get("rng")
    tensors: Mapping[str, torch.Tensor] | None
    if "engine.safetensors" in eng_names:
        tensors = _read_tensors(ckpt_dir / "engine.safetensors")
    else:
        tensors = ShardedTensors([ckpt_dir / n for n in eng_names]) if eng_names else None
    try:   # (after every read: a damaged file leaves the RNG states as they were)
        set_rng_state(rng_t, rng_js)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise DiskIOError(0, f"restore the RNG states saved in {ckpt_dir}: {e}; the checkpoint is "
                             f"damaged (remove {ckpt_dir} to resume from the one before it)") from e
    return state, tensors
