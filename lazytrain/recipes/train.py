"""The training recipe: setup -> train -> save -> cleanup, in one readable file.

    lazytrain train model=demo-llama data=demo job.mode=full job.max_steps=200

`preflight(cfg)` does everything that can fail on bad input *before* any file is written (specs,
plan, data files, tokenizer, sequence length); `run(cfg, output_dir)` then builds the model and the
engine, trains, and writes plan.json, metrics.jsonl, trace.jsonl, TensorBoard events, checkpoints
and the final model into output_dir. The config object stops here: everything below takes plain
typed arguments.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import shutil
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError

from ..cli.config import (ConfigError, check_bool_settings, check_declared_keys, check_model_structure, hardware_spec, hydra_quoted, model_spec,
                          planner_cache_dir, planner_options, profile_mismatch)
from ..data.dataset import (DataError, PackedDataset, build_dataset, holds_tokenizer, load_tokenizer,
                            read_chat_template)
from ..models.lora import apply_lora, point_adapter_at_base, save_base_model, unmatched_targets
from ..plan.plan import Plan
from ..spec import HardwareSpec, JobSpec, ModelSpec
from ..models.adapter import ModelStructureError
from ..spec.model import ModelConfigError
from ..storage.aligned_io import ALIGN_BYTES, DiskIOError
from ..storage.atomic import keep_jsonl_rows
from ..storage.filemode import cannot_write_in, file_in_the_way, hold_flock, share_like_umask
from ..storage.tiers import remove_dead_scratch, warn_if_memory_backed
from . import checkpoint as ckpt
from .ds_settings import check_deepspeed_config, deepspeed_overrides
from ..integrations.deepspeed import ResumeUnsupported
from .engines import DeepSpeedEngine, ENGINES, EngineUnavailable, StepStats, StreamingEngine, TorchEngine
from ..plan import InfeasiblePlanError, plan_job
from .plan_io import plan_summary

TORCH_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
USER_ERRORS = (ConfigError, DataError, ModelConfigError, EngineUnavailable, InfeasiblePlanError)


class StorageError(ConfigError):
    """storage.nvme_dir cannot hold what the plan puts on NVMe."""


# ================================ setup ==========================================================

@dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process launch (`deepspeed --num_gpus N`, `torchrun`):
    every rank trains its own slice of each step's batch; rank 0 alone writes the outputs."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def sum(self, *xs: float) -> list[float]:
        """The sums over ranks of `xs` (one all-reduce)."""
        if self.world == 1:
            return list(xs)
        dev = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        t = torch.tensor(xs, dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(t)
        return t.tolist()


def ranks_of(cfg: DictConfig) -> Ranks:
    """From the launcher's environment (WORLD_SIZE / RANK); one process without a launcher."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    rank = int(os.environ.get("RANK") or 0)
    if world > 1 and str(cfg.engine) != "deepspeed":
        raise ConfigError(f"launched as {world} processes (WORLD_SIZE={world}), but engine={cfg.engine} "
                          f"runs on one device; use engine=deepspeed to train on several GPUs")
    return Ranks(rank, world)


def job_spec_of(cfg: DictConfig) -> tuple[JobSpec, int]:
    """(JobSpec, max_steps): `job.max_steps` is the recipe's, the rest is the planner's JobSpec."""
    d = OmegaConf.to_container(cfg.job, resolve=True)
    max_steps = d.pop("max_steps", None)
    if cfg.get("optim") is not None:   # the plan's update timing follows the run's clipping (and
        # fp16's overflow check: costmodel.job_costs)
        clips = cfg.optim.get("max_grad_norm") is not None
        given = d.get("clip_grad")
        if given is not None and given != clips:
            # (until 2026-12-02 replaced without a word: job.clip_grad=false still clipped at 1.0,
            # and the plan summary named job.clip_grad as the reason updates waited: a review)
            raise ConfigError(
                f"job.clip_grad={str(given).lower()} but optim.max_grad_norm="
                f"{'null' if not clips else cfg.optim.max_grad_norm}: `lazytrain train` clips by optim.max_grad_norm "
                "(job.clip_grad follows it: leave it out, or job.clip_grad=null); "
                + ("set optim.max_grad_norm=null for no clipping" if not given else
                   "set optim.max_grad_norm to a norm (1.0, or inf: no clipping, but a non-finite step is skipped)"))
        d["clip_grad"] = clips
    if cfg.get("data") is not None:   # the plan counts the per-row masks packed rows get
        pack = cfg.data.get("pack_rows", "auto")
        if not (isinstance(pack, bool) or pack == "auto"):   # (0 == False: `data.pack_rows=0` packed)
            raise ConfigError(f"data.pack_rows must be auto, true or false, got {pack!r}")
        masked = bool(cfg.data.get("prompt_field") or cfg.data.get("messages_field"))
        docs = doc_mask_of(cfg)
        rows = (masked and pack is not False) or docs
        given = d.get("packed_rows")
        if given is not None and given != rows:
            raise ConfigError(f"job.packed_rows={str(given).lower()} but the data is "
                              + ("prompt/completion or chat rows, packed several to a sequence" if rows and masked
                                 else "text documents kept apart (data.doc_mask=true)" if rows else
                                 "not packed rows (text, or data.pack_rows=false)")
                              + ": job.packed_rows follows the data (leave it out, or job.packed_rows=null)")
        d["packed_rows"] = rows
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        # (int() took 2.7 as 2 steps without a word, and 'abc' with a traceback)
        raise ConfigError(f"job.max_steps must be a whole number >= 1, got {max_steps!r}")
    try:
        return JobSpec.from_dict(d), max_steps
    except (TypeError, ValueError) as e:
        raise ConfigError(f"job: {e}") from None


@dataclass
class Preflight:
    model: ModelSpec
    hardware: HardwareSpec
    job: JobSpec
    max_steps: int
    plan: Plan
    data_files: list[Path]
    tokenizer_dir: Path
    tokenizer: Any
    dataset: PackedDataset
    notes: list[str] = field(default_factory=list)
    ds_overrides: dict[str, Any] = field(default_factory=dict)   # engine=deepspeed: the user's settings
    eval_dataset: PackedDataset | None = None   # data.eval_files / data.eval_fraction


def prepare_data(cfg: DictConfig) -> tuple[list[Path], Path]:
    """Data files and tokenizer dir; builds the built-in corpus/tokenizer when asked."""
    d = cfg.data
    if d.get("builtin"):
        if d.builtin != "pydoc-corpus":
            raise ConfigError(f"unknown data.builtin {d.builtin!r}; valid: pydoc-corpus")
        from ..data.corpus import DEMO_CORPUS, build_corpus
        from ..data.tokenizer import MIN_VOCAB, build_tokenizer

        mpath = cfg.model.get("path")
        if mpath and not d.get("tokenizer"):
            # A model of one's own learns with its tokenizer, built-in corpus or not: the built-in
            # tokenizer's ids passed the vocabulary check of any real model, trained it on them
            # and replaced its tokenizer in final/ without a word (review)
            m = Path(str(mpath)).expanduser()
            if not holds_tokenizer(m):
                raise ConfigError(f"model.path={m} holds no tokenizer, and the built-in corpus's tokenizer "
                                  f"(data.builtin={d.builtin}) is not that model's: give data.tokenizer=DIR "
                                  f"(the model's tokenizer dir)")
            d = OmegaConf.merge(d, {"tokenizer": str(m)})
        vocab = d.get("vocab_size")
        if not d.get("tokenizer") and (isinstance(vocab, bool) or not isinstance(vocab, int)):
            raise ConfigError(f"data.vocab_size must be a whole number (the built-in tokenizer's size), "
                              f"got {vocab!r}")
        if not d.get("tokenizer") and int(d.vocab_size) < MIN_VOCAB:   # before the corpus is built
            raise ConfigError(f"data.vocab_size={d.vocab_size}: the built-in byte-level BPE tokenizer has "
                              f"at least {MIN_VOCAB} tokens; give the model that vocab_size or more")
        if d.get("cache_dir") in (None, ""):   # (null built it all in ./None; review)
            raise ConfigError("data.cache_dir is empty: the built-in corpus and tokenizer need a dir "
                              "to be built in (the default: ~/.cache/lazytrain/demo-data)")
        cache = Path(str(d.cache_dir)).expanduser()
        if (above := file_in_the_way(cache)) is not None:   # (a NotADirectoryError traceback; review)
            raise ConfigError(f"data.cache_dir {cache} cannot be made: {above} is a file, not a directory")
        try:
            # (a new corpus, DEMO_CORPUS, has a new tokenizer: it is learnt from the corpus)
            train_txt, _ = build_corpus(cache / DEMO_CORPUS)
            tok_dir = d.get("tokenizer") or build_tokenizer(
                [train_txt], cache / f"tokenizer-{DEMO_CORPUS}-{int(d.vocab_size)}", vocab_size=int(d.vocab_size))
            train_docs, _ = build_corpus(cache / DEMO_CORPUS, documents=True)   # (one row, one EOS, per document)
        except OSError as e:   # (a read-only or forbidden place: tracebacks before; review)
            raise ConfigError(f"data.cache_dir {cache}: the built-in corpus cannot be built there "
                              f"({e.strerror or e}{f': {e.filename}' if e.filename else ''}); set "
                              f"data.cache_dir=DIR to a writable dir") from None
        files = [Path(str(f)) for f in data_files(d)] or [train_docs]
        return files, Path(str(tok_dir)).expanduser()
    files = [Path(str(f)).expanduser() for f in data_files(d)]
    if not files:
        raise DataError("no data given: set data.files=[FILE_OR_DIR,...] (text or JSONL) or data=demo")
    for f in files:
        if not f.exists():
            raise DataError(f"data file {f} does not exist")
    tok = d.get("tokenizer") or cfg.model.get("path")
    if not tok:
        raise DataError("no tokenizer: set data.tokenizer=DIR (a local Hugging Face tokenizer dir)")
    tok_dir = Path(str(tok)).expanduser()
    if not tok_dir.is_dir():
        raise DataError(f"tokenizer dir {tok_dir} does not exist")
    return files, tok_dir


def data_files(d: DictConfig, key: str = "files") -> list:
    """data.files (or data.eval_files) as a list: `data.files=notes.jsonl` (one path, not in
    brackets) is that one file, not a sequence of one-character names."""
    files = d.get(key)
    if files is None or files == "":
        return []
    if OmegaConf.is_list(files) or isinstance(files, (list, tuple)):
        return list(files)
    return [files]


def check_nvme_dir(nvme_dir: Path, need_bytes: int, create: bool) -> None:
    """Raise StorageError (one line) unless `nvme_dir` exists, is writable and has room (after a
    killed run's scratch files in it are removed)."""
    if create:
        nvme_dir.mkdir(parents=True, exist_ok=True)
    if not nvme_dir.is_dir():
        raise StorageError(f"storage.nvme_dir {nvme_dir} does not exist (create it or point it at an SSD)")
    if not os.access(nvme_dir, os.W_OK | os.X_OK):
        raise StorageError(f"storage.nvme_dir {nvme_dir} is not writable")
    remove_dead_scratch(nvme_dir)   # (a resume must not be refused for a killed run's files)
    free = shutil.disk_usage(nvme_dir).free
    if need_bytes > free:
        raise StorageError(f"storage.nvme_dir {nvme_dir} has {_fmt_bytes(free)} free; the plan "
                           f"puts {_fmt_bytes(need_bytes)} on NVMe")   # (in MiB below 1 GiB: "0.0 GiB" twice)
    warn_if_memory_backed(nvme_dir, need_bytes)


def plan_nvme_bytes(plan: Plan) -> int:
    """The plan's NVMe peak plus what the files add: each tensor file on NVMe is padded to the
    4 KiB O_DIRECT block (the plan counts exact bytes, so a drive that held them, but not the
    padding, passed this check and the run failed writing its state: review)."""
    peak = int(plan.predicted.peak_bytes.get("nvme", 0) or 0)
    if not peak:
        return 0
    files = sum((d.param_tier == "nvme") + (d.grad_tier == "nvme") + 3 * (d.optimizer_tier == "nvme")
                + (d.activation_tier == "nvme") for d in plan.layers)
    return peak + files * ALIGN_BYTES


def preflight(cfg: DictConfig) -> Preflight:
    """Every check that needs no model weights and writes nothing (except the solver cache)."""
    check_declared_keys(cfg, "train")   # (again: a sweep's jobs come here from Hydra, not load_config)
    check_bool_settings(cfg)
    if cfg.engine not in ENGINES:
        raise ConfigError(f"unknown engine {cfg.engine!r}; valid: {', '.join(ENGINES)}")
    mspec = model_spec(cfg)
    if cfg.model.get("path"):
        p = Path(str(cfg.model.path)).expanduser()
        weights = sorted(p.glob("*.safetensors"))
        if not weights:
            raise ConfigError(f"model.path {p} holds no *.safetensors weights")
        check_safetensors(weights)
    hw = hardware_spec(cfg)
    job, max_steps = job_spec_of(cfg)
    profile_mismatch(cfg, job)
    if cfg.engine == "lazytrain":
        check_model_structure(mspec, job.loss_chunk_tokens)
    job = packing_for(cfg, mspec, job)
    if job.mode == "lora":
        check_lora_targets(mspec, cfg.model.get("path"), job.lora_targets, chunked_loss=bool(job.loss_chunk_tokens))
    for what in ("compute_dtype", "master_dtype"):
        if getattr(job, what) not in TORCH_DTYPES:
            raise ConfigError(f"job.{what}={getattr(job, what)} cannot train; valid: "
                              f"{', '.join(sorted(TORCH_DTYPES))}")
    if job.compute_dtype in ("fp16", "float16") and TORCH_DTYPES[job.master_dtype] != torch.float32:
        # (fp16 runs with a dynamic loss scale, on every engine; its updates need fp32 masters)
        raise ConfigError(f"job.compute_dtype={job.compute_dtype} needs job.master_dtype=fp32 (fp32 master "
                          f"weights and AdamW states); job.master_dtype={job.master_dtype} is for pure-bf16 training")
    optim_settings(cfg)
    loss_scale_settings(cfg)
    run_settings(cfg)
    if job.seq_len > mspec.max_position_embeddings:
        raise ConfigError(f"job.seq_len={job.seq_len} is longer than the model allows "
                          f"(max_position_embeddings={mspec.max_position_embeddings})")
    if job.seq_len < 2:   # (it trained on nothing: NaN losses, exit 0 and a final model; review)
        raise ConfigError(f"job.seq_len={job.seq_len}: a sequence needs at least 2 tokens, one to "
                          f"predict the next from")
    if str(cfg.engine) == "torch" and job.optimizer_state_bits == 8:
        # (said by the engine once built, after the output dir was written; review)
        raise ConfigError("engine=torch runs 32-bit AdamW only (job.optimizer_state_bits=32); "
                          "use engine=lazytrain for 8-bit states")
    files, tok_dir = prepare_data(cfg)
    # Plan before tokenizing: a job that cannot fit is reported without waiting for the data.
    # planner.cache=false bypasses the cache both ways, as for `lazytrain plan` (it wrote the plan)
    use_cache = bool(cfg.planner.cache)
    plan = plan_job(mspec, hw, job, planner_options(cfg),
                    cache_dir=str(planner_cache_dir(cfg)) if use_cache else None, use_cache=use_cache)
    if not plan.fits:
        raise InfeasiblePlanError(plan)
    ds_over = deepspeed_overrides(cfg)
    notes = []
    if cfg.engine == "deepspeed":
        nvme = cfg.storage.get("nvme_dir")
        notes = check_deepspeed_config(plan, ds_over, str(Path(str(nvme)).expanduser() / "deepspeed") if nvme else None)
    tokenizer = load_tokenizer(tok_dir)
    if len(tokenizer) > mspec.vocab_size:
        fix = ("use a matching tokenizer or model" if cfg.model.get("path") else
               f"use a matching tokenizer, or model.hf_config.vocab_size={len(tokenizer)} (the model is "
               f"built from its config)")
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                          f"{mspec.vocab_size}; {fix}")
    template = cfg.data.get("chat_template")
    if template:
        tokenizer.chat_template = read_chat_template(Path(str(template)).expanduser())
    ds, eval_ds = eval_split(cfg, dataset_of(cfg, files, tokenizer, job.seq_len, job.packed_rows), tokenizer,
                             job.seq_len, job.packed_rows)
    nvme_dir = cfg.storage.get("nvme_dir")
    if nvme_dir:
        check_nvme_dir(Path(str(nvme_dir)).expanduser(), plan_nvme_bytes(plan), create=False)
    elif plan_nvme_bytes(plan):
        # default <output_dir>/nvme does not exist yet: check the filesystem it will be created on
        where = Path(str(cfg.output_dir)).expanduser().resolve() if cfg.get("output_dir") else Path.cwd()
        remove_dead_scratch(where / "nvme")   # (a resumed run's default nvme dir)
        while not where.exists():
            where = where.parent
        try:
            check_nvme_dir(where, plan_nvme_bytes(plan), create=False)
        except StorageError as e:
            raise StorageError(f"{e} (storage.nvme_dir defaults to <output_dir>/nvme; set "
                               f"storage.nvme_dir=DIR on a larger disk)") from None
    return Preflight(mspec, hw, job, max_steps, plan, files, tok_dir, tokenizer, ds, notes, ds_over, eval_ds)


def doc_mask_of(cfg: DictConfig) -> bool:
    """data.doc_mask: text documents packed into one sequence each attend only to themselves."""
    v = cfg.data.get("doc_mask", False)
    if not isinstance(v, bool):   # (0/1, "yes": not a switch a typo should flip)
        raise ConfigError(f"data.doc_mask must be true or false, got {v!r}")
    if v and (cfg.data.get("prompt_field") or cfg.data.get("messages_field")):
        raise ConfigError("data.doc_mask=true is for text documents: prompt/completion and chat rows are kept "
                          "apart by data.pack_rows; drop data.doc_mask")
    return v


def packing_for(cfg: DictConfig, mspec: ModelSpec, job: JobSpec) -> JobSpec:
    """`job` with packed_rows False where the model cannot keep rows packed into one sequence apart
    (spec.generic.packed_rows_problem: GPT-OSS's mask ignores the position ids, Mamba-like blocks
    carry a state from row to row): data.pack_rows=auto then gives each row a sequence of its own,
    with a warning; data.pack_rows=true refuses. Every engine runs the model's own masks, so this
    holds for all three."""
    if not job.packed_rows:
        return job
    from ..spec.generic import packed_rows_problem

    why = packed_rows_problem(dict(mspec.hf_config))
    if why is None:
        return job
    if doc_mask_of(cfg):   # (no sequence of its own for each document: they are cut at fixed lengths)
        raise ConfigError(f"data.doc_mask=true: documents packed into one sequence would see each other in "
                          f"{mspec.family} ({why}); set data.doc_mask=false (documents then attend to the "
                          f"ones before them in their sequence, as in GPT-style pretraining)")
    if cfg.data.get("pack_rows", "auto") is True:
        raise ConfigError(f"data.pack_rows=true: rows packed into one sequence would see each other in "
                          f"{mspec.family} ({why}); data.pack_rows=auto or false gives each row a sequence "
                          f"of its own")
    import logging

    logging.getLogger("lazytrain").warning(
        "%s cannot keep rows packed into one sequence apart (%s): each row gets a sequence of its own "
        "(padded; data.pack_rows=false says so and keeps this quiet)", mspec.family, why)
    return replace(job, packed_rows=False)


def dataset_of(cfg: DictConfig, files, tokenizer, seq_len: int, pack_rows: bool = True) -> PackedDataset:
    """`files` read and packed as the data config says (fields, BOS, token cache); `pack_rows`:
    several prompt/completion or chat rows to a sequence (`packing_for`)."""
    d = cfg.data
    cache = d.get("cache_dir")
    fields = {k: str(d.get(k)) if d.get(k) else None for k in ("prompt_field", "messages_field")}
    return build_dataset(files, tokenizer, seq_len, seed=int(cfg.seed), text_field=str(d.text_field),
                         cache_dir=Path(str(cache)).expanduser() if cache else None,
                         add_bos=d.get("add_bos", "auto"), pack_rows=pack_rows, doc_mask=doc_mask_of(cfg),
                         **fields)


def eval_split(cfg: DictConfig, ds: PackedDataset, tokenizer, seq_len: int, pack_rows: bool = True
               ) -> tuple[PackedDataset, PackedDataset | None]:
    """(training data, evaluation data or None): data.eval_files, read as the training files are
    (none of them among the files `ds` was read from), or the last data.eval_fraction of the
    training sequences, held out."""
    d = cfg.data
    files, frac = data_files(d, "eval_files"), d.get("eval_fraction") or 0
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
        raise ConfigError(f"data.eval_fraction must be a number in [0, 1), got {frac!r}")
    if files and frac:
        raise ConfigError("data.eval_files and data.eval_fraction are both set; evaluate on one of them")
    if frac:
        return ds.split_off(float(frac))
    if not files:
        asked = [f"{k}={cfg.get(k)}" for k in ("eval_every", "eval_batches") if cfg.get(k)]
        if asked:   # (ignored without a word before: review)
            raise ConfigError(f"{' and '.join(asked)} evaluate on data.eval_files or data.eval_fraction, and "
                              f"neither is set; set one (e.g. data.eval_fraction=0.05) or drop {asked[0].split('=')[0]}")
        return ds, None
    try:
        eval_ds = dataset_of(cfg, files, tokenizer, seq_len, pack_rows)
    except DataError as e:
        raise DataError(f"data.eval_files: {e}") from None
    # an evaluation file that is also trained on (in a training dir) was reported as held-out (review)
    trained = {os.path.realpath(p) for p in ds.files}
    both = [str(p) for p in eval_ds.files if os.path.realpath(p) in trained]
    if both:
        raise ConfigError(f"data.eval_files: {', '.join(both[:3])} {'is' if len(both) == 1 else 'are'} "
                          f"also trained on (reached through data.files): not held out; move "
                          f"{'it' if len(both) == 1 else 'them'} out of the training data, or use "
                          f"data.eval_fraction")
    return ds, eval_ds


def evaluate(engine, data: PackedDataset, batch_size: int, limit: int | None) -> float:
    """Mean loss over every learned token of the evaluation batches (each batch's mean weighted by
    its learned tokens), with the engine's current weights."""
    total, count = 0.0, 0
    for b in data.ordered_batches(batch_size, limit):
        n = learned_targets(b.labels)
        if n:
            total += engine.eval_loss(b.input_ids, b.labels, b.position_ids) * n
            count += n
    return total / count if count else float("nan")


def check_lora_targets(mspec: ModelSpec, model_path: str | None, targets, chunked_loss: bool = False) -> None:
    """LoRA targets that name no linear layer of the model, reported before anything is written
    (apply_lora's own check runs only once the model is built, after plan.json). The model is
    built on the meta device: no weights are read or allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if model_path:
            config = AutoConfig.from_pretrained(str(Path(model_path).expanduser()), local_files_only=True)
        else:
            hf = dict(mspec.hf_config)
            config = AutoConfig.for_model(hf.pop("model_type"), **hf)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - anything else is build_model's to report, with its context
        return
    missing, names = unmatched_targets(model, targets)   # (the check apply_lora makes)
    if missing or not targets:
        raise ConfigError(f"job.lora_targets {missing or list(targets)} match no linear layer of "
                          f"{mspec.name}; its linear layers: {', '.join(names)}")
    if chunked_loss:   # (the executor's check_chunked_loss, here before anything is written: review)
        from ..models.adapter import find_parts

        try:
            head = find_parts(model).head
        except Exception:  # noqa: BLE001 - the structure finder's refusal is build_model's to report
            return
        name = next((n for n, m in model.named_modules() if m is head), "")
        hit = [t for t in targets if name == t or name.endswith("." + t)]
        if name and hit:
            raise ConfigError(f"job.loss_chunk_tokens computes the head itself and needs a plain linear "
                              f"{name}; job.lora_targets {hit} puts LoRA on it: drop it from the targets "
                              f"or use job.loss_chunk_tokens=0")


def check_safetensors(files: list[Path]) -> None:
    """Each weights file opens as safetensors (its header only is read): a damaged download is
    reported before anything is written."""
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ConfigError(f"model.path: {f} is not a readable safetensors file "
                              f"({str(e).strip().splitlines()[0]})") from None


def run_settings(cfg: DictConfig) -> None:
    """ConfigError (one line) for run settings that would not do what they say: a negative
    save_every checkpointed every step (step % -1 == 0), stop_at_step=0 was ignored, and an
    output_dir that is a file failed with a traceback. (resume=true without output_dir is the
    CLI's to refuse: `run` is handed its output_dir.)"""
    def whole(name: str, lo: int, what: str, allow_null: bool = False) -> None:
        v = cfg.get(name)
        if v is None and allow_null:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{name} must be {what}, got {v!r}")

    whole("seed", 0, "a whole number >= 0")   # (1.5 ran seed 1, 'abc' gave a traceback)
    whole("save_every", 0, "a whole number >= 0 (N: a checkpoint every N steps; 0: only at the end)")
    whole("stop_at_step", 1, "a step >= 1, or null (no planned stop)", allow_null=True)
    whole("keep_checkpoints", 1, "a whole number >= 1")
    whole("log_every", 1, "a whole number >= 1")
    whole("eval_every", 0, "a whole number >= 0 (N: evaluate every N steps; 0: only at the end)")
    whole("eval_batches", 1, "a whole number >= 1, or null (all of the evaluation data)", allow_null=True)
    out = cfg.get("output_dir")
    if out and Path(str(out)).expanduser().is_file():
        raise ConfigError(f"output_dir {out} is a file, not a directory")
    if out and (above := file_in_the_way(Path(str(out)).expanduser())) is not None:
        # (one under a file was a NotADirectoryError traceback from Hydra; review)
        raise ConfigError(f"output_dir {out} cannot be made: {above} is a file, not a directory")
    if out:
        # a read-only dir (or mount) was a Hydra traceback about its log file (review)
        p = Path(str(out)).expanduser()
        where = next((a for a in (p, *p.absolute().parents) if a.exists()), None)
        if where is not None and (why := cannot_write_in(where)):
            raise ConfigError(f"output_dir {out}: cannot write in {where} ({why}); give a writable output_dir")


def optim_settings(cfg: DictConfig) -> dict[str, Any]:
    """The optimizer's settings as numbers (lr, betas, eps, weight_decay, max_grad_norm), or a
    ConfigError naming the one that is not; checked in preflight."""
    o = cfg.optim

    def num(name: str, v: Any, ok=lambda x: True, want: str = "") -> float:
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"optim.{name} must be a number, got {v!r}") from None
        # A value of the right type can still leave the weights where they are (a clip norm of
        # 0 scales every gradient to 0) or train them backwards (lr < 0): refused, not run.
        if math.isnan(x) or not ok(x):
            raise ConfigError(f"optim.{name} must be {want}, got {v!r}")
        return x

    betas = o.betas
    if not isinstance(betas, (list, tuple)) and not OmegaConf.is_list(betas) or len(betas) != 2:
        raise ConfigError(f"optim.betas must be two numbers, got {betas!r}")
    num("min_lr_ratio", o.get("min_lr_ratio", 0), lambda x: 0 <= x <= 1,
        "in [0, 1] (the cosine ends at lr * min_lr_ratio)")
    warmup = o.get("warmup_steps", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:   # (1.5 warmed up 1 step)
        raise ConfigError(f"optim.warmup_steps must be a whole number >= 0 (0: no warmup), got {warmup!r}")
    mgn = o.max_grad_norm
    return dict(lr=num("lr", o.lr, lambda x: 0 < x < math.inf, "> 0 (and finite)"),
                betas=tuple(num("betas", b, lambda x: 0 <= x < 1, "in [0, 1) (each of the two)")
                            for b in betas),
                eps=num("eps", o.eps, lambda x: 0 < x < math.inf, "> 0 (and finite)"),
                weight_decay=num("weight_decay", o.weight_decay, lambda x: 0 <= x < math.inf,
                                 ">= 0 (and finite)"),
                max_grad_norm=None if mgn is None else num(
                    "max_grad_norm", mgn, lambda x: x > 0,
                    "> 0 (or null to disable clipping; 0 would scale every gradient to 0)"))


def loss_scale_settings(cfg: DictConfig) -> tuple[float, int]:
    """fp16's dynamic loss scale: (optim.loss_scale, optim.loss_scale_growth_interval), checked."""
    o = cfg.optim
    init, interval = o.get("loss_scale", 2.0 ** 16), o.get("loss_scale_growth_interval", 2000)
    try:
        x = float(init)
    except (TypeError, ValueError):
        x = math.nan
    # a power of two: scaling and unscaling are then exact (and DeepSpeed takes it as a power);
    # within float32's normal range (2**128 was inf: every step skipped; 2**-130 gave NaN weights)
    if isinstance(init, bool) or not (math.isfinite(x) and x > 0 and math.frexp(x)[0] == 0.5):
        raise ConfigError(f"optim.loss_scale must be a power of two (fp16's initial loss scale, e.g. 65536), got {init!r}")
    if not 2.0 ** -126 <= x <= 2.0 ** 127:
        raise ConfigError(f"optim.loss_scale must be between 2**-126 and 2**127 (float32's range), got {init!r}")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"optim.loss_scale_growth_interval must be a whole number >= 1 (good fp16 steps "
                          f"before the loss scale doubles), got {interval!r}")
    return x, interval


def build_model(mspec: ModelSpec, model_path: str | None, job: JobSpec, seed: int) -> torch.nn.Module:
    """The HF causal LM: from a local dir, else random init from the config; LoRA-wrapped. Seeded
    either way: PEFT draws the adapters' initial values (lora_A) from torch's global RNG, so a
    loaded model's LoRA run was different on every launch (and no resume could match it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if model_path:
        p = Path(model_path).expanduser()
        try:
            model, info = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32, local_files_only=True,
                                                               output_loading_info=True)
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            # (RuntimeError: weights whose shapes are not config.json's; review)
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if "ignore_mismatched_sizes" in why:
                why = "its weights' shapes are not those of its config.json (transformers' report above)"
            raise ConfigError(f"cannot load the model in {p}: {why}") from None
        missing = sorted(info.get("missing_keys") or ())
        if missing:   # (transformers initialises them at random and goes on: a run trained that; review)
            raise ConfigError(f"the model in {p} lacks {len(missing)} of its weights ({', '.join(missing[:3])}"
                              f"{', ...' if len(missing) > 3 else ''}): they would start random; give a "
                              f"complete checkpoint")
    else:
        hf = dict(mspec.hf_config)
        config = AutoConfig.for_model(hf.pop("model_type"), **hf)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if job.mode == "lora":
        try:
            model = apply_lora(model, job.lora_rank, job.lora_alpha, job.lora_targets)
        except ValueError as e:  # e.g. targets the model does not have
            raise ConfigError(f"job.lora_targets: {str(e).splitlines()[0]}") from None
    return model


def lr_at(step: int, base_lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine to base_lr * min_lr_ratio at max_steps."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    t = min(1.0, (step - warmup_steps) / span)
    return base_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def with_ds_loss_scale(overrides: dict | None, loss_scale: tuple[float, int]) -> dict:
    """DeepSpeed overrides whose fp16 loss scale starts and grows as the other engines' (optim.loss_scale,
    optim.loss_scale_growth_interval; hysteresis 1: back off at the first overflow, as GradScaler);
    the user's own fp16.* keys win."""
    mine = {"initial_scale_power": int(math.log2(loss_scale[0])), "loss_scale_window": loss_scale[1],
            "hysteresis": 1}
    overrides = dict(overrides or {})
    overrides["fp16"] = {**mine, **(overrides.get("fp16") or {})}
    return overrides


def build_engine(cfg: DictConfig, model: torch.nn.Module, pre: Preflight, out: Path, nvme_dir: Path):
    common = optim_settings(cfg)
    loss_scale = loss_scale_settings(cfg)
    # one setting, planned and run alike: the job's optimizer-state precision picks the optimizer
    optimizer = "adamw8bit" if pre.job.optimizer_state_bits == 8 else "adamw"
    device = torch.device("cuda") if pre.hardware.device_type == "cuda" and torch.cuda.is_available() \
        else torch.device("cpu")
    if cfg.engine == "lazytrain":
        # weights stream and compute in the plan's dtype (what the planner sized); fp32 masters
        # come from the loaded fp32 values. A model the executor cannot run exactly (its forward
        # computes more than embed -> blocks -> final norm -> head) is refused in one line (a
        # traceback before: review)
        try:
            return StreamingEngine(model, pre.plan, device=device, nvme_dir=nvme_dir, optimizer=optimizer,
                                   trace_path=out / "trace.jsonl",
                                   compute_dtype=TORCH_DTYPES[pre.job.compute_dtype],
                                   master_dtype=TORCH_DTYPES[pre.job.master_dtype],
                                   count_op_temporaries=bool(cfg.get("count_op_temporaries", False)),
                                   loss_scale=loss_scale, **common)
        except ModelStructureError as e:
            raise ModelConfigError(f"engine=lazytrain cannot train this model exactly: {e}; engine=torch "
                                   f"runs it unchanged (without streaming)") from None
    if cfg.engine == "deepspeed":
        overrides = pre.ds_overrides
        if TORCH_DTYPES[pre.job.compute_dtype] == torch.float16:
            overrides = with_ds_loss_scale(overrides, loss_scale)
        return DeepSpeedEngine(model, pre.plan, nvme_dir=nvme_dir, overrides=overrides, **common)
    return TorchEngine(model, device=device, compute_dtype=TORCH_DTYPES[pre.job.compute_dtype],
                       optimizer=optimizer, master_dtype=TORCH_DTYPES[pre.job.master_dtype],
                       loss_scale=loss_scale, **common)


def job_identity(cfg: DictConfig, ds: PackedDataset, pre: Preflight) -> dict[str, Any]:
    """What a checkpoint records of its job and a resumed run must match: engine, mode, seed, data,
    the optimizer-state precision and the master dtype (the engine's state differs in layout), and
    the model architecture (its config, without paths and version stamps). The compute dtype may
    change on resume (the state holds no compute-dtype weights)."""
    arch = {k: v for k, v in pre.model.hf_config.items()
            if not k.startswith("_") and k not in ("transformers_version", "torch_dtype", "dtype",
                                                   "use_cache", "architectures", "name_or_path")}
    return {"engine": str(cfg.engine), "mode": pre.job.mode, "seed": int(cfg.seed),
            "dataset": {"sequences": len(ds), "seq_len": ds.seq_len, "fingerprint": ds.fingerprint},
            "optimizer_state_bits": pre.job.optimizer_state_bits, "master_dtype": pre.job.master_dtype,
            "model_config": json.loads(json.dumps(arch, sort_keys=True, default=str)),
            # DeepSpeed restores these from its checkpoint and ignores new values (review): changed,
            # they are refused rather than silently not applied (the other engines apply them)
            **({"optimizer_settings": {"weight_decay": float(cfg.optim.weight_decay),
                                       "betas": [float(b) for b in cfg.optim.betas], "eps": float(cfg.optim.eps)}}
               if str(cfg.engine) == "deepspeed" else {}),
            # LoRA: the adapters' definition (the engines load the keys this run's model has, so
            # other targets silently dropped the trained ones; another alpha rescales them) and
            # the frozen base weights they were trained on (a review resumed onto another model dir)
            **({"lora": {"rank": pre.job.lora_rank, "alpha": float(pre.job.lora_alpha),
                         "targets": sorted(pre.job.lora_targets),
                         "base_weights": weights_fingerprint(cfg.model.get("path"))}}
               if pre.job.mode == "lora" else {})}


def weights_fingerprint(model_path) -> str | None:
    """A cheap fingerprint of a model dir's safetensors weights (None for a model built from its
    config: the seed and config fix it): per file its name, size, header and the first and last
    MiB of tensor data; another checkpoint of the same architecture differs there. Reads ~2 MiB a
    file, not the weights, once per dir and process (job_identity goes into every checkpoint)."""
    return _weights_fingerprint(str(Path(str(model_path)).expanduser().resolve())) if model_path else None


@functools.lru_cache(maxsize=8)
def _weights_fingerprint(model_dir: str) -> str:
    import hashlib
    import struct

    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            header = fh.read(min(n, 100 << 20))
            first = fh.read(1 << 20)
            fh.seek(max(8 + n, size - (1 << 20)))
            last = fh.read(1 << 20)
        for part in (f.name.encode(), str(size).encode(), header, first, last):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()[:24]


def _ds_precision(ds_config: dict) -> str:
    for key in ("bf16", "fp16"):
        sec = ds_config.get(key)
        if isinstance(sec, dict) and sec.get("enabled") is True:
            return key
    return "fp32"


def check_deepspeed_precision(out: Path, compute_dtype: str) -> None:
    """ConfigError when a DeepSpeed run would resume in another precision than it trained in (the
    one its ds_config.json records): DeepSpeed's checkpoint files are per precision, and it failed
    on a missing file with advice to remove a good checkpoint. Until 2026-12-01 the long spellings
    (job.compute_dtype=bfloat16/float16) did not reach DeepSpeed, whose runs trained in fp32."""
    try:
        ran = _ds_precision(json.loads((out / "ds_config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return   # (no record: nothing to compare)
    want = {"bf16": "bf16", "fp16": "fp16"}.get(compute_dtype, "fp32")
    if ran != want:
        raise ConfigError(f"cannot resume: this DeepSpeed run trained in {ran} ({out / 'ds_config.json'}), "
                          f"job.compute_dtype={compute_dtype} would resume it in {want}; resume with "
                          f"job.compute_dtype={ran}" + (" (until 2026-12-01 job.compute_dtype=bfloat16 and "
                                                        "float16 did not reach DeepSpeed: it ran fp32)"
                                                        if ran == "fp32" else ""))


def check_resumable(state: dict[str, Any], cfg: DictConfig, ds: PackedDataset, pre: Preflight) -> None:
    """A checkpoint continues only the same job (`job_identity`; keys an older checkpoint lacks
    are not compared)."""
    want = job_identity(cfg, ds, pre)
    saved = state.get("model_config")
    if isinstance(saved, dict) and saved != want["model_config"]:
        now = want["model_config"]
        diff = [f"{k} {saved.get(k, '(unset)')} -> {now.get(k, '(unset)')}"
                for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        raise ConfigError(f"cannot resume: the checkpoint was written for another model "
                          f"({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}); use the same "
                          f"model or a new output_dir")
    for k, v in want.items():
        if k == "model_config" or k not in state:
            continue
        had = state[k]
        if k == "dataset" and isinstance(had, dict):
            # the fingerprint after the count and seq_len (which keep their message), and only
            # where the checkpoint has one (those written before it was recorded resume as before)
            had, v = dict(had), dict(v)
            then, now = had.pop("fingerprint", None), v.pop("fingerprint")
            if had == v and then is not None and then != now:
                raise ConfigError(f"cannot resume: the checkpoint was trained on other data (token "
                                  f"fingerprint {then}, this run's {now}: other files, contents or order, "
                                  f"tokenizer or data fields){_data_hints(cfg, pre, state)}; use the same data "
                                  f"or a new output_dir")
        if k == "lora" and isinstance(had, dict) and had != v:
            names = {"rank": "job.lora_rank", "alpha": "job.lora_alpha", "targets": "job.lora_targets"}
            diff = [f"{names[x]} {had.get(x)} -> {v[x]}" for x in names if x in had and had[x] != v[x]]
            if "base_weights" in had and had["base_weights"] != v["base_weights"]:
                diff.append("model.path holds other base weights than the adapters were trained on")
            if diff:
                raise ConfigError(f"cannot resume: the checkpoint's LoRA adapters differ from this run's "
                                  f"({'; '.join(diff)}); use the run's settings and base model, or a new output_dir")
            continue
        if had != v:
            hint = _data_hints(cfg, pre, state) if k == "dataset" else ""
            raise ConfigError(f"cannot resume: the checkpoint was written with {k}={had}, this run has "
                              f"{k}={v}{hint}; use the same settings or a new output_dir")


def _data_hints(cfg: DictConfig, pre: Preflight, state: dict[str, Any] | None = None) -> str:
    """What else changes the training sequences than the files: a held-out fraction, the BOS
    data.add_bos=auto puts in front of documents since 2026-12-01 (runs before had none), and the
    whole-row packing of prompt/completion and chat rows since 2026-12-02 and their per-row
    attention (DATA_PACKING 3, also 2026-12-02)."""
    from ..data.dataset import bos_for

    hints = []
    packing = state.get("data_packing", 1) if state is not None else DATA_PACKING
    if (cfg.data.get("prompt_field") or cfg.data.get("messages_field")) and packing < DATA_PACKING:
        # (a review resumed such a run after the upgrade, with the same settings, and was told to
        # use the same settings)
        was = ("its rows cut at fixed sequence edges" if packing < 2 else
               "its packed rows attending to the rows before them in a sequence" if packing < 3 else
               "a row's first token, where learned, the target of the row before it")
        hints.append("prompt/completion and chat rows are packed whole since 2026-12-02, each attending "
                     f"only to itself (a later change), and this checkpoint was written before ({was}): "
                     "it cannot continue on the new sequences; start the run again in a new output_dir")
    docs, had = doc_mask_of(cfg), (state or {}).get("doc_mask")
    if had is not None and had != docs:
        hints.append(f"the checkpoint was written with data.doc_mask={str(had).lower()}, this run has "
                     f"{str(docs).lower()} (other position ids and learned tokens)")
    elif had is None and docs:
        hints.append("data.doc_mask=true changes the sequences' position ids and learned tokens")
    if cfg.data.get("eval_fraction"):
        hints.append(f"data.eval_fraction={cfg.data.eval_fraction} holds sequences out of training")
    add = cfg.data.get("add_bos", "auto")
    if not cfg.data.get("messages_field") and str(add).lower() == "auto" and bos_for(pre.tokenizer, "auto") is not None:
        hints.append("data.add_bos=auto puts a BOS before each document (runs started before 2026-12-01 "
                     "had none: resume those with data.add_bos=false)")
    try:
        from ..data.dataset import expand_files, is_jsonl
        paths = expand_files(data_files(cfg.data))[:1000]
    except Exception:  # noqa: BLE001 - a hint only: the data was read before, this cannot matter
        paths = []

    def bom(p: Path) -> bool:
        try:
            with open(p, "rb") as f:
                return f.read(3) == b"\xef\xbb\xbf"
        except OSError:
            return False

    if any(not is_jsonl(p) and bom(p) for p in paths):
        hints.append("a text file here begins with a UTF-8 BOM, which runs started before 2026-12-01 "
                     "trained as tokens and runs since drop: such a run cannot resume; start it again "
                     "in a new output_dir")
    if cfg.data.get("builtin") and not data_files(cfg.data):
        from ..data.corpus import DEMO_CORPUS
        cache = Path(str(cfg.data.cache_dir)).expanduser()
        corpus = cache / "corpus"
        vocab = cfg.data.get("vocab_size")
        hints.append(f"the built-in data is {cache / DEMO_CORPUS / 'train.jsonl'}, a document per row without "
                     f"duplicate texts, since 2026-12-01; runs started before trained on {corpus}: resume "
                     f"those with data.files=[{corpus / 'train.jsonl'}] data.tokenizer={cache / f'tokenizer-{vocab}'} "
                     f"(or data.files=[{corpus / 'train.txt'}], runs from before they were rows)")
    return f" ({'; '.join(hints)})" if hints else ""


def resume_state(cfg: DictConfig, engine, ckpt_root: Path, ds: PackedDataset, pre: Preflight,
                 echo, ranks: Ranks = Ranks()) -> tuple[int, int]:
    """(start_step, data_position): 0, 0 for a fresh run; else restored from the latest checkpoint
    (engine state and global RNG states loaded)."""
    if not cfg.resume:
        return 0, 0
    last = ckpt.latest_checkpoint(ckpt_root)
    if last is None:
        echo(f"resume=true: no checkpoint in {ckpt_root}; starting at step 0")
        return 0, 0
    # (check_output_dir, at the start of _run, found the checkpoint this job's)
    state, tensors = ckpt.load_checkpoint(last, rank=ranks.rank)
    if int(state.get("world_size", 1)) != ranks.world:
        raise ConfigError(f"cannot resume: {last} was written by {state.get('world_size', 1)} processes, "
                          f"this run has {ranks.world}; the data order per step would differ")
    try:
        if isinstance(engine, DeepSpeedEngine):
            engine.load(last / "engine")
        else:
            engine.load_state_dict(tensors)
    except DiskIOError:
        raise
    except ResumeUnsupported as e:
        raise ConfigError(f"cannot resume from {last}: {e}") from None
    except OSError as e:   # (DeepSpeed's own files: one deleted gave a FileNotFoundError traceback)
        raise ConfigError(f"cannot resume from {last}: {e.strerror or type(e).__name__}"
                          f"{f' ({e.filename})' if e.filename else ''}; the checkpoint is incomplete: "
                          f"remove it to resume from the one before, or use a new output_dir") from None
    except (KeyError, ValueError, RuntimeError, AssertionError, EOFError, pickle.UnpicklingError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(engine, DeepSpeedEngine) and (not isinstance(e, (KeyError, ValueError, RuntimeError))
                                                    or "PytorchStreamReader" in why or "zip archive" in why):
            # DeepSpeed's own files, damaged (a truncated optimizer shard: "does not fit this run", use
            # the settings...; `latest` naming a missing tag: its AssertionError traceback; review)
            raise ConfigError(f"cannot resume from {last}: DeepSpeed's checkpoint in it is damaged or "
                              f"incomplete ({type(e).__name__}{': ' + why[:160] if why != type(e).__name__ else ''}); "
                              f"remove {last} to resume from "
                              f"the one before, or use a new output_dir") from None
        raise ConfigError(f"cannot resume from {last}: its engine state does not fit this run "
                          f"({why}); use the settings it was written with or a new output_dir") from None
    echo(f"resumed from {last} (step {state['step']}, data position {state['data_position']})")
    step, was = int(state["step"]), state.get("max_steps")
    if "eval_fingerprint" in state:   # (checkpoints before 2026-12-02 do not record it)
        then_eval = state["eval_fingerprint"]
        now_eval = pre.eval_dataset.fingerprint if pre.eval_dataset is not None else None
        if then_eval != now_eval:
            echo("the evaluation data differ from the checkpoint's run (" +
                 ("none then" if then_eval is None else "none now" if now_eval is None else
                  f"token fingerprint {then_eval} -> {now_eval}") +
                 f"): eval_loss from step {step + 1} on is not comparable with the rows before it")
    # The schedule and step size may change on resume (not refused: extending a run, a lower lr
    # are legitimate), and each change is said: only job.max_steps was, and optim.warmup_steps=6
    # given at step 3 warmed the lr up again, silently (review). Checkpoints before 2026-12-01
    # record only max_steps.
    now = {**schedule_settings(cfg), "max_steps": pre.max_steps}
    then = {**now, **(state.get("schedule") or {}), **({"max_steps": int(was)} if was is not None else {})}
    changed = [k for k in now if then[k] != now[k]]
    if set(changed) & set(SCHEDULE_KEYS):
        def lrs(s: int) -> tuple[float, float]:
            return tuple(lr_at(s, float(d["lr"]), int(d["warmup_steps"]), int(d["max_steps"]), float(d["min_lr_ratio"]))
                         for d in (then, now))
        what = ", ".join(f"{SETTING_NAMES[k]} {then[k]:g} -> {now[k]:g}" for k in changed if k in SCHEDULE_KEYS)
        s = next((s for s in range(step, pre.max_steps) if lrs(s)[0] != lrs(s)[1]), None)
        if s is not None:
            a, b = lrs(s)
            echo(f"{what} since the checkpoint's run: the lr schedule changes from step {s + 1} on (lr "
                 f"{a:.3g} -> {b:.3g} there" + (f"; the cosine now ends at step {pre.max_steps}"
                                                 if "max_steps" in changed else "") + ")")
    sized = [k for k in changed if k not in SCHEDULE_KEYS]
    if sized:
        echo(f"{', '.join(f'{SETTING_NAMES[k]} {then[k]} -> {now[k]}' for k in sized)} since the checkpoint's "
             f"run: each step from step {step + 1} on takes {now['batch_size'] * now['grad_accum']} sequences "
             f"(it took {then['batch_size'] * then['grad_accum']}); the data continues where it stopped")
    return step, int(state["data_position"])


SCHEDULE_KEYS = ("lr", "warmup_steps", "min_lr_ratio", "max_steps")
# How masked rows are packed into sequences, recorded in checkpoints: 4 (2026-12-02, later still) as
# 3 with no row's first token learned (the target of the row before it, which it cannot see);
# 3 (2026-12-02, later) as 2 with position ids per row, so that each attends only to itself;
# 2 (2026-12-02) packs each prompt/completion or chat row whole (data.dataset._pack_rows); 1
# (unrecorded) cut the token stream at fixed edges. Text data is packed alike in all.
DATA_PACKING = 4
SETTING_NAMES = {"lr": "optim.lr", "warmup_steps": "optim.warmup_steps", "min_lr_ratio": "optim.min_lr_ratio",
                 "max_steps": "job.max_steps", "batch_size": "job.batch_size", "grad_accum": "job.grad_accum"}


def schedule_settings(cfg: DictConfig) -> dict[str, Any]:
    """What a checkpoint records of the lr schedule and the step size besides its max_steps (a
    resume says what changed)."""
    o = cfg.optim
    return {"lr": float(o.lr), "warmup_steps": int(o.warmup_steps), "min_lr_ratio": float(o.min_lr_ratio),
            "batch_size": int(cfg.job.batch_size), "grad_accum": int(cfg.job.get("grad_accum", 1))}


# ================================ train ==========================================================

class MetricsLog:
    """metrics.jsonl (every step) + TensorBoard scalars; on resume, later steps are dropped."""

    def __init__(self, out: Path, start_step: int) -> None:
        self.path = out / "metrics.jsonl"
        self.earlier = keep_rows(self.path, start_step)   # the rows of the run this one resumes
        self.f = open(self.path, "a", encoding="utf-8")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=str(out / "tb"), purge_step=start_step + 1)
        except ImportError:
            pass

    def write(self, rec: dict[str, Any]) -> None:
        try:
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()
        except OSError as e:
            raise DiskIOError(e.errno, f"write {self.path}: {e.strerror}") from e
        if self.tb is not None:
            for k in ("loss", "lr", "grad_norm", "tokens_per_s", "device_peak_bytes", "step_time_s"):
                if rec.get(k) is not None:
                    self.tb.add_scalar(f"train/{k}", rec[k], rec["step"])
            if rec.get("eval_loss") is not None:
                self.tb.add_scalar("eval/loss", rec["eval_loss"], rec["step"])

    def close(self) -> None:
        self.f.close()
        if self.tb is not None:
            self.tb.close()


def keep_rows(path: Path, last_step: int, rows: bool = True) -> list[dict[str, Any]]:
    """Keep the rows of JSONL `path` up to step `last_step` (a resume's checkpoint; 0: none) and
    return them (`rows=False`: none): those of later steps, which a killed run wrote past its last
    checkpoint, are run again."""
    return keep_jsonl_rows(path, lambda rec: rec["step"] <= last_step, rows=rows)


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


class TrainingInterrupted(Exception):
    """Ctrl-C (KeyboardInterrupt) in `run`: one line saying where it stopped, the checkpoint a
    resume continues from and how to continue (the CLI prints it and exits `exit_code`: 130, or
    143 for a SIGTERM)."""

    def __init__(self, msg: str, exit_code: int = 130) -> None:
        super().__init__(msg)
        self.exit_code = exit_code


def run(cfg: DictConfig, output_dir: str | Path, pre: Preflight | None = None,
        echo=print) -> dict[str, Any]:
    """Train as configured; returns the run summary (also written to output_dir/summary.json)."""
    at: dict[str, Any] = {}   # how far the run got, for the message if it is interrupted
    restore = _note_sigint(at)
    restore_term = _note_sigterm(at)
    try:
        return _run(cfg, output_dir, pre, echo, at)
    except KeyboardInterrupt:
        # Nothing to undo: the engine is closed on the way out, a checkpoint cut short is removed
        # (the ones before stay whole), metrics and trace rows are flushed as they are written.
        term = at.get("sigterm")
        raise TrainingInterrupted(interrupted_message(Path(output_dir).expanduser(), at),
                                  143 if term else 130) from None
    finally:
        restore_term()
        restore()
        if (fd := at.pop("lock_fd", None)) is not None:
            os.close(fd)   # (releases the output_dir's lock)


def learned_targets(labels: torch.Tensor) -> int:
    """How many tokens of a [B, S] label batch the loss learns (the model shifts the labels)."""
    return int((labels[:, 1:] != -100).sum())


def token_weights(labels: list[torch.Tensor]) -> list[float] | None:
    """Each micro-batch's weight in the step's loss (all ranks' micro-batches, in order), so that
    the step minimises the mean over every learned token, not the mean of the micro-batches' means
    (HF's num_items_in_batch, torchtune's normalisation): with prompt tokens masked, batch 4 x
    accum 1 and 2 x 2 gave other losses on the same sequences. Weight k = n * tokens_k / tokens
    (engines average over the n micro-batches, ranks included); None when every micro-batch learns
    as many tokens (all weights 1: the plain mean, bit for bit)."""
    counts = [learned_targets(y) for y in labels]
    total = sum(counts)
    if total == 0 or len(set(counts)) == 1:
        return None
    return [len(counts) * c / total for c in counts]


def _note_sigint(at: dict[str, Any]):
    """Ctrl-C raises KeyboardInterrupt as usual, and is also noted in `at`: one that lands in a
    weakref callback or a finalizer (the memory accountant's, which run often) is printed as
    "Exception ignored" and dropped by Python, and the run trained on to the end. The training
    loop checks the note after each step. Returns what puts the previous handler back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return lambda: None   # (not ours to replace: a thread, or a handler someone installed)

    def on_sigint(signum, frame):
        at["sigint"] = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    return lambda: signal.signal(signal.SIGINT, signal.default_int_handler)


def _note_sigterm(at: dict[str, Any]):
    """SIGTERM (a scheduler's preemption: Slurm, Kubernetes, `timeout`) during the training loop
    lets the running step finish, writes a checkpoint of it and stops (`at["sigterm"]`, checked
    after each step), so a preempted run loses no step; in the last step the run ends as usual
    (final model, summary); outside the loop, or a second SIGTERM, it stops as Ctrl-C does. It killed the run with no word before, losing up to save_every steps
    (review). One process only: a multi-process launch's ranks must all checkpoint together."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL \
            or int(os.environ.get("WORLD_SIZE") or 1) > 1:
        return lambda: None

    def on_sigterm(signum, frame):
        first = not at.get("sigterm")
        at["sigterm"] = True
        if not (first and at.get("in_loop")):
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


RUN_LOCK = ".lazytrain-run.lock"


def lock_output_dir(out: Path) -> int | None:
    """An flock on `out` held while a run writes there (storage.filemode.hold_flock: the fd, or
    None where flock is unsupported). Two runs on one output_dir (a scheduler requeueing a job
    whose first process still runs) both wrote the same checkpoint paths, and one process's
    metrics rows went into a file the other had replaced."""
    try:
        return hold_flock(out / RUN_LOCK)
    except BlockingIOError:
        raise ConfigError(f"output_dir {out} is in use by another lazytrain run (it holds "
                          f"{out / RUN_LOCK}); wait for it to end, or use another output_dir") from None


def interrupted_message(out: Path, at: dict[str, Any]) -> str:
    """Where an interrupted run stopped, its last checkpoint and how to continue, in one line."""
    if "step" not in at:
        where = "before its first step"
    elif at.get("saving") == "final":
        where = f"after the last step ({at['step']}), while saving the final model"
    elif at.get("saving") == "checkpoint":
        where = f"after step {at['step']}, while saving its checkpoint"
    elif at.get("between_steps"):
        where = f"after step {at['step']} of {at['max_steps']}"
    else:
        where = f"at step {at['step'] + 1} of {at['max_steps']}"
    last = ckpt.latest_checkpoint(out / "checkpoints")
    how = "stopped by SIGTERM" if at.get("sigterm") else "interrupted"
    if last is None:
        return (f"{how} {where}; no checkpoint was written yet: resume=true {_dir_override(out)} "
                f"starts again from step 0")
    n = last.name[len("step_"):].lstrip("0") or "0"
    return (f"{how} {where}; the last checkpoint is step {n}: continue with resume=true "
            f"{_dir_override(out)}")


def _dir_override(out: Path | str) -> str:
    """`output_dir=DIR` as a command line takes it: quoted where Hydra would misread the path (a
    sweep job's dir, optim.lr=0.003, holds '=')."""
    s = str(out)
    return f"output_dir={hydra_quoted(s)}" if any(c in s for c in "=,[]{}()' ") else f"output_dir={s}"


def check_output_dir(cfg: DictConfig, out: Path, pre: Preflight) -> None:
    """ConfigError when `out` cannot take this run: checkpoints of an earlier run without
    resume=true, a checkpoint this job cannot resume, or another run writing there. `lazytrain
    train` checks before Hydra starts (Hydra first writes .hydra/ into the run dir: a refused run
    replaced the finished run's config record); `_run` checks again."""
    found = ckpt.latest_checkpoint(out / "checkpoints")
    if not cfg.resume and found is not None:
        # a fresh run would overwrite its metrics and prune its checkpoints
        raise ConfigError(f"output_dir {out} holds checkpoints of an earlier run (the latest: "
                          f"{found.name}); resume=true continues it, a new run needs another "
                          f"output_dir (or remove {out / 'checkpoints'})")
    if cfg.resume and found is not None:
        state = ckpt.read_state(found)
        check_resumable(state, cfg, pre.dataset, pre)
        if cfg.engine == "deepspeed":
            check_deepspeed_precision(out, pre.job.compute_dtype)
        world = ranks_of(cfg).world
        # (said before the model is built and engines start; only where the launcher set WORLD_SIZE:
        # one that starts the process group itself, MPI or srun, is checked in resume_state)
        if os.environ.get("WORLD_SIZE") and int(state.get("world_size", 1)) != world:
            raise ConfigError(f"cannot resume: {found} was written by {state.get('world_size', 1)} processes, "
                              f"this run has {world}; the data order per step would differ")
    if ranks_of(cfg).main and (out / RUN_LOCK).is_file():
        # (a probe, released at once, and rank 0's only: the run's rank 0 takes it for real, and
        # other ranks probing while it holds it refused their own launch)
        fd = lock_output_dir(out)
        if fd is not None:
            os.close(fd)


def _run(cfg: DictConfig, output_dir: str | Path, pre: Preflight | None, echo,
         at: dict[str, Any]) -> dict[str, Any]:
    # ---- setup --------------------------------------------------------------------------------
    ranks = ranks_of(cfg)
    if not ranks.main:
        echo = _silent
    pre = pre or preflight(cfg)
    out = Path(output_dir).expanduser()
    check_output_dir(cfg, out, pre)   # (every rank: all of them stop, not only the one that writes)
    max_steps = pre.max_steps
    stop_at = int(cfg.stop_at_step) if cfg.get("stop_at_step") else max_steps
    last = ckpt.latest_checkpoint(out / "checkpoints") if cfg.resume else None
    if last is not None:
        state = ckpt.read_state(last)
        done = int(state["step"])
        # (a final/ of another step, an earlier max_steps', is stale: an extended run killed while
        # writing its own left the old one, which every later resume kept: review; one written before
        # the step was recorded is taken as current, as before)
        held = final_step(out / "final")
        if held is None and (out / "final").exists():
            # written before the step was recorded: current when the run's summary (written after
            # final/) ends at this step having written it; an extended run killed while saving, or
            # one run with save_final_model=false, left the older one
            held = _summary_end(out / "summary.json", wrote_final=True)
        refinish = done == max_steps and cfg.save_final_model and held != done
        if done >= min(max_steps, stop_at) and not refinish:
            # Nothing to train (e.g. a finished run resumed again): its outputs stay as they are,
            # summary.json and trace.jsonl with them (check_output_dir found it this job's).
            summary = {"steps": 0, "start_step": done, "end_step": done, "output_dir": str(out),
                       "engine": str(cfg.engine), "max_steps": max_steps,
                       "stop_at_step": stop_at if stop_at < max_steps else None}
            echo(format_summary(summary))
            return summary
    out.mkdir(parents=True, exist_ok=True)
    if ranks.main:   # (a launcher's ranks share the dir: one lock, rank 0's)
        at["lock_fd"] = lock_output_dir(out)
        # a killed run's half-written files; only under the lock (a filesystem without flock gives
        # none: another run may be writing its checkpoint there)
        gone = ckpt.remove_stale_temps(out, final_tmp(out / "final").name) if at["lock_fd"] is not None else []
        if gone:
            echo(f"removed what an interrupted run left half-written: {', '.join(gone)}")
    nvme_dir = Path(str(cfg.storage.nvme_dir)).expanduser() if cfg.storage.get("nvme_dir") else out / "nvme"
    check_nvme_dir(nvme_dir, plan_nvme_bytes(pre.plan), create=not cfg.storage.get("nvme_dir"))
    echo(plan_summary(pre.plan))
    # The model before plan.json (under the lock, which must cover the load: a second run on the
    # dir started and finished while it loaded, and this one then trained over it; review): a
    # model.path refused for missing or mis-shaped weights (found only as they load) wrote
    # plan.json first, and on a resume replaced the run's, which `plan trace` then refused as not
    # the plan its trace ran (review).
    seed = int(cfg.seed)
    tokenizer, ds = pre.tokenizer, pre.dataset
    model = build_model(pre.model, cfg.model.get("path"), pre.job, seed)
    if not cfg.model.get("path"):
        align_special_tokens(model, tokenizer)
    if ranks.main:
        _write_text(out / "plan.json", pre.plan.to_json())
    if pre.hardware.device_type == "cuda" and not torch.cuda.is_available():
        # build_engine falls back to the CPU; say so, or a GPU profile silently trains on the CPU
        held = ("with the planned device budget enforced by the executor's accountant"
                if cfg.engine == "lazytrain" else f"(engine={cfg.engine} does not hold it to the planned "
                                                  f"device budget)")
        echo(f"hardware={pre.hardware.name} describes a CUDA GPU but none is available: training on "
             f"the CPU {held}; hardware=cpu plans for this machine")

    engine = build_engine(cfg, model, pre, out, nvme_dir)
    if ranks.world == 1 and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        # a launcher that sets RANK / WORLD_SIZE only when the process group starts (MPI, srun)
        ranks = Ranks(torch.distributed.get_rank(), torch.distributed.get_world_size())
        if not ranks.main:
            echo = _silent
    ckpt_root = out / "checkpoints"
    try:
        for note in pre.notes:
            echo(note)
        if isinstance(engine, DeepSpeedEngine):
            for line in engine.dropped:
                echo(f"deepspeed: cannot follow the plan here: {line}")
            if pre.ds_overrides:
                echo(f"deepspeed: your settings, merged over the plan's: "
                     f"{json.dumps(pre.ds_overrides, sort_keys=True)}")
        elif cfg.engine == "torch" and pre.job.loss_chunk_tokens:   # (it was silent: review)
            echo(f"torch: job.loss_chunk_tokens={pre.job.loss_chunk_tokens} is not followed: plain PyTorch runs "
                 f"the model's own (unchunked) loss, all logits at once")
        trace = getattr(getattr(engine, "ex", None), "trace", None)   # engine=lazytrain's own
        if last is not None and trace is not None:
            trace.continue_run(done)   # a resume appends, as to metrics.jsonl
        start_step, position = resume_state(cfg, engine, ckpt_root, ds, pre, echo, ranks)
        if isinstance(engine, DeepSpeedEngine) and ranks.main:
            # what DeepSpeed runs with (this run's), for the record and for reuse; once the resume
            # took (a refused one wrote its settings over the record of the run's; review)
            ckpt.atomic_write_text(out / "ds_config.json", json.dumps(engine.tr.ds_config, indent=2, sort_keys=True) + "\n")
    except BaseException:
        engine.close()
        raise

    # ---- train --------------------------------------------------------------------------------
    o, job = cfg.optim, pre.job
    save_every, log_every = int(cfg.save_every), max(1, int(cfg.log_every))
    metrics = MetricsLog(out, start_step) if ranks.main else _NullMetrics()
    trace_f = None
    if cfg.engine != "lazytrain" and ranks.main:
        keep_rows(out / "trace.jsonl", start_step, rows=False)   # as metrics.jsonl (steps numbered alike)
        trace_f = open(out / "trace.jsonl", "a")
    bar = _progress(max_steps, start_step, bool(cfg.progress) and ranks.main)
    history: list[StepStats] = []
    eval_every = int(cfg.get("eval_every") or 0)
    eval_limit = None if cfg.get("eval_batches") is None else int(cfg.eval_batches)
    eval_losses = [(int(r["step"]), float(r["eval_loss"])) for r in metrics.earlier   # (before a resume)
                   if isinstance(r.get("step"), int) and isinstance(r.get("eval_loss"), (int, float))]
    t_run = time.perf_counter()
    step = start_step
    at.update(step=step, max_steps=max_steps)

    def save(step_done: int) -> None:
        state = {"data_position": position, "plan_hash": pre.plan.input_hash, "max_steps": max_steps,
                 "schedule": schedule_settings(cfg), **job_identity(cfg, ds, pre), "data_packing": DATA_PACKING,
                 "doc_mask": doc_mask_of(cfg),
                 # (a resume on other evaluation data says so: one eval_loss curve spanned two sets)
                 "eval_fingerprint": pre.eval_dataset.fingerprint if pre.eval_dataset is not None else None}
        if isinstance(engine, DeepSpeedEngine):
            ckpt.save_checkpoint(ckpt_root, step_done, state,
                                 engine_writer=lambda d: engine.save(d, {"step": step_done}),
                                 keep_last=int(cfg.keep_checkpoints), rank=ranks.rank, world=ranks.world,
                                 barrier=ranks.barrier)
        else:
            tensors = engine.state_shards() if hasattr(engine, "state_shards") else engine.state_dict()
            ckpt.save_checkpoint(ckpt_root, step_done, state, engine_tensors=tensors,
                                 keep_last=int(cfg.keep_checkpoints))

    at["in_loop"] = True   # (a SIGTERM now ends the step and checkpoints it: _note_sigterm)
    try:
        while step < min(max_steps, stop_at):
            lr = lr_at(step, float(o.lr), int(o.warmup_steps), max_steps, float(o.min_lr_ratio))
            engine.set_lr(lr)
            # one step's micro-batches for all ranks; this rank trains every world-th of them
            mbs, position = ds.step_batches(position, job.batch_size, job.grad_accum * ranks.world)
            t0 = time.time()
            w = token_weights([b.labels for b in mbs])
            mine = [b.micro_batch() for b in mbs[ranks.rank::ranks.world]]
            # (weights only where they differ from 1: an engine without them trains as before)
            st = engine.train_step(mine) if w is None else engine.train_step(mine, w[ranks.rank::ranks.world])
            if ranks.world > 1:   # what the step did as a whole: the mean loss, all tokens
                loss_sum, tokens = ranks.sum(st.loss, st.tokens)
                st = replace(st, loss=loss_sum / ranks.world, tokens=int(tokens))
            step += 1
            at["step"] = step
            history.append(st)
            tps = st.tokens / st.step_time_s if st.step_time_s > 0 else 0.0
            rec = {"step": step, "loss": st.loss, "lr": lr, "grad_norm": st.grad_norm,
                   "tokens_per_s": tps, "device_peak_bytes": st.device_peak_bytes,
                   "step_time_s": st.step_time_s, "tokens": st.tokens, "skipped": st.skipped,
                   **({"loss_scale": st.loss_scale} if st.loss_scale is not None else {}),
                   "data_position": position,
                   "predicted_step_time_s": st.predicted_step_time_s or pre.plan.predicted.step_time_s,
                   "predicted_device_peak_bytes": st.predicted_device_peak_bytes
                   or int(pre.plan.predicted.peak_bytes.get("device", 0))}
            # (not at a stop_at_step pre-emption: a stopped and resumed run logs what an
            # uninterrupted one does)
            if pre.eval_dataset is not None and ((eval_every and step % eval_every == 0) or step == max_steps):
                rec["eval_loss"] = evaluate(engine, pre.eval_dataset, job.batch_size, eval_limit)
                eval_losses.append((step, rec["eval_loss"]))
            metrics.write(rec)
            if trace_f is not None:  # engines without their own trace: one compute event per step
                trace_f.write(json.dumps({"op": "compute", "name": "step", "step": step,
                                          "start_s": t0, "end_s": t0 + st.step_time_s,
                                          "bytes": 0, "tier": "device"}) + "\n")
            if step % log_every == 0 or step == max_steps:   # (before the redraw: this step's figures)
                ev = f"  eval {eval_losses[-1][1]:.3f}" if eval_losses else ""
                bar.set_postfix_str(f"loss {st.loss:.3f}{ev}  {tps:,.0f} tok/s  "
                                    f"mem {_fmt_bytes(st.device_peak_bytes)}", refresh=False)
            bar.update(1)
            if (save_every and step % save_every == 0) or step in (max_steps, stop_at) or at.get("sigterm"):
                at["saving"] = "checkpoint"
                save(step)   # (a SIGTERM's: this step kept, see _note_sigterm)
                del at["saving"]
            # a Ctrl-C that Python dropped (see _note_sigint); a SIGTERM's stop, unless this was the
            # last step (the run then ends as usual: its final model and summary; review)
            if at.get("sigint") or (at.get("sigterm") and step < min(max_steps, stop_at)):
                at["between_steps"] = True
                raise KeyboardInterrupt
    except BaseException:
        engine.close()
        raise
    finally:
        at.pop("in_loop", None)
        bar.close()
        metrics.close()
        if trace_f is not None:
            trace_f.close()

    # ---- save ---------------------------------------------------------------------------------
    final_dir = None
    try:
        if step == max_steps and cfg.save_final_model:
            at["saving"] = "final"
            engine.sync_model()
            final_dir = out / "final"
            note = save_final_model(engine, tokenizer, final_dir, ranks, step=step,
                                    with_base=pre.job.mode == "lora" and not cfg.model.get("path"))
            if note:
                echo(note)
    finally:
        engine.close()
    summary = summarize(history, pre.plan, start_step, step, time.perf_counter() - t_run, metrics.earlier)
    summary.update({"output_dir": str(out), "final_dir": final_dir and str(final_dir),
                    "engine": str(cfg.engine), "dataset_sequences": len(ds),
                    "dataset_tokens": ds.num_tokens, "max_steps": max_steps,
                    "device": "cuda" if pre.hardware.device_type == "cuda" and torch.cuda.is_available() else "cpu",
                    "op_temporaries_counted": bool(cfg.get("count_op_temporaries", False))})
    if pre.eval_dataset is not None:
        summary["eval_sequences"] = len(pre.eval_dataset)
        summary["eval_tail_tokens"] = int(getattr(pre.eval_dataset, "tail_tokens", 0))
        summary["eval_sequences_used"] = len(pre.eval_dataset) if eval_limit is None else \
            min(len(pre.eval_dataset), eval_limit * job.batch_size)
        if eval_losses:
            summary["eval_loss"] = eval_losses[-1][1]
            summary["eval_losses"] = eval_losses
    # (a resume that only wrote the final model keeps the summary of the steps that ran, unless
    # that summary is of an earlier end: a run extended and killed before its own was written)
    if ranks.main and (history or _summary_end(out / "summary.json") != step):
        _write_text(out / "summary.json", json.dumps(summary, indent=1))
    echo(format_summary(summary))
    if step < max_steps:   # stop_at_step: a planned pre-emption, continued with resume=true
        echo(f"stopped at step {step} of {max_steps} (stop_at_step={stop_at}); the checkpoint is saved: "
             f"continue with resume=true {_dir_override(out)}")
    return summary


def _write_text(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise DiskIOError(e.errno, f"write {path}: {e.strerror}") from e


def _silent(*_args, **_kwargs) -> None:
    """`echo` of ranks other than 0."""


class _NullMetrics:
    """MetricsLog of ranks other than 0."""

    earlier: list[dict[str, Any]] = []

    def write(self, rec: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


# ================================ save / report ==================================================

def align_special_tokens(model: torch.nn.Module, tokenizer) -> None:
    """A model built from a config (model=NAME) has its family's default special-token ids (Llama:
    bos 1, eos 2), not its tokenizer's (the built-in one: bos = eos = 0, pad 1): saved so, its
    generate() stopped at an ordinary token and never at the end-of-text it was trained on. The
    tokenizer's are taken (weights untouched: the ids are only read when generating)."""
    gen = getattr(model, "generation_config", None)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(tokenizer, name, None)
        setattr(model.config, name, v)
        if gen is not None:
            setattr(gen, name, v)


FINAL_MARK = "lazytrain_final.json"   # in final/: the step its weights are of


def final_step(final_dir: Path) -> int | None:
    """The step a final/ dir holds (None: none, unreadable, or written before 2026-12-01)."""
    try:
        return int(json.loads((final_dir / FINAL_MARK).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _summary_end(path: Path, wrote_final: bool = False) -> int | None:
    """The step a run's summary.json ends at (`wrote_final`: only if that run wrote final/)."""
    try:
        s = json.loads(path.read_text())
        return None if wrote_final and not s.get("final_dir") else int(s["end_step"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def final_tmp(final_dir: Path) -> Path:
    """Where the final model is written before its rename (a killed run's is removed at the next)."""
    return final_dir.with_name(final_dir.name + ".tmp")


# Text whose ids tell tokenizers apart: digits, runs of spaces and newlines, punctuation, non-ASCII.
TOKENIZER_PROBE = "of 1234 and  5678, x=f(y);\n\n\tthe  cache - 2026-12-02: \u00fcber \u4e2d\u6587 \U0001f600 \"q\" don't"


def _check_tokenizer_reload(tokenizer, tmp: Path, final_dir: Path) -> str | None:
    """A note when `AutoTokenizer.from_pretrained(final)` would not encode as the run's tokenizer did.
    transformers picks a tokenizer class by the model dir's config.json `model_type` for some types
    (qwen2: Qwen2Tokenizer, whatever tokenizer_config.json names), and that class builds its own
    pre-tokenizer: a run with a tokenizer of its own (`data.tokenizer=DIR`, or data=demo's) on a
    Qwen2 model wrote a final/ that split digits another way (a review, 2026-12-02). Then the run's
    tokenizer is also saved, alone, in final/tokenizer (no config.json there: it loads as saved)."""
    if not (tmp / "config.json").is_file():   # (a LoRA adapter dir: its tokenizer loads as saved)
        return None
    from transformers import AutoTokenizer

    try:
        again = AutoTokenizer.from_pretrained(str(tmp))
        same = again(TOKENIZER_PROBE)["input_ids"] == tokenizer(TOKENIZER_PROBE)["input_ids"]
        got = type(again).__name__
    except Exception as e:  # noqa: BLE001 - any failure to load it back is what the note is about
        same, got = False, f"an error ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    if same:
        return None
    tokenizer.save_pretrained(str(tmp / "tokenizer"))
    return (f"note: AutoTokenizer.from_pretrained({final_dir}) gives {got}, which does not encode as the "
            f"{type(tokenizer).__name__} this run trained with (transformers picks the tokenizer class by "
            f"the model type); the run's own is in {final_dir / 'tokenizer'}: load that one "
            f"(AutoTokenizer.from_pretrained({final_dir / 'tokenizer'}))")


def save_final_model(engine, tokenizer, final_dir: Path, ranks: Ranks = Ranks(), step: int | None = None,
                     with_base: bool = False) -> str | None:
    """Full FT: an HF model dir `from_pretrained` loads; LoRA: a PEFT adapter dir. Atomic rename.
    Under a launcher every rank helps gather the weights; rank 0 writes them. `step`: recorded in
    it (FINAL_MARK), so a resume knows whether it is the last checkpoint's. `with_base` (LoRA on a
    model built from its config, whose base exists nowhere else): the frozen base weights the
    adapters were trained with go to `final/base` (an HF model dir), and the adapter's config names
    that dir as its base model (so `AutoPeftModelForCausalLM.from_pretrained(final)` loads both).
    Returns a note when final/'s tokenizer does not load back as the run's (_check_tokenizer_reload)."""
    tmp = final_tmp(final_dir)
    if ranks.main:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        if isinstance(engine, DeepSpeedEngine):
            # a collective gather on every rank
            engine.save_pretrained(tmp, write=ranks.main, base_dir=tmp / "base" if with_base else None)
        else:
            engine.model.save_pretrained(str(tmp), safe_serialization=True)
            if with_base:
                save_base_model(engine.model, tmp / "base")
        ranks.barrier()
        if not ranks.main:
            return
        if with_base:
            point_adapter_at_base(tmp, final_dir.resolve() / "base")
        tokenizer.save_pretrained(str(tmp))
        note = _check_tokenizer_reload(tokenizer, tmp, final_dir)
        if step is not None:
            (tmp / FINAL_MARK).write_text(json.dumps({"step": int(step)}))
        share_like_umask(tmp)   # safetensors writes its files 0600 (see storage/filemode.py)
        ckpt.fsync_tree(tmp)
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp, final_dir)
        return note
    except (OSError, SafetensorError) as e:   # (safetensors reports a full disk as its own error)
        if ranks.main:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, DiskIOError):
            raise
        errno, why = DiskIOError.reason(e)
        where = f"{e.filename}" if isinstance(e, OSError) and e.filename else f"{tmp}"
        raise DiskIOError(errno, f"write the final model {where} ({why}); "
                                 f"{ckpt.earlier_checkpoints(final_dir.parent / 'checkpoints')}") from e


def summarize(history: list[StepStats], plan: Plan, start_step: int, end_step: int,
              wall_s: float, earlier: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """This process's steps (`history`); the losses over the whole run, from `earlier`: the
    metrics rows of the steps before a resume (a resumed run's first loss is still its step 1's,
    not the resume's, so first -> last says what the whole run learnt). Times and memory are this
    process's: measured here and now, on this machine."""
    before = [(int(r["step"]), float(r["loss"])) for r in earlier
              if isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float))]
    losses = [x for _, x in before] + [h.loss for h in history]
    k = max(1, min(5, len(losses) // 4))
    whole_run = {} if not losses else {
        "loss_from_step": before[0][0] if before else start_step + 1,
        "first_loss": losses[0], "last_loss": losses[-1],
        "first_loss_avg": sum(losses[:k]) / k,
        "last_loss_avg": sum(losses[-k:]) / k}
    if not history:   # (a resume that only finished the final model: the run's losses still)
        return {"steps": 0, "start_step": start_step, "end_step": end_step, **whole_run}
    # step 1 includes warm-up; the median as `plan trace` takes it (an even count: the mean of the two)
    med_t = statistics.median(h.step_time_s for h in history[1:] or history)
    return {
        "steps": len(history), "start_step": start_step, "end_step": end_step, "wall_s": wall_s,
        **whole_run,
        "tokens_per_s": history[-1].tokens / med_t if med_t > 0 else 0.0,
        "measured_step_time_s": med_t,
        "predicted_step_time_s": history[-1].predicted_step_time_s or plan.predicted.step_time_s,
        "measured_device_peak_bytes": max(h.device_peak_bytes for h in history),
        "predicted_device_peak_bytes": history[-1].predicted_device_peak_bytes
        or int(plan.predicted.peak_bytes.get("device", 0)),
        "skipped_steps": sum(h.skipped for h in history),
    }


def format_summary(s: dict[str, Any]) -> str:
    if not s.get("steps"):
        # (a final model written now: a resume of a run stopped or killed before it saved one)
        saved = f"; the final model is saved in {s['final_dir']}" if s.get("final_dir") else ""
        if s.get("max_steps") is not None and s.get("start_step", 0) >= s["max_steps"]:
            return (f"no steps run: the run is already at step {s['start_step']} of "
                    f"job.max_steps={s['max_steps']} (raise job.max_steps to train on){saved}")
        if s.get("stop_at_step") is not None and s.get("start_step", 0) >= s["stop_at_step"]:
            return (f"no steps run: the run is already at step {s['start_step']}, past "
                    f"stop_at_step={s['stop_at_step']} (raise or unset it to train on)")
        return "no steps run" + saved
    since = s.get("loss_from_step", s["start_step"] + 1)
    span = "" if since == s["start_step"] + 1 else f" (steps {since}..{s['end_step']}, the run so far)"
    return "\n".join([
        f"trained steps {s['start_step'] + 1}..{s['end_step']} in {s['wall_s']:.1f} s  "
        f"({s['tokens_per_s']:,.0f} tokens/s, median step {s['measured_step_time_s'] * 1e3:.0f} ms)",
        f"loss{span}: first {s['first_loss']:.3f} -> last {s['last_loss']:.3f}  "
        f"(mean of first/last few: {s['first_loss_avg']:.3f} -> {s['last_loss_avg']:.3f})"
        + (f"\neval loss (held-out, {s['eval_sequences_used']} of {s['eval_sequences']} sequences"
           + (f"; the last {s['eval_tail_tokens']} tokens, short of a sequence, not evaluated"
              if s.get("eval_tail_tokens") else "") + "): "
           + ", ".join(f"step {k} {x:.3f}" for k, x in s["eval_losses"][-4:]) if s.get("eval_losses") else ""),
        f"step time: predicted {s['predicted_step_time_s'] * 1e3:.0f} ms, measured "
        f"{s['measured_step_time_s'] * 1e3:.0f} ms;  device peak: predicted "
        f"{_fmt_bytes(s['predicted_device_peak_bytes'])}, measured {_fmt_bytes(s['measured_device_peak_bytes'])}"
        + ("" if s.get("engine", "lazytrain") == "lazytrain" else
           f"  (predicted: lazytrain's plan; this run used engine={s['engine']}, which does not follow it"
           + ("; measured: the process's peak RSS, its CPU has no device memory of its own"
              if s.get("device") == "cpu" else "") + ")")
        + ("  (measured: what the executor places; the prediction also holds the temporaries ops make "
           "inside a layer, which count_op_temporaries=true counts too)"
           if s.get("engine", "lazytrain") == "lazytrain" and s.get("device") == "cpu"
           and s.get("op_temporaries_counted") is False else ""),
        f"outputs: {s.get('output_dir')}" + (f"  (final model: {s['final_dir']})" if s.get("final_dir") else ""),
    ])
