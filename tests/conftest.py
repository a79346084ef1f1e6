import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# measured specs are not kept on disk between test processes (tests stub parts of the measurement;
# tests/spec/test_spec_disk_cache.py turns it on in a temp dir)
os.environ.setdefault("LAZYTRAIN_SPEC_CACHE", "off")

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # Tests check correctness on tiny models: one intra-op thread is faster, and two OpenMP threads
    # on the shared 2-vCPU machines stall 10-50x whenever anything else runs. Benchmarks, not
    # tests, measure speed.
    try:
        import torch
    except ImportError:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def main_thread_stall():
    """`probe(fn)`: call `fn` on a worker thread (torch intra-op threads are 1 here) while
    this thread loops in Python; returns (the longest pause of this thread's loop while fn ran, fn's
    seconds). A call that holds the GIL pauses it for about its whole length; one that releases
    it, for no more than the OS's scheduling hiccups."""
    import threading
    import time

    def probe(fn, tries: int = 5):
        """The try with the smallest stall relative to its length (a GIL-holding call stalls in
        every try; scheduling hiccups on a busy machine come and go)."""
        return min((_once(fn) for _ in range(tries)), key=lambda r: r[0] / r[1])

    def _once(fn):
        span: list[float] = []

        def work() -> None:
            span.append(time.perf_counter())
            fn()
            span.append(time.perf_counter())

        t = threading.Thread(target=work)
        stamps: list[float] = []
        t.start()
        while t.is_alive():
            stamps.append(time.perf_counter())
        t.join()
        t0, t1 = span
        inside = [t0] + [s for s in stamps if t0 <= s <= t1] + [t1]
        return max(b - a for a, b in zip(inside, inside[1:])), t1 - t0

    return probe
