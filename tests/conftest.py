import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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
