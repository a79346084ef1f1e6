"""Benchmark review (2026-12-01): bench_streaming timed an NVMe runner's step until its updates
landed, not the next step's first weight read the step starts at its end (~34 ms of 1.5 s, untimed
and overlapping the next runner's step). `wait(fetches=True)` waits for those reads too."""

from lazytrain.runtime import StreamingExecutor
from lazytrain.runtime.testing import hand_plan, random_batches, tiny_model


def test_wait_with_fetches_leaves_no_weight_read_running(tmp_path):
    ex = StreamingExecutor(tiny_model("llama"), hand_plan(3, param_tier="nvme"), device="cpu", nvme_dir=tmp_path)
    try:
        ex.train_step(random_batches(1, 0))
        ex.wait()
        started = [lay.fetch for lay in ex.streamer.layers if lay.fetch is not None]
        assert started   # the next step's first fetch began at the end of this one
        ex.wait(fetches=True)
        assert all(f.done() for f in started)
        ex.train_step(random_batches(1, 1))   # and the next step uses them as before
    finally:
        ex.close()
