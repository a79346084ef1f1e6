"""solver_cache/<input_hash>.json: a hit skips the solver; a corrupt entry is ignored (and
replaced by the re-solved plan)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from .plan import Plan

log = logging.getLogger(__name__)


class PlanCache:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory)

    def path(self, input_hash: str) -> Path:
        return self.dir / f"{input_hash}.json"

    def get(self, input_hash: str) -> Plan | None:
        p = self.path(input_hash)
        if not p.is_file():
            return None
        try:
            plan = Plan.from_json(p.read_text())
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            log.warning("ignoring corrupt plan cache entry %s (%s); re-solving", p, e)
            return None
        if plan.input_hash != input_hash:
            log.warning("ignoring plan cache entry %s: hash mismatch; re-solving", p)
            return None
        return plan

    def put(self, plan: Plan) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        p = self.path(plan.input_hash)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(plan.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        return p
