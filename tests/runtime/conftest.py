import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: one intra-op thread is faster and immune to OpenMP stalls on a loaded machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
