"""Pure, frozen descriptions of the model, the machine and the job. No torch here."""

from .hardware import HardwareSpec
from .job import JobSpec
from .model import LayerSpec, Linear, ModelConfigError, ModelSpec
from .tier import Tier
from .units import GB, GiB, MiB, dtype_bytes

__all__ = ["HardwareSpec", "JobSpec", "LayerSpec", "Linear", "ModelConfigError", "ModelSpec",
           "Tier", "GB", "GiB", "MiB", "dtype_bytes"]
