"""`lazytrain generate model.path=HF_DIR moe.store=STORE_DIR moe.cache_fraction=0.45 prompt="..."
max_new_tokens=64 [--json]`: greedy generation with MoE experts streamed from SSD.

Without --json: the text, then one stats line (hit rate, prefetch precision/recall, bytes, stalls,
speed, cache size). With --json: one object {"token_ids", "text", "stats"} (stats of the decode phase,
plus prefill_tokens, prefill_tokens_per_s, prefill_bytes).
"""

from __future__ import annotations

import json
import sys

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


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    as_json = "--json" in argv
    overrides = [a for a in argv if a != "--json"]
    from ..moe.cliutil import USER_ERRORS, compose, engine_kwargs, fail, whole_setting

    try:
        cfg = compose(overrides)
        if not cfg.moe.store:
            raise ValueError("generate streams MoE experts from a store: pass moe.store=STORE_DIR "
                             "(create it with `lazytrain moe convert model.path=HF_DIR out=STORE_DIR`)")
        from ..moe.api import generate

        prompt_ids = _prompt_ids(cfg.get("prompt_ids"))
        prompt = cfg.prompt
        if prompt is not None and not isinstance(prompt, str):
            # Hydra parsed it (prompt=123, prompt=true, prompt=1e3): the text as typed, not its value
            raw = next((a.split("=", 1)[1] for a in reversed(overrides)
                        if a.lstrip("+").startswith("prompt=")), None)
            prompt = raw if raw is not None and "${" not in raw else str(prompt)
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
