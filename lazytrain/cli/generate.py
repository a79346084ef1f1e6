"""`lazytrain generate model.path=HF_DIR moe.store=STORE_DIR moe.cache_fraction=0.45 prompt="..."
max_new_tokens=64 [--json]`: greedy generation with MoE experts streamed from SSD.

prompt=TEXT is the text as the shell passes it, spaces, brackets, quotes and `${...}` included (it
is not parsed as a Hydra override value; a value wholly inside one pair of matching quotes, Hydra's
own quoting, still loses that pair); prompt_file=PATH reads the prompt from a UTF-8 file as it is.

Without --json: the text, then one stats line (hit rate, prefetch precision/recall, bytes, stalls,
speed, cache size). With --json: one object {"token_ids", "text", "stats"} (stats of the decode phase,
plus prefill_tokens, prefill_tokens_per_s, prefill_bytes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

USAGE = __doc__


def _prompt_ids(v) -> list[int] | None:
    """prompt_ids=[1,2,3] as ints; ValueError for anything else (5 was a TypeError traceback,
    [a,b] "too many dimensions 'str'")."""
    from omegaconf import ListConfig

    if v is None:
        return None
    if not isinstance(v, (list, tuple, ListConfig)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in v):   # (the range: generate's)
        raise ValueError(f"prompt_ids must be a list of token ids (whole numbers), e.g. "
                         f"prompt_ids=[1,2,3]; got {v!r}")
    if not v:   # (an empty list: not the default prompt)
        raise ValueError("prompt_ids=[] is empty; give token ids, or prompt=TEXT")
    return [int(x) for x in v]


def _typed_prompt(raw: str) -> str:
    """prompt=TEXT's text: as typed, except that one pair of matching quotes around all of it
    (Hydra's quoting, which users of its grammar reach for) is taken as Hydra takes it."""
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            v = OverridesParser.create().parse_override("prompt=" + raw).value()
        except Exception:  # noqa: BLE001 - not one quoted string after all (e.g. 'a' 'b'): as typed
            return raw
        if isinstance(v, str):
            return v
    return raw


def _take_prompt(overrides: list[str]) -> tuple[list[str], str | None]:
    """The overrides without prompt=/prompt_file= (the text never goes through Hydra's grammar,
    which refused `def f(x):`, `it's` and `${HOME}` in lines naming its lexer or an interpolation,
    and dropped leading and trailing spaces: reviews), and the prompt they give (the last one wins;
    None: none given)."""
    rest, prompt = [], None
    for a in overrides:
        key, eq, raw = a.lstrip("+").partition("=")
        if eq and key == "prompt":
            prompt = _typed_prompt(raw)
        elif eq and key == "prompt_file":
            path = Path(raw).expanduser()
            try:
                prompt = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"prompt_file={raw}: cannot read it as UTF-8 text "
                                 f"({type(e).__name__}: {e})") from None
        else:
            rest.append(a)
    return rest, prompt


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    as_json = "--json" in argv
    overrides = [a for a in argv if a != "--json"]
    from ..moe.cliutil import USER_ERRORS, compose, engine_kwargs, fail, whole_setting

    try:
        overrides, typed = _take_prompt(overrides)
        cfg = compose(overrides)
        if not cfg.moe.store:
            raise ValueError("generate streams MoE experts from a store: pass moe.store=STORE_DIR "
                             "(create it with `lazytrain moe convert model.path=HF_DIR out=STORE_DIR`)")
        from ..moe.api import generate

        prompt_ids = _prompt_ids(cfg.get("prompt_ids"))
        if typed is not None and prompt_ids is not None:   # (the text was dropped without a word)
            raise ValueError("give prompt=TEXT (or prompt_file=PATH) or prompt_ids=[...], not both")
        prompt = cfg.get("prompt") if typed is None else typed   # (~prompt: none)
        if prompt is not None and not isinstance(prompt, str):   # (a config file's `prompt: 123`)
            prompt = str(prompt)
        res = generate(cfg.moe.store, prompt=prompt, prompt_ids=prompt_ids,
                       max_new_tokens=whole_setting("max_new_tokens", cfg.max_new_tokens, 1),
                       **engine_kwargs(cfg))
    except USER_ERRORS as e:
        return fail("generate", e)
    if as_json:
        print(json.dumps(res.to_json()))
    else:
        print(res.text if res.text is not None else res.token_ids)
        print(res.stats.line(), file=sys.stderr)
    return 0
