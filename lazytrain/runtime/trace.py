"""Trace of every transfer and compute, in the planner simulator's vocabulary, written as JSONL."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..storage.aligned_io import DiskIOError
from ..storage.atomic import keep_jsonl_rows

EVENT_KINDS = ("compute_fwd", "compute_bwd", "recompute", "h2d", "d2h", "nvme_read", "nvme_write",
               "optimizer")


RESUME_KIND = "resume"   # a marker outside any step (step -1): a resumed process's first step


class Trace:
    """Collects events (kind, layer, start_s, end_s, bytes, tier); `flush` appends them as JSONL."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self.t0 = time.perf_counter()
        # set by the executor: its n-th train_step in this process (from 0); -1 outside steps
        # (set-up, checkpoints), which comparisons with a plan leave out
        self.step = -1
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        # added to the steps written (`continue_run`): the run's steps before this process's
        self.step_offset = 0
        # The first flush starts the file anew, not the constructor: a resumed run, told after
        # the executor is built (`continue_run`), keeps the steps its earlier processes traced.
        self._fresh = True
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()

    def continue_run(self, steps_done: int) -> None:
        """Trace into the file of a run resumed after its step `steps_done`, not over it: its
        events of the steps before are kept (and those outside any step), those of later ones (run
        past the checkpoint by a killed process, and run again now) dropped, as metrics.jsonl
        drops their rows; this process's steps are written on from there (its step 0 as the run's
        `steps_done`). Every step keeps one number however many processes ran the run (the
        run's step - 1, 0-based like the executor's), which `lazytrain plan trace` relies on:
        per-process numbers would put the resumed steps under the earlier ones'."""
        if self.path is None:
            return
        self.step_offset = steps_done
        self._fresh = False
        keep_jsonl_rows(self.path, lambda ev: not isinstance(ev["step"], int) or ev["step"] < steps_done,
                        rows=False)
        # where this process begins: its first step is a warm-up too (`lazytrain plan trace`)
        with self._lock:
            self.events.append({"step": -1, "kind": RESUME_KIND, "layer": "", "start_s": 0.0, "end_s": 0.0,
                                "bytes": 0, "tier": "", "what": "", "first_step": steps_done})

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @contextmanager
    def at_step(self, step: int) -> Iterator[None]:
        """Events this thread adds inside are recorded under `step` (an update queued by one step
        may run while the next has begun)."""
        prev = getattr(self._local, "step", None)
        self._local.step = step
        try:
            yield
        finally:
            if prev is None:
                del self._local.step
            else:
                self._local.step = prev

    def current_step(self) -> int:
        """The step this thread's events are recorded under."""
        return getattr(self._local, "step", self.step)

    def add(self, kind: str, layer: str, start_s: float, end_s: float, nbytes: int = 0,
            tier: str = "device", what: str = "") -> None:
        """`what` a transfer moves, in the simulator's words: params | activation | grads |
        optimizer_state."""
        if self.path is None:
            return
        step = self.current_step()
        ev = {"step": step + self.step_offset if step >= 0 else step, "kind": kind, "layer": layer,
              "start_s": round(start_s, 6), "end_s": round(end_s, 6), "bytes": int(nbytes), "tier": tier,
              "what": what}
        with self._lock:
            self.events.append(ev)

    @contextmanager
    def span(self, kind: str, layer: str, nbytes: int = 0, tier: str = "device", what: str = "") -> Iterator[None]:
        t = self.now()
        try:
            yield
        finally:
            self.add(kind, layer, t, self.now(), nbytes, tier, what)

    def flush(self) -> None:
        if self.path is None:
            return
        with self._lock:
            evs, self.events = self.events, []
            mode, self._fresh = ("w" if self._fresh else "a"), False
        try:
            with self.path.open(mode) as f:
                for ev in evs:
                    f.write(json.dumps(ev) + "\n")
        except OSError as e:
            raise DiskIOError(e.errno, f"write trace {self.path}: {e.strerror}") from e
