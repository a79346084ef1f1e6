import sys
from pathlib import Path

# ds_plan_factory.py (hand-made Plans) is imported by name from the tests here.
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_torch_functions_deepspeed_patches():
    """DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear (zero3_linear_wrap) and leaves it
    replaced: every test after this directory then ran with DeepSpeed's linear (found when a
    saved-bytes test in tests/spec measured 15% more under it). Restore what it touched."""
    funcs = [torch.nn.functional, torch, torch.Tensor, torch.nn.Module]
    saved = [(obj, dict(vars(obj))) for obj in funcs]
    yield
    for obj, before in saved:
        for name, value in before.items():
            try:
                if getattr(obj, name, None) is not value:
                    setattr(obj, name, value)
            except (AttributeError, TypeError):
                pass
