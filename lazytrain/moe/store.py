"""The expert store: every expert's tensors packed into one 4096-aligned record on disk.

Layout of a store directory::

    index.json              format, version, per-layer files, tensor offsets inside a record, crc32s
    experts-L000.bin ...    one file per MoE layer; expert e at offset e * record_bytes
    non_expert.safetensors  every other weight, under the in-memory (transformers 5) names
    config.json             the HF config; tokenizer files and generation_config.json copied
                            alongside when the source had them (COPIED_FILES)

Converting into a directory first removes every file a store owns there (a previous store's
experts, tokenizer or generation config must not outlive it), and nothing else.

One record holds all tensors of one expert (e.g. gate_up [2I, H] then down [H, I]), each starting on
a 4096-byte boundary, so one O_DIRECT read moves one expert into one cache slot (the
mixtral-offloading idea), and the slot's bytes are views of the model's own fused layout.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..storage.aligned_io import ALIGN_BYTES, DirectFile, round_up
from ..storage.filemode import share_like_umask
from .arch import ExpertTensorSpec, MoeLayer

FORMAT = "lazytrain-expert-store"
VERSION = 1
INDEX = "index.json"
NON_EXPERT = "non_expert.safetensors"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")


class StoreError(ValueError):
    """A store that is missing, unreadable or malformed; the message says what to do."""


class StoreMismatchError(StoreError):
    """The store does not match the model (shapes, expert count, dtype) or a checksum failed."""


@dataclass(frozen=True)
class LayerRecord:
    """Where one MoE layer's experts live on disk."""

    block_index: int
    experts_name: str
    num_experts: int
    top_k: int
    file: str
    record_bytes: int                       # bytes per expert record, a multiple of ALIGN_BYTES
    tensors: tuple[ExpertTensorSpec, ...]
    offsets: tuple[int, ...]                # byte offset of each tensor inside a record
    crc32: tuple[int, ...]                  # one per expert, over the whole record (padding included)

    def to_json(self) -> dict:
        return {"block_index": self.block_index, "experts_name": self.experts_name,
                "num_experts": self.num_experts, "top_k": self.top_k, "file": self.file,
                "record_bytes": self.record_bytes,
                "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "offset": o}
                            for t, o in zip(self.tensors, self.offsets)],
                "crc32": list(self.crc32)}

    @staticmethod
    def from_json(d: dict) -> "LayerRecord":
        ts = tuple(ExpertTensorSpec(t["name"], tuple(t["shape"]), t["dtype"]) for t in d["tensors"])
        lr = LayerRecord(int(d["block_index"]), d["experts_name"], int(d["num_experts"]),
                         int(d["top_k"]), d["file"], int(d["record_bytes"]), ts,
                         tuple(int(t["offset"]) for t in d["tensors"]), tuple(int(c) for c in d["crc32"]))
        if len(lr.crc32) != lr.num_experts:   # (an IndexError at the first load of a later expert)
            raise ValueError(f"layer {lr.block_index}: {len(lr.crc32)} checksums for {lr.num_experts} experts")
        # The records' checksums cover their bytes, not where each tensor sits in them: an edited
        # offset served another tensor's bytes, silently (review)
        if (lr.offsets, lr.record_bytes) != record_layout(lr.tensors):
            raise ValueError(f"layer {lr.block_index}: tensor offsets {list(lr.offsets)} / record size "
                             f"{lr.record_bytes} are not the layout of its tensors {record_layout(lr.tensors)}")
        return lr


def file_crc32(path: Path, chunk: int = 8 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def record_layout(tensors: tuple[ExpertTensorSpec, ...]) -> tuple[tuple[int, ...], int]:
    """Offsets of each tensor in a record (each 4096-aligned) and the record size."""
    offsets, pos = [], 0
    for t in tensors:
        offsets.append(pos)
        pos = round_up(pos + t.nbytes, ALIGN_BYTES)
    return tuple(offsets), max(pos, ALIGN_BYTES)


def pack_expert(tensors: dict[str, torch.Tensor], specs: tuple[ExpertTensorSpec, ...],
                offsets: tuple[int, ...], record_bytes: int) -> bytes:
    buf = bytearray(record_bytes)
    for spec, off in zip(specs, offsets):
        t = tensors[spec.name].detach().to("cpu").contiguous()
        if tuple(t.shape) != spec.shape or str(t.dtype).split(".")[-1] != spec.dtype:
            raise StoreMismatchError(f"expert tensor {spec.name}: got {tuple(t.shape)} {t.dtype}, "
                                     f"expected {spec.shape} {spec.dtype}")
        raw = t.view(torch.uint8).reshape(-1).numpy().tobytes()
        buf[off:off + len(raw)] = raw
    return bytes(buf)


def _holds_hf_weights(d: Path) -> bool:
    """A model directory (its tokenizer and configs must never be replaced by a store's)."""
    return (d / "model.safetensors.index.json").is_file() or any(
        f.name != NON_EXPERT for f in d.glob("*.safetensors")) or any(d.glob("pytorch_model*.bin"))


def _holds_a_store(d: Path) -> bool:
    """A store, or what an interrupted conversion left of one."""
    return (d / INDEX).is_file() or (d / NON_EXPERT).is_file() or any(d.glob("experts-L*.bin"))


class StoreWriter:
    """Writes a store layer by layer; `close()` writes index.json last (a store without one is
    incomplete and refused)."""

    def __init__(self, out_dir: str | os.PathLike, hf_config: dict) -> None:
        self.dir = Path(out_dir).expanduser()   # (as ExpertStore reads it: not a literal ./~)
        if self.dir.exists() and not self.dir.is_dir():   # (was "[Errno 17] File exists")
            raise StoreError(f"out={self.dir} is a file; convert into a new or empty directory")
        if self.dir.is_dir() and _holds_hf_weights(self.dir):
            raise StoreError(f"{self.dir} holds other files than a store's: model weights (*.safetensors "
                             f"other than {NON_EXPERT}, a safetensors index or pytorch_model*.bin); convert "
                             "into a new or empty directory (converting replaces a store's files there)")
        if self.dir.is_dir() and any(self.dir.iterdir()) and not _holds_a_store(self.dir):
            raise StoreError(f"{self.dir} holds other files and no expert store; convert into a new "
                             "or empty directory (converting replaces a store's files there)")
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / INDEX).unlink(missing_ok=True)   # first: the dir is an incomplete store from here
        for name in (NON_EXPERT, "config.json", *COPIED_FILES):
            (self.dir / name).unlink(missing_ok=True)
        for f in self.dir.glob("experts-L*.bin"):
            f.unlink()
        self.hf_config = hf_config
        self.layers: list[LayerRecord] = []
        self.non_expert: dict[str, int] | None = None   # its size and crc32, once written

    def write_layer(self, layer: MoeLayer, expert_tensors) -> LayerRecord:
        """`expert_tensors(e) -> {name: tensor}` gives expert e's per-expert slices."""
        offsets, record_bytes = record_layout(layer.tensors)
        fname = f"experts-L{layer.index:03d}.bin"
        crcs = []
        with open(self.dir / fname, "wb") as f:
            for e in range(layer.num_experts):
                rec = pack_expert(expert_tensors(e), layer.tensors, offsets, record_bytes)
                crcs.append(zlib.crc32(rec))
                f.write(rec)
            f.flush()
            os.fsync(f.fileno())
        lr = LayerRecord(layer.block_index, layer.experts_name, layer.num_experts, layer.top_k, fname,
                         record_bytes, layer.tensors, offsets, tuple(crcs))
        self.layers.append(lr)
        return lr

    def write_non_expert(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                  str(self.dir / NON_EXPERT))
        share_like_umask(self.dir / NON_EXPERT)   # safetensors writes 0600 (storage/filemode.py)
        self.non_expert = {"bytes": (self.dir / NON_EXPERT).stat().st_size,
                           "crc32": file_crc32(self.dir / NON_EXPERT)}

    def close(self) -> Path:
        config = json.dumps(self.hf_config, indent=2, sort_keys=True).encode()
        (self.dir / "config.json").write_bytes(config)
        index = {"format": FORMAT, "version": VERSION, "align_bytes": ALIGN_BYTES,
                 "model_type": self.hf_config.get("model_type"),
                 # the config the store's model is built from (top-k, norms, rope...), checked at load
                 "config_crc32": zlib.crc32(config),
                 "layers": [lr.to_json() for lr in self.layers],
                 "non_expert": self.non_expert}
        index["records_crc32"] = _records_crc(index)
        tmp = self.dir / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        tmp.replace(self.dir / INDEX)
        return self.dir


def _records_crc(index: dict) -> int:
    """Checksum of an index's layer records and non-expert entry (files, dtypes, shapes, offsets,
    record crcs), in a canonical form."""
    rec = {"layers": index.get("layers"), "non_expert": index.get("non_expert")}
    return zlib.crc32(json.dumps(rec, sort_keys=True, separators=(",", ":")).encode())


class ExpertStore:
    """A store opened for reading: O_DIRECT per-layer files, one record read per expert load."""

    def __init__(self, path: str | os.PathLike, direct: bool = True) -> None:
        self.dir = Path(path).expanduser()
        if not self.dir.exists():
            raise StoreError(f"expert store {self.dir} does not exist; create one with "
                             f"`lazytrain moe convert model.path=HF_DIR out={self.dir}`")
        idx = self.dir / INDEX
        if not idx.is_file():
            raise StoreError(f"{self.dir} is not an expert store (no {INDEX}; an interrupted convert?); "
                             "rerun `lazytrain moe convert`")
        try:
            index = json.loads(idx.read_text())
        except json.JSONDecodeError as e:
            raise StoreError(f"{idx}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(index, dict):   # (an AttributeError traceback before 2026-12-01)
            raise StoreError(f"{idx}: malformed (a JSON {type(index).__name__}, not an object); reconvert")
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise StoreError(f"{idx}: format {index.get('format')!r} v{index.get('version')} is not "
                             f"{FORMAT} v{VERSION}; reconvert the model")
        try:
            self.layers = [LayerRecord.from_json(d) for d in index["layers"]]
            ne = index.get("non_expert")
            self.non_expert = None if ne is None else {"bytes": int(ne["bytes"]), "crc32": int(ne["crc32"])}
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{idx}: malformed ({type(e).__name__}: {e}); reconvert") from None
        want = index.get("records_crc32")   # (stores converted before 2026-12-01 have none)
        if want is not None and _records_crc(index) != want:
            # (after the checks of their structure) an edited file name or dtype changed the tokens
            # silently before (a review)
            raise StoreMismatchError(f"{idx}: its layer records are not the ones written (checksum differs: "
                                     "edited?); reconvert")
        self.model_type = index.get("model_type")
        cfg_path = self.dir / "config.json"
        try:
            config = cfg_path.read_bytes()
            self.hf_config = json.loads(config)
        except (OSError, ValueError) as e:
            raise StoreError(f"{cfg_path}: not readable JSON ({e}); reconvert") from None
        want = index.get("config_crc32")   # (stores converted before 2026-12-01 have none)
        if want is not None and zlib.crc32(config) != want:
            raise StoreMismatchError(f"{cfg_path} is not the config the store was converted with (checksum "
                                     f"differs: edited?); reconvert, or restore it")
        self._files: list[DirectFile] = []
        for lr in self.layers:
            p = self.dir / lr.file
            want = lr.record_bytes * lr.num_experts
            if not p.is_file() or p.stat().st_size != want:
                got = p.stat().st_size if p.is_file() else "missing"
                raise StoreMismatchError(f"{p}: size {got}, index says {want} bytes; reconvert")
            self._files.append(DirectFile(p, "r", direct=direct))
        self.direct = all(f.direct for f in self._files)
        self.io_mode = self._files[0].reason if self._files else "no files"
        self.record_bytes = max((lr.record_bytes for lr in self.layers), default=ALIGN_BYTES)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def non_expert_path(self) -> Path:
        return self.dir / NON_EXPERT

    def check_model(self, layers: list[MoeLayer]) -> None:
        """Refuse a store that does not match the model, listing every difference."""
        diffs: list[str] = []
        if len(layers) != len(self.layers):
            diffs.append(f"MoE layers: store {len(self.layers)}, model {len(layers)}")
        for ml, lr in zip(layers, self.layers):
            where = f"layer {ml.index}"
            if ml.num_experts != lr.num_experts:
                diffs.append(f"{where} experts: store {lr.num_experts}, model {ml.num_experts}")
            st = {t.name: t for t in lr.tensors}
            for t in ml.tensors:
                s = st.get(t.name)
                if s is None:
                    diffs.append(f"{where} {t.name}: missing in store")
                elif s.shape != t.shape:
                    diffs.append(f"{where} {t.name} shape: store {list(s.shape)}, model {list(t.shape)}")
                elif s.dtype != t.dtype:
                    diffs.append(f"{where} {t.name} dtype: store {s.dtype}, model {t.dtype}")
            if len(diffs) > 6:
                break
        if diffs:
            raise StoreMismatchError(f"expert store {self.dir} does not match the model: "
                                     + "; ".join(diffs[:6]) + (" ..." if len(diffs) > 6 else ""))

    def read_into(self, layer: int, expert: int, buf: torch.Tensor) -> int:
        """Read one expert record into `buf` (uint8, >= record_bytes, 4096-aligned); returns bytes."""
        lr = self.layers[layer]
        return self._files[layer].read_into(buf[:lr.record_bytes], expert * lr.record_bytes)

    def verify_non_expert(self) -> None:
        """Check non_expert.safetensors against the size and crc32 the index recorded (stores
        converted before they were recorded are not checked): a changed byte in the embedding gave
        other tokens, silently."""
        if self.non_expert is None:
            return
        p = self.non_expert_path
        size = p.stat().st_size if p.is_file() else None
        if size != self.non_expert["bytes"]:
            raise StoreMismatchError(f"{p}: size {size if size is not None else 'missing'}, index says "
                                     f"{self.non_expert['bytes']} bytes; the store is corrupt, reconvert")
        crc = file_crc32(p)
        if crc != self.non_expert["crc32"]:
            raise StoreMismatchError(f"checksum mismatch: {p} (crc32 {crc:08x}, index "
                                     f"{self.non_expert['crc32']:08x}); the store is corrupt, reconvert")

    def verify(self, layer: int, expert: int, buf: torch.Tensor) -> None:
        lr = self.layers[layer]
        crc = zlib.crc32(memoryview(buf[:lr.record_bytes].numpy()))
        if crc != lr.crc32[expert]:
            raise StoreMismatchError(
                f"checksum mismatch: layer {layer} expert {expert} in {self.dir / lr.file} "
                f"(crc32 {crc:08x}, index {lr.crc32[expert]:08x}); the store is corrupt, reconvert")

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []
