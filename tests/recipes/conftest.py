import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from recipe_helpers import write_text_data  # noqa: E402


@pytest.fixture(scope="session")
def text_data(tmp_path_factory):
    """(train.txt, tokenizer dir) of real English prose, tokenizer vocab 300."""
    from lazytrain.data.tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("data")
    f = write_text_data(d)
    return f, build_tokenizer([f], d / "tok", vocab_size=300)


@pytest.fixture
def base_overrides(text_data, tmp_path):
    f, tok = text_data
    return ["model=tiny-llama", "model.hf_config.vocab_size=320", "data=text", f"data.files=[{f}]",
            f"data.tokenizer={tok}", "job.seq_len=32", "job.batch_size=2", "job.max_steps=6",
            "job.compute_dtype=fp32", "engine=torch", "progress=false", "optim.lr=3e-3",
            "optim.warmup_steps=2", f"planner.cache_dir={tmp_path / 'solver_cache'}"]


