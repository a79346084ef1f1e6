"""Memory tiers a tensor can live on."""

from enum import Enum


class Tier(str, Enum):
    DEVICE = "device"  # GPU memory (or the CPU's planned device budget)
    HOST = "host"      # pinned host RAM
    NVME = "nvme"      # files on a local SSD

    def __str__(self) -> str:  # so f-strings and JSON show "host", not "Tier.HOST"
        return self.value


ACTIVATION_TIERS = (Tier.DEVICE, Tier.HOST, Tier.NVME)
PARAM_TIERS = (Tier.DEVICE, Tier.HOST, Tier.NVME)
GRAD_TIERS = (Tier.HOST, Tier.NVME)
OPTIMIZER_TIERS = (Tier.HOST, Tier.NVME)
