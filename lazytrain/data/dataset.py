"""Packed token datasets from local text / JSONL files, in a deterministic, resumable order.

Every document is tokenized, followed by the tokenizer's EOS (and preceded by its BOS where the
tokenizer adds one itself, `bos_for`), and the documents are concatenated and cut into sequences of
`seq_len` tokens (the tail that does not fill a sequence is dropped).
Labels equal input_ids (Hugging Face convention: the causal LM shifts them internally).

Prompt/completion data (supervised fine-tuning): with `prompt_field` set, each JSONL row gives a
prompt (`prompt_field`) and a completion (`text_field`); both are tokenized separately (so the
boundary is exact), packed as prompt + completion + EOS, and only completion and EOS tokens are
learned: prompt positions get label -100, which the loss ignores. Rows are packed whole: a row
that does not fit the rest of a sequence starts the next one (the rest is padding, not learned);
a row longer than `seq_len` starts a sequence and runs on into the next, each beginning with the
last token before it as context (`_pack_rows`).
Sequences with nothing to learn are dropped.

Chat data: with `messages_field` set, each JSONL row holds a list of {"role", "content"} messages,
rendered with the tokenizer's chat template (`apply_chat_template`); only the assistant messages'
tokens (with the template's end-of-turn tokens) are learned (`tokenize_chats`); rows packed whole, as
prompt/completion rows are.

Order: epoch e visits the sequences in `randperm(n, seed + e)` order, so the whole stream is a pure
function of (files, tokenizer, seq_len, seed) and a single integer — the number of sequences already
consumed — is the data position a checkpoint saves to resume exactly.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..storage.filemode import share_like_umask

# Suffixes compare case-insensitively (`notes.TXT`, `data.JSONL`); `.ndjson` is JSONL by another name.
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A user-facing data problem; the message is one actionable line."""


def holds_tokenizer(folder: Path) -> bool:
    """Whether `folder` has files an HF tokenizer loads from."""
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def load_tokenizer(tokenizer_dir: str | Path):
    """An HF tokenizer from a local dir (never the hub)."""
    p = Path(tokenizer_dir).expanduser()
    if not p.is_dir():
        raise DataError(f"tokenizer dir {p} does not exist (data.tokenizer must be a local "
                        f"Hugging Face tokenizer dir with tokenizer.json or tokenizer_config.json)")
    if not holds_tokenizer(p):
        raise DataError(f"{p} holds no tokenizer (no tokenizer.json / tokenizer_config.json)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the tokenizer in {p}: {str(e).splitlines()[0]}") from None
    except Exception as e:   # noqa: BLE001 - the Rust side raises a bare Exception (a tokenizer.json
        # from a newer `tokenizers`), a KeyError for one missing a key: a traceback before (review)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"cannot load the tokenizer in {p}: {type(e).__name__}: {first} (a tokenizer.json "
                        f"written by a newer `tokenizers`? upgrade it, or save the tokenizer again)") from None


def read_chat_template(path: Path) -> str:
    """A Jinja chat template from a file (data.chat_template), checked to parse."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"data.chat_template={path}: no such file (a Jinja chat template, e.g. an "
                        f"instruct model's chat_template.jinja)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.chat_template={path}: cannot read it ({e})") from None
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:   # compiled as apply_chat_template does (its sandbox and the {% generation %} tag)
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"data.chat_template={path}:{e.lineno}: not a valid Jinja template ({e.message})") from None
    return text


def is_jsonl(path: Path) -> bool:
    """Whether `path` is read as JSONL (one document per line) rather than as one text document."""
    return path.suffix.lower() in JSONL_SUFFIXES


def _hidden(path: Path, root: Path) -> bool:
    """Whether `path` lies in a hidden file or dir below `root` (`.ipynb_checkpoints/`, `.git/`,
    editors' `.swp` files): Jupyter keeps a copy of every file it saves there, and taking them
    would train on the data twice."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _walk(root: Path) -> list[Path]:
    """Every path below `root`, following directory links (Path.rglob skipped a linked subdir's
    files silently, while taking linked files: review), each real directory once (a link back up
    is no loop); hidden dirs are not entered. An unreadable dir raises its OSError."""
    def fail(e: OSError) -> None:
        raise e

    out: list[Path] = []
    seen: set[str] = set()
    for d, dirs, names in os.walk(root, followlinks=True, onerror=fail):
        real = os.path.realpath(d)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        # real dirs before links, by name, at each level: which path a dir reachable twice is taken
        # under does not depend on the order the filesystem lists entries (it decided the data
        # order: review); a link at a shallower level than the real dir still comes first
        dirs[:] = sorted((x for x in dirs if not x.startswith(".")),
                         key=lambda x: (os.path.islink(os.path.join(d, x)), x))
        out += [Path(d) / x for x in names]
    return out


def expand_files(files: Sequence[str | Path]) -> list[Path]:
    """Files as given (whatever their names); a directory contributes its text and JSONL files (by
    suffix, in any case) in sorted order, hidden files and dirs below it skipped."""
    out: list[Path] = []
    for f in files:
        p = Path(f).expanduser()
        if p.is_dir():
            try:
                found = sorted(q for q in _walk(p) if q.is_file() and not _hidden(q, p)
                               and q.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES)
            except OSError as e:   # (an unreadable dir below it)
                raise DataError(f"data dir {p}: cannot list {e.filename or ''}: {e.strerror or e}") from None
            if not found:
                raise DataError(f"data dir {p} holds no {'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} "
                                f"files (hidden ones are skipped)")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"data file {p} does not exist")
    if not out:
        raise DataError("no data files given (set data.files=[PATH,...])")
    # each real file once (a file reached twice, through a link or a dir listed with its parent,
    # was trained twice: review), the first path it was reached by kept
    seen: dict[str, Path] = {}
    dupes = []
    for q in out:
        real = os.path.realpath(q)
        if real in seen:
            dupes.append(f"{q} (= {seen[real]})")
        else:
            seen[real] = q
    if dupes:
        log.warning("data: %d file(s) reached twice, read once: %s", len(dupes), ", ".join(dupes[:5])
                    + (", ..." if len(dupes) > 5 else ""))
    return list(seen.values())


_JSON_TYPES = {list: "a JSON array", dict: "a JSON object", bool: "a JSON boolean",
               int: "a JSON number", float: "a JSON number"}


def _field_text(path: Path, lineno: int | str, field: str, key: str, value) -> str:
    """A row's field as text: a string as it is, null as empty text. Anything else is an error:
    its str() would be trained on as Python's repr (a chat-style "messages" list as
    "[{'role': ...}]"), and a string holding a lone UTF-16 surrogate (JSON's "\\ud83d", half an
    emoji, in scraped data) fails inside the tokenizer with no file or line named."""
    at = f":{lineno}" if isinstance(lineno, int) else lineno   # a line (":7"), or "[k]" in an array
    if value is None:
        return ""
    if not isinstance(value, str):
        what = _JSON_TYPES.get(type(value), type(value).__name__)
        raise DataError(f"{path}{at}: field {field!r} is {what}, not a string; {key} must name a "
                        f"string field (chat-style message lists: data.messages_field names their field)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{path}{at}: field {field!r} holds a lone UTF-16 surrogate "
                        f"({value[e.start]!r} at character {e.start}), not valid Unicode text; fix or "
                        f"drop the row") from None
    return value


def _chat_hint(obj) -> str:
    """For a chat-style row (a "messages" list), which data.text_field cannot name as text."""
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        return "; this is a chat row ('messages'): set data.messages_field=messages"
    return ""


def _starts_with_array(path: Path) -> bool:
    """The file's first non-blank character is '[' (a JSON array, not JSON lines)."""
    with path.open("rb") as f:
        first = True
        while chunk := f.read(4096):
            if first and chunk.startswith(_BOM):
                chunk = chunk[len(_BOM):]
            first = False
            head = chunk.lstrip()
            if head:
                return head[:1] == b"["
    return False


_BOM = b"\xef\xbb\xbf"   # a UTF-8 byte-order mark (Windows editors write one): not part of the JSON


def _json_objects(path: Path) -> Iterator[tuple[str, object]]:
    """(where, row) for each row of a JSONL file, `where` being ":LINE" (or "[k]" for the k-th row
    of a file that holds one JSON array, what `json.dump(rows, f)` writes, a `.json` export). Lines
    are decoded one by one so a bad byte is reported with its line; blank lines are skipped."""
    if _starts_with_array(path):
        try:
            rows = json.loads(path.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        except RecursionError:   # (a traceback: review)
            raise DataError(f"{path}: not usable JSON (nested too deeply)") from None
        for k, obj in enumerate(rows):
            yield f"[{k}]", obj
        return
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(_BOM):   # ("Unexpected UTF-8 BOM": a review)
                raw = raw[len(_BOM):]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of the "
                                f"line)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                hint = ""
                if lineno == 1 and line.strip() == "{":   # one pretty-printed object, not JSON lines
                    hint = ("; a .json/.jsonl file holds one JSON object per line, or one JSON array of "
                            "rows, not one object spread over lines")
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}){hint}") from None
            except RecursionError:   # (a traceback: review)
                raise DataError(f"{path}:{lineno}: not usable JSON (nested too deeply)") from None
            yield f":{lineno}", obj


def _jsonl_rows(path: Path, fields: dict[str, str]) -> Iterator[tuple[str, ...]]:
    """The values of `fields` (field -> the config key that names it) in each row of a JSONL file
    (`_json_objects`); a null value reads as empty text, a value that is not a string is an error
    (`_field_text`)."""
    for where, obj in _json_objects(path):
        for field, key in fields.items():
            if not isinstance(obj, dict) or field not in obj:
                raise DataError(f"{path}{where}: no {field!r} field (set {key})" + _chat_hint(obj))
        yield tuple(_field_text(path, where, field, key, obj[field]) for field, key in fields.items())


def _write_cache(cache_path: Path, data: dict[str, torch.Tensor]) -> None:
    """Write the token cache atomically; a dir that cannot take it (a file in the way, a full
    disk) is a warning, as for planner.cache_dir: the cache only saves time (it was a traceback)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tmp = cache_path.with_name(f".{cache_path.name}.{os.getpid()}.tmp")  # ranks may race
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        save_file(data, str(tmp), metadata={"sha256": _streams_digest(data)})
        share_like_umask(tmp)   # safetensors writes its files 0600 (storage/filemode.py)
        tmp.replace(cache_path)
    except (OSError, SafetensorError) as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        log.warning("data.cache_dir: the tokens were not cached in %s (%s); training goes on without "
                    "the cache", cache_path.parent, getattr(e, "strerror", None) or e)


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of one file: a text file is one document; JSONL gives one per line (`text_field`)."""
    if is_jsonl(path):
        for (text,) in _jsonl_rows(path, {text_field: "data.text_field"}):
            yield text
    else:
        try:
            yield path.read_text(encoding="utf-8-sig")   # (a BOM was 3 trained tokens, as JSONL strips it)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_pairs(path: Path, prompt_field: str, text_field: str) -> Iterator[tuple[str, str]]:
    """(prompt, completion) rows of one JSONL file."""
    if not is_jsonl(path):
        raise DataError(f"{path}: prompt/completion data (data.prompt_field={prompt_field!r}) must be "
                        f"JSONL with {prompt_field!r} and {text_field!r} fields")
    if prompt_field == text_field:
        raise DataError(f"data.prompt_field and data.text_field are both {text_field!r}; the completion "
                        f"needs its own field")
    yield from _jsonl_rows(path, {prompt_field: "data.prompt_field", text_field: "data.text_field"})


def tokenize_pairs(files: Sequence[Path], tokenizer, prompt_field: str,
                   text_field: str = "text", bos: int | None = None,
                   row_lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt/completion rows as one token stream and a bool mask of the tokens to learn; `bos`:
    a token put before each row (not learned); EOS after each completion unless it ends with one
    (text rendered with its EOS string got a second one: review). Each row's length is appended
    to `row_lengths` when given (PackedDataset packs rows whole)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token; documents cannot be separated")
    ids: list[int] = []
    learn: list[bool] = []
    empty = 0
    for path in files:
        for prompt, completion in read_pairs(path, prompt_field, text_field):
            if not completion.strip():
                empty += 1
                continue
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
            c = tokenizer(completion, add_special_tokens=False)["input_ids"]
            if c[-1:] != [eos]:
                c.append(eos)
            if bos is not None and (p or c)[:1] != [bos]:   # (a prompt rendered by a chat template has one)
                p = [bos] + p
            ids += p + c
            learn += [False] * len(p) + [True] * len(c)
            if row_lengths is not None:
                row_lengths.append(len(p) + len(c))
    if empty:   # (dropped without a word before: review)
        log.warning("skipped %d prompt/completion row(s) whose completion is empty (nothing to learn)", empty)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(learn, dtype=torch.bool)


# what an assistant message may carry instead of content (a tool call; a template's reasoning field)
ASSISTANT_PAYLOAD_KEYS = ("tool_calls", "function_call", "reasoning_content", "reasoning", "thinking")


def read_chats(path: Path, messages_field: str) -> Iterator[tuple[str, list[dict]]]:
    """(where, messages) for each chat row of a JSONL file: `messages_field` holds a list of
    message objects, each with a string "role" and a string (or null) "content"; other keys
    (tool calls, names) are passed to the chat template as they are. An assistant message must
    carry something to learn: content, or one of ASSISTANT_PAYLOAD_KEYS."""
    if not is_jsonl(path):
        raise DataError(f"{path}: chat data (data.messages_field={messages_field!r}) must be JSONL rows "
                        f"with a {messages_field!r} list")
    for where, obj in _json_objects(path):
        if not isinstance(obj, dict) or messages_field not in obj:
            raise DataError(f"{path}{where}: no {messages_field!r} field (set data.messages_field)")
        msgs = obj[messages_field]
        if not isinstance(msgs, list):
            what = _JSON_TYPES.get(type(msgs), type(msgs).__name__)
            raise DataError(f"{path}{where}: field {messages_field!r} is {what}, not a list of messages")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise DataError(f"{path}{where}: message {j} is not an object with a string 'role' "
                                f"(chat rows are lists of {{\"role\": ..., \"content\": ...}})")
            c = m.get("content")
            if c is not None and not isinstance(c, str):
                what = _JSON_TYPES.get(type(c), type(c).__name__)
                raise DataError(f"{path}{where}: message {j}'s content is {what}, not a string (content "
                                f"parts, e.g. images, are not supported: join text parts into one string)")
            if c is not None:   # a lone UTF-16 surrogate is an error naming the row
                _field_text(path, f"{where} message {j}", "content", "data.messages_field", c)
            if (bad := _bad_string(m)) is not None:   # in any other key the template renders
                raise DataError(f"{path}{where}: message {j}'s {bad} holds a lone UTF-16 surrogate, not "
                                f"valid Unicode text; fix or drop the row")
            if m["role"] == "assistant" and not c and not any(m.get(k) for k in ASSISTANT_PAYLOAD_KEYS):
                # (a misspelt key, {"role": "assistant", "text": ...}, rendered as an empty answer:
                # only the end-of-turn tokens learned, a file of them teaching every turn to stop
                # at once, without a word; review)
                keys = ", ".join(sorted(m))
                raise DataError(f"{path}{where}: message {j} is an assistant turn with "
                                f"{'an empty' if 'content' in m else 'no'} 'content' (its keys: {keys}) and no "
                                f"tool_calls: nothing to learn from it; fix or drop the row")
        yield where, msgs


# Templates that print today's date (Llama-3.2/3.3-Instruct: "Today Date: ..." in every system
# header) render with this one: with the clock's, the same rows tokenized on another day were other
# data, and a run stopped one day was refused as trained on other data the next (review). It is the
# date Llama's templates fall back to when no clock is given.
PINNED_CHAT_DATE = datetime.datetime(2024, 7, 26)


class _PinnedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(*PINNED_CHAT_DATE.timetuple()[:6], tzinfo=tz)


@contextlib.contextmanager
def _pinned_clock():
    """transformers' chat templates read the clock through their `strftime_now` global, which
    calls its module's `datetime.now()` (render arguments cannot replace it: they are reduced to
    plain JSON data); that name is swapped for the render. Without the module attribute (another
    transformers) the clock is left alone."""
    try:
        from transformers.utils import chat_template_utils as ctu
    except ImportError:
        yield
        return
    was = getattr(ctu, "datetime", None)
    if not (isinstance(was, type) and issubclass(was, datetime.datetime)):
        yield
        return
    ctu.datetime = _PinnedDatetime
    try:
        yield
    finally:
        ctu.datetime = was


def _bad_string(obj, at: str = "") -> str | None:
    """Where in a JSON value a string holds a lone UTF-16 surrogate ('tool_calls[0].arguments'),
    or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return at or "the value"
        return None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if (where := _bad_string(v, f"{at}[{k}]" if isinstance(k, int) else f"{at}.{k}" if at else str(k))):
            return where
    return None


def _common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tokenize_chats(files: Sequence[Path], tokenizer, messages_field: str,
                   row_lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat rows rendered with the tokenizer's chat template, as one token stream and a bool mask
    of the tokens to learn: each assistant message's tokens, from the end of the generation prompt
    before it (`add_generation_prompt=True` on the messages before it) to the end of its rendering
    (its content and the template's end-of-turn tokens). System, user and tool messages and the
    template's framing get label -100.

    The spans are found by rendering each conversation's prefixes, which must render as prefixes
    of the whole conversation, in text and in tokens; a template that rewrites earlier turns
    (Qwen3's drops their reasoning) is refused for that row, with what to do. Conversations are
    packed as rendered (the template frames each one; no EOS is added); rows without an assistant
    message teach nothing and are skipped. Each row's length is appended to `row_lengths` when
    given (PackedDataset packs rows whole)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template (chat_template in tokenizer_config.json); "
                        "set data.chat_template=FILE (a Jinja chat template) or use an instruct model's "
                        "tokenizer")

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids: list[int] = []
    learn: list[bool] = []
    skipped = 0
    for path in files:
        for where, msgs in read_chats(path, messages_field):
            turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
            if not turns:
                skipped += 1
                continue

            def render(upto: int, generation_prompt: bool) -> str:
                try:
                    with _pinned_clock():
                        out = tokenizer.apply_chat_template(msgs[:upto], tokenize=False,
                                                            add_generation_prompt=generation_prompt)
                except Exception as e:  # noqa: BLE001 - jinja's raise_exception and template bugs
                    raise DataError(f"{path}{where}: the chat template refused the conversation "
                                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
                if not isinstance(out, str):
                    raise DataError(f"{path}{where}: the chat template rendered {type(out).__name__}, not text")
                return out

            full = render(len(msgs), False)
            row = enc(full)
            mask = [False] * len(row)
            for i in turns:
                before, through = render(i, True), render(i + 1, False)
                content = msgs[i].get("content") or ""
                if not full.startswith(before):
                    # a generation prompt that a rendered turn does not repeat (DeepSeek-R1's opens
                    # "<think>\n", its past turns render "<｜Assistant｜>" + content: every row was
                    # refused, review): the turn starts where the two part, after the messages before it
                    plain = render(i, False)
                    common = _common_prefix(before, full)
                    for shown in dict.fromkeys((content, content.strip(), content.split("</think>")[-1].strip())):
                        at = through.find(shown, len(plain)) if shown else -1
                        if at >= 0:   # (never into the content: an answer starting "<" shares
                            common = min(common, at)   # "<" with "<think>": review)
                            break
                    if full.startswith(plain) and through.startswith(plain) and common >= len(plain):
                        before = full[:common]
                # The turn ends where its rendering stops agreeing with the whole conversation's (a
                # template may close a conversation after its last message, as Phi-3 adds EOS,
                # which a later turn does not follow), at least past its content.
                agree = _common_prefix(through, full)
                # the content as the template renders it: as it is, trimmed (Llama-3's, Gemma's
                # `| trim`), or after its reasoning (DeepSeek-R1 renders content.split('</think>')[-1])
                shown, at = content, -1
                for shown in dict.fromkeys((content, content.strip(), content.split("</think>")[-1].strip())):
                    at = full.find(shown, len(before), agree)
                    if at >= 0:
                        break
                if not (through.startswith(before) and full.startswith(before) and at >= 0):
                    raise DataError(
                        f"{path}{where}: the chat template renders message {i} (assistant) differently "
                        f"once later messages follow it (templates that drop earlier turns' reasoning "
                        f"do this) or than its generation prompt begins it, so its tokens cannot be "
                        f"marked; put one assistant turn per row, or set data.chat_template=FILE to a "
                        f"template that renders earlier turns unchanged")
                a, c, t = enc(before), enc(full[:at + len(shown)]), enc(through)
                if row[:len(a)] != a or row[:len(c)] != c or t[:len(c)] != c:
                    raise DataError(
                        f"{path}{where}: message {i} (assistant) does not start or end on a token "
                        f"boundary of the rendered conversation (the template joins it to its "
                        f"neighbours without a special token); set data.chat_template=FILE to a template "
                        f"that separates turns with special tokens")
                end = len(c) + _common_prefix(t[len(c):], row[len(c):])
                mask[len(a):end] = [True] * (end - len(a))
            ids += row
            learn += mask
            if row_lengths is not None:
                row_lengths.append(len(row))
    if skipped:
        log.warning("skipped %d chat row(s) without an assistant message (nothing to learn)", skipped)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(learn, dtype=torch.bool)


def bos_for(tokenizer, add_bos: bool | str = "auto") -> int | None:
    """The token to put before each document (data.add_bos), or None. "auto": the tokenizer's BOS
    if it adds one itself when encoding text (Llama, Mistral, Gemma: what the model sees at
    inference), else none (GPT-2 and Qwen style tokenizers, the built-in demo one)."""
    if isinstance(add_bos, str):
        v = add_bos.strip().lower()
        if v not in ("auto", "true", "false"):
            raise DataError(f"data.add_bos={add_bos!r}: use auto, true or false")
        add_bos = v if v == "auto" else v == "true"
    bos = tokenizer.bos_token_id
    if add_bos == "auto":
        return bos if bos is not None and tokenizer("a")["input_ids"][:1] == [bos] else None
    if add_bos and bos is None:
        raise DataError("data.add_bos=true, but the tokenizer has no bos_token; set data.add_bos=false")
    return bos if add_bos else None


_RUN_LIMIT = 4096   # whitespace around a candidate cut scanned and tokenized at most (each side)


def _exact_cut(tokenizer, doc: str, start: int, end: int, tries: int = 4,
               window: int = 256) -> int | None:
    """A cut just after one of the last `tries` line breaks in doc[start:end] (the latest that
    leaves the document's tokens unchanged), or None.

    Whether a cut is exact is checked, not assumed: tokenizing a window around it whole must give
    the tokens of its two halves. Byte-level BPE (Llama-3, Qwen) merges runs like "\\n\\n   " across
    a line break, and SentencePiece-style tokenizers prefix every input with "▁"."""
    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    nl = end
    for _ in range(tries):
        nl = doc.rfind("\n", start, nl)
        if nl < 0:
            return None
        cut = nl + 1
        # the window reaches past the whitespace run the cut is in (BPE merges whole runs: inside a
        # run longer than the window the check passed where the document's tokens differ: review)
        lo, hi = cut, cut
        while lo > start and doc[lo - 1].isspace() and cut - lo <= _RUN_LIMIT:
            lo -= 1
        while hi < len(doc) and doc[hi].isspace() and hi - cut <= _RUN_LIMIT:
            hi += 1
        if cut - lo > _RUN_LIMIT or hi - cut > _RUN_LIMIT:
            continue   # (a run this long is not checked at all, cheaply: no cut in it; review)
        a, b = max(start, lo - window), min(len(doc), hi + window)
        if enc(doc[a:cut]) + enc(doc[cut:b]) == enc(doc[a:b]):
            return cut
    return None


def _pieces(tokenizer, doc: str, chunk_chars: int) -> Iterator[str]:
    """`doc` in pieces of about `chunk_chars` characters, so the fast tokenizer works on bounded
    inputs, whose tokens together are the document's. Where no exact cut is found the piece grows
    by another `chunk_chars` (a tokenizer no cut suits gets the document whole)."""
    start, limit = 0, chunk_chars
    while start + limit < len(doc):
        cut = _exact_cut(tokenizer, doc, start, start + limit)
        if cut is None:
            limit += chunk_chars
        else:
            yield doc[start:cut]
            start, limit = cut, chunk_chars
    yield doc[start:]


def tokenize_files(files: Sequence[Path], tokenizer, text_field: str = "text",
                   chunk_chars: int = 1 << 16, bos: int | None = None,
                   docs: list[int] | None = None) -> torch.Tensor:
    """All documents as one 1-D int64 token stream, EOS after each document (unless it ends with
    one) and `bos`, when given, before it; `docs`, when given, receives each document's length in
    tokens (where documents begin: not where an EOS is, which may also be a tokenizer's BOS or
    appear inside a text)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token; documents cannot be separated")
    ids: list[int] = []
    for path in files:
        for doc in read_documents(path, text_field):
            if not doc.strip():
                continue
            start = len(ids)
            for piece in _pieces(tokenizer, doc, chunk_chars):
                ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
            if bos is not None and ids[start:start + 1] != [bos]:   # (text that starts with it has one)
                ids.insert(start, bos)
            if ids[-1:] != [eos] or len(ids) == start:   # (text that ends with it has one: review)
                ids.append(eos)
            if docs is not None:
                docs.append(len(ids) - start)
    return torch.tensor(ids, dtype=torch.long)


def _pack_rows(tokens: torch.Tensor, learn: torch.Tensor, rows: torch.Tensor, seq_len: int,
               pad_id: int, pack: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked rows (prompt/completion, chat) packed whole into `seq_len` windows: rows in order
    fill a window while they fit (next fit); the rest of it is `pad_id` tokens, not learned (at a
    window's end, where no token attends to them). A row longer than `seq_len` starts a window and
    runs on through the next ones, each beginning with the previous one's last token as context
    (not learned again: a window's first token is no target, the model shifting the labels), so
    every learned token is a target once (said: those past the first window are trained without
    the row's beginning in view). Cut at fixed window edges instead, a completion that crossed
    one was trained in the next window without its prompt, after other rows' tokens (14% of the
    learned tokens at seq_len 512 in a review's SFT set, 94% at 48).

    Each piece of a row gets position ids 0, 1, ... of its own, and so does a window's padding:
    passed to the model, they make transformers attend each row only to itself (its packed-sequence
    mask, as for TRL's padding-free batches / DataCollatorWithFlattening) and place its rotary
    positions as if it were alone. No row's first token is learned (as the target of the row
    before it, which it cannot see). `pack=False`: one row per window (for models that cannot keep
    packed rows apart: spec.generic.packed_rows_problem). Returns the windows as one stream, its
    learn mask and its position ids (int32), `seq_len` tokens each."""
    src, dst, size = [], [], []   # pieces: source start, destination start, length
    windows = fill = acc = 0
    long_rows = later = 0
    for n in rows.tolist():
        if windows == 0 or fill + n > seq_len or (not pack and fill):   # (a longer row always starts one)
            windows, fill = windows + 1, 0
        at = 0
        while True:
            k = min(n - at, seq_len - fill)
            src.append(acc + at)
            dst.append((windows - 1) * seq_len + fill)
            size.append(k)
            fill += k
            if at + k >= n:
                break
            at += k - 1   # the next window starts with this one's last token
            windows, fill = windows + 1, 0
        if n > seq_len:
            long_rows += 1
            later += int(learn[acc + seq_len:acc + n].sum())
        acc += n
    k = torch.tensor(size, dtype=torch.long)
    dst_t = torch.tensor(dst, dtype=torch.long)
    total = int(k.sum())
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(k, 0) - k, k)
    s_idx = torch.repeat_interleave(torch.tensor(src, dtype=torch.long), k) + within
    d_idx = torch.repeat_interleave(dst_t, k) + within
    out = torch.full((windows * seq_len,), pad_id, dtype=tokens.dtype)
    mask = torch.zeros(windows * seq_len, dtype=torch.bool)
    out[d_idx], mask[d_idx] = tokens[s_idx], learn[s_idx]
    # positions: the index within each piece; in each window's padding, from 0 after its last piece
    pos = torch.arange(windows * seq_len, dtype=torch.int32) % seq_len
    ends = torch.zeros(windows, dtype=torch.long)   # where each window's padding starts
    ends.scatter_reduce_(0, dst_t // seq_len, dst_t % seq_len + k, reduce="amax")
    pos -= torch.repeat_interleave(ends, seq_len).to(torch.int32)
    pos[d_idx] = within.to(torch.int32)
    # A piece's first token is no target: a continuation's context token (learned in the window
    # before), and a row's first token, which would be the target of the row before it, where it
    # cannot see it (a learned first token: an empty prompt without BOS; review)
    mask[d_idx[within == 0]] = False
    if long_rows:
        log.warning("%d of %d rows are longer than job.seq_len=%d: each runs on into the next sequences, "
                    "whose %d learned tokens are trained without the row's beginning in view; raise "
                    "job.seq_len to train them whole", long_rows, rows.numel(), seq_len, later)
    if windows:
        log.info("packed %d rows whole into %d sequences of %d tokens (%.1f%% padding)", rows.numel(), windows,
                 seq_len, 100.0 * (1 - total / (windows * seq_len)))
    return out, mask, pos


def _document_positions(docs: torch.Tensor, n: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the first `n` sequences of `seq_len` tokens of a stream of documents of lengths `docs`:
    position ids (int32) restarting at 0 where each document begins and with each sequence, and
    which tokens are learned: all but a document's first token after another's end in the same
    sequence (the target of the other document's last token, which cannot see it)."""
    starts = torch.zeros(n * seq_len, dtype=torch.bool)
    at = torch.cumsum(docs, 0) - docs
    starts[at[at < n * seq_len]] = True
    starts = starts.view(n, seq_len)
    starts[:, 0] = True   # (and a sequence's first token is no target anyway: the shift)
    idx = torch.arange(seq_len).expand(n, seq_len)
    last = torch.cummax(torch.where(starts, idx, 0), dim=1).values
    learn = ~starts
    learn[:, 0] = True
    return (idx - last).to(torch.int32), learn


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor   # [B, S] int64
    labels: torch.Tensor      # [B, S] int64 (input_ids, -100 where not learned; the model shifts)
    # [B, S] int64 restarting at 0 with each packed row (each attends only to itself), or None
    # (text: one stream, positions 0..S-1, every token attending to all before it)
    position_ids: torch.Tensor | None = None

    def micro_batch(self) -> tuple[torch.Tensor, ...]:
        """What the engines' train_step takes: (input_ids, labels[, position_ids])."""
        return (self.input_ids, self.labels) if self.position_ids is None else \
            (self.input_ids, self.labels, self.position_ids)


class PackedDataset:
    """Fixed-length sequences cut from one token stream, visited in a seeded, resumable order.

    `learn`: optional bool stream (same length as `tokens`) of the tokens to learn; the others get
    label -100. Sequences with no learned target (positions 1.. after the model's shift) are dropped.
    `rows`: optional lengths of the stream's rows (prompt/completion or chat rows, in order): each
    row is then packed whole where it fits a sequence, never split between two, and its batches
    carry position ids that keep each row's attention to itself (`_pack_rows`); `pack=False`: one
    row per sequence (then no position ids: nothing to keep apart).
    `docs`: the lengths of a text stream's documents (no `rows`): every document then attends
    only to itself within a sequence (position ids restarting where each begins, as Megatron's
    reset_position_ids/reset_attention_mask), and a document's first token is not learned from
    the one before it (`_document_positions`).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0,
                 learn: torch.Tensor | None = None, rows: torch.Tensor | None = None, pad_id: int = 0,
                 pack: bool = True, docs: torch.Tensor | None = None) -> None:
        if seq_len < 2:   # (1 left no target after the shift: NaN losses; review)
            raise DataError(f"seq_len must be >= 2 (a token to predict the next from), got {seq_len}")
        positions = None
        if rows is not None:
            if learn is None or int(rows.sum()) != tokens.numel():
                raise DataError("the row lengths do not add up to the token stream (or no learn mask)")
            tokens, learn, positions = _pack_rows(tokens, learn, rows, seq_len, pad_id, pack)
            positions = positions if pack else None
        n = tokens.numel() // seq_len
        if n == 0:
            raise DataError(f"the data holds {tokens.numel()} tokens, fewer than one sequence of "
                            f"seq_len={seq_len}; add data or lower job.seq_len")
        self.seq_len = seq_len
        self.seed = seed
        # the stream's end, short of a whole sequence, is not used (reported with an evaluation)
        self.tail_tokens = tokens.numel() - n * seq_len
        if docs is not None and rows is None:
            if learn is not None or int(docs.sum()) != tokens.numel():
                raise DataError("the document lengths do not add up to the token stream (or it has a learn mask)")
            positions, learn = (t.view(-1) for t in _document_positions(docs, n, seq_len))
            tokens = tokens[: n * seq_len]
        self.files: tuple[Path, ...] = ()   # what it was read from (build_dataset sets it)
        self.sequences = tokens[: n * seq_len].view(n, seq_len)  # [N, S]
        self.positions = None if positions is None else positions[: n * seq_len].view(n, seq_len)
        self.learn: torch.Tensor | None = None
        if learn is not None:
            if learn.shape != tokens.shape:
                raise DataError("the learn mask and the token stream differ in length")
            masks = learn[: n * seq_len].view(n, seq_len)
            keep = masks[:, 1:].any(dim=1)
            if not bool(keep.any()):
                raise DataError(f"no sequence of seq_len={seq_len} holds a completion token to learn "
                                f"(are the prompts longer than job.seq_len?)")
            self.sequences, self.learn = self.sequences[keep], masks[keep]
            if self.positions is not None:
                self.positions = self.positions[keep]
        self._reset_order()

    def _reset_order(self) -> None:
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def fingerprint(self) -> str:
        """A hash of the sequences (and which of their tokens are learned): what a checkpoint
        records so that a resume on other data is refused. It is taken of the tokens themselves,
        not of the files (`_cache_key`): the same tokens are the same data whatever the files are
        called or where they moved, and a library upgrade that leaves the tokens unchanged must not
        refuse a resume. Once per run: sha256 at 1.7-1.8 GB/s here, ~4.5 s per billion tokens."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for name, t in (("sequences", self.sequences), ("learn", self.learn), ("positions", self.positions)):
                if t is None:
                    continue
                h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
                h.update(t.contiguous().numpy())   # (its buffer: no copy of the stream)
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    @property
    def num_tokens(self) -> int:
        return self.sequences.numel()

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self), generator=g), epoch
        return self._perm

    def _index(self, position: int) -> int:
        epoch, i = divmod(position, len(self))
        return int(self._order(epoch)[i])

    def sequence_at(self, position: int) -> torch.Tensor:
        """The sequence consumed at stream position `position` (0-based, across epochs)."""
        return self.sequences[self._index(position)]

    def batch(self, position: int, batch_size: int) -> Batch:
        """`batch_size` consecutive sequences starting at `position`."""
        idx = [self._index(position + b) for b in range(batch_size)]
        return self._batch_of(self.sequences[idx], *(None if t is None else t[idx] for t in (self.learn, self.positions)))

    @staticmethod
    def _batch_of(x: torch.Tensor, learn: torch.Tensor | None, positions: torch.Tensor | None = None) -> Batch:
        """Input ids and labels of sequences `x` (-100 where `learn` is False), and their position ids."""
        labels = x.clone() if learn is None else torch.where(learn, x, torch.full_like(x, -100))
        return Batch(input_ids=x, labels=labels, position_ids=None if positions is None else positions.long())

    @classmethod
    def _of(cls, sequences: torch.Tensor, learn: torch.Tensor | None, seed: int,
            positions: torch.Tensor | None = None) -> "PackedDataset":
        """A dataset of these (already packed and filtered) sequences."""
        ds = cls.__new__(cls)
        ds.seq_len, ds.seed, ds.sequences, ds.learn = sequences.shape[1], seed, sequences, learn
        ds.positions = positions
        ds.tail_tokens, ds.files = 0, ()
        ds._reset_order()
        return ds

    def split_off(self, fraction: float) -> tuple["PackedDataset", "PackedDataset"]:
        """(train, held out): the last `fraction` of the sequences (at least one), in stream order,
        i.e. the end of the last files, held out of training (data.eval_fraction)."""
        n = len(self)
        k = max(1, round(n * fraction))
        if k >= n:
            raise DataError(f"data.eval_fraction={fraction} of {n} sequence(s) of seq_len={self.seq_len} "
                            f"leaves none to train on; add data or lower it")
        learn = (None, None) if self.learn is None else (self.learn[: n - k], self.learn[n - k:])
        pos = (None, None) if self.positions is None else (self.positions[: n - k], self.positions[n - k:])
        return (PackedDataset._of(self.sequences[: n - k], learn[0], self.seed, pos[0]),
                PackedDataset._of(self.sequences[n - k:], learn[1], self.seed, pos[1]))

    def ordered_batches(self, batch_size: int, limit: int | None = None) -> Iterator[Batch]:
        """Batches of the sequences in stream order (evaluation: the same batches every time; the
        last may be shorter), at most `limit` of them."""
        for k, start in enumerate(range(0, len(self), batch_size)):
            if limit is not None and k >= limit:
                return
            yield self._batch_of(self.sequences[start:start + batch_size],
                                 *(None if t is None else t[start:start + batch_size]
                                   for t in (self.learn, self.positions)))

    def step_batches(self, position: int, batch_size: int, grad_accum: int) -> tuple[list[Batch], int]:
        """The micro-batches of one optimizer step and the position after it."""
        out = []
        for _ in range(grad_accum):
            out.append(self.batch(position, batch_size))
            position += batch_size
        return out, position


def _tokenizer_files(tokenizer) -> list[tuple[str, bytes]]:
    """What `save_pretrained` writes: the full serialisation (a fast tokenizer's tokenizer.json, a
    slow one's vocabulary/model files) and its config (special and added tokens, flags). The
    vocabulary alone does not determine the tokens: Llama-3 base and instruct share one but end
    documents with different EOS tokens, and normalizers and pre-tokenizers change them too."""
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        return [(str(f.relative_to(d)), f.read_bytes())
                for f in sorted(Path(d).rglob("*")) if f.is_file()]


def _cache_key(paths: Sequence[Path], tokenizer, text_field: str, prompt_field: str | None,
               messages_field: str | None = None, bos: int | None = None) -> str:
    """A hash of everything the cached tokens depend on, every part length-prefixed so that moving
    bytes between parts (text from one file to the next, which moves an EOS) changes it. Each file
    counts by its parse mode and bytes, not its path, so a moved corpus keeps its cache; the
    library versions count because tokenizer fixes change tokens."""
    import tokenizers
    import transformers

    h = hashlib.sha256()

    def put(b: bytes) -> None:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    # v3: keyed by the whole tokenizer and per-file framing; v4: text that starts with the BOS
    # string gets no second BOS (data.add_bos, 2026-12-01): such documents' tokens changed
    # v5: a text file's BOM is no longer tokenized (2026-12-01)
    # v6: no second EOS after text ending with one; row lengths (2026-12-02); v7: text documents'
    # lengths (data.doc_mask, 2026-12-02)
    put(b"lazytrain-tokens-v7")
    put(f"transformers {transformers.__version__} tokenizers {tokenizers.__version__}".encode())
    for name, content in _tokenizer_files(tokenizer):
        put(name.encode())
        put(content)
    # (the chat template is part of the tokenizer's files)
    put(json.dumps([tokenizer.eos_token_id, text_field, prompt_field, messages_field, bos]).encode())
    if messages_field:   # chats render with the pinned date (2026-12-01; the clock's before)
        put(f"chat date {PINNED_CHAT_DATE:%Y-%m-%d}".encode())
    for p in paths:
        put(b"jsonl" if is_jsonl(p) else b"text")
        put(p.read_bytes())
    return h.hexdigest()[:16]


def _streams_digest(data: dict[str, torch.Tensor]) -> str:
    """sha256 over the streams' names, dtypes and bytes (stored with a cache entry, checked on read)."""
    h = hashlib.sha256()
    for name in sorted(data):
        t = data[name].contiguous()
        h.update(f"{name}:{t.dtype}:{t.numel()};".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def _read_cache(path: Path, names: set[str]) -> dict[str, torch.Tensor] | None:
    """The cached streams, or None (a miss) if there are none or they are unreadable: a damaged
    entry is removed and re-tokenized rather than failing the run. Damage includes changed token
    values (their sha256 is stored with the entry): they crashed the embedding (ids out of range)
    or trained on, and a resume was refused as "other data"."""
    if not path.is_file():
        return None
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            want = (f.metadata() or {}).get("sha256")
        data = load_file(str(path))
        if set(data) != names or any(t.dim() != 1 or (k not in ("rows", "docs") and t.shape != data["tokens"].shape)
                                     for k, t in data.items()):
            raise ValueError(f"holds {sorted(data)}, not the 1-D streams {sorted(names)}")
        for k in ("rows", "docs"):
            if k in data and int(data[k].sum()) != data["tokens"].numel():
                raise ValueError(f"its {'row' if k == 'rows' else 'document'} lengths do not add up to its tokens")
        if want is None:
            raise ValueError("no checksum (written by an older lazytrain)")
        if _streams_digest(data) != want:
            raise ValueError("its tokens do not match their checksum")
    except (SafetensorError, OSError, ValueError) as e:
        log.warning("ignoring corrupt token cache %s (%s); re-tokenizing", path, e)
        path.unlink(missing_ok=True)
        return None
    return data


def build_dataset(files: Sequence[str | Path], tokenizer, seq_len: int, seed: int = 0,
                  text_field: str = "text", cache_dir: str | Path | None = None,
                  prompt_field: str | None = None, messages_field: str | None = None,
                  add_bos: bool | str = "auto", pack_rows: bool = True, doc_mask: bool = False) -> PackedDataset:
    """Tokenize (or load the cached tokens of) `files` and pack them into `seq_len` sequences.

    `prompt_field`: JSONL prompt/completion rows, learning only the completions (module doc).
    `messages_field`: JSONL chat rows, learning only the assistant messages (`tokenize_chats`).
    `add_bos`: put the tokenizer's BOS before each text document or prompt/completion row: True,
    False, or "auto" (as the tokenizer does itself, `bos_for`); chat rows get theirs from the template.
    `cache_dir`: the token streams are cached there as safetensors, keyed by `_cache_key`.
    `pack_rows`: several prompt/completion or chat rows to a sequence, each attending only to
    itself (False: one row per sequence, for a model that cannot keep them apart).
    `doc_mask`: text documents packed into one sequence each attend only to themselves (position
    ids restarting where each document begins; PackedDataset's docs).
    """
    if prompt_field and messages_field:
        raise DataError(f"data.prompt_field={prompt_field!r} and data.messages_field={messages_field!r} are "
                        f"both set: rows are either prompt/completion pairs or chats; unset one")
    paths = expand_files(files)
    bos = bos_for(tokenizer, add_bos)   # (checked for chat rows too, which take theirs from the template)
    bos = None if messages_field else bos
    masked = bool(prompt_field or messages_field)
    data = None
    cache_path = None
    if cache_dir is not None:
        key = _cache_key(paths, tokenizer, text_field, prompt_field, messages_field, bos)
        cache_path = Path(cache_dir) / f"tokens-{key}.safetensors"
        data = _read_cache(cache_path, {"tokens", "learn", "rows"} if masked else {"tokens", "docs"})
    if data is None:
        rows: list[int] = []
        if messages_field:
            tokens, learn = tokenize_chats(paths, tokenizer, messages_field, rows)
            data = {"tokens": tokens, "learn": learn, "rows": torch.tensor(rows, dtype=torch.long)}
        elif prompt_field:
            tokens, learn = tokenize_pairs(paths, tokenizer, prompt_field, text_field, bos, rows)
            data = {"tokens": tokens, "learn": learn, "rows": torch.tensor(rows, dtype=torch.long)}
        else:
            docs: list[int] = []
            data = {"tokens": tokenize_files(paths, tokenizer, text_field, bos=bos, docs=docs),
                    "docs": torch.tensor(docs, dtype=torch.long)}
        if cache_path is not None:
            _write_cache(cache_path, data)
    tokens = data["tokens"]
    if tokens.numel() == 0 and messages_field:
        raise DataError(f"no chat row has an assistant message to learn (data.messages_field="
                        f"{messages_field!r}, files {', '.join(str(p) for p in paths[:3])}"
                        f"{', ...' if len(paths) > 3 else ''})")
    if tokens.numel() == 0:
        raise DataError(f"the data files ({', '.join(str(p) for p in paths[:3])}"
                        f"{', ...' if len(paths) > 3 else ''}) hold no text")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if doc_mask and masked:
        raise DataError("doc_mask is for text documents: prompt/completion and chat rows are kept apart "
                        "by pack_rows")
    ds = PackedDataset(tokens, seq_len, seed, learn=data.get("learn"), rows=data.get("rows"), pad_id=pad or 0,
                       pack=pack_rows, docs=data.get("docs") if doc_mask else None)
    ds.files = tuple(paths)
    return ds
