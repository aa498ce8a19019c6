"""fgrpo_kernels: fused kernels for GRPO-family RL fine-tuning."""

__version__ = "0.1.0"

from . import reference
from .cpu import cpu_backend
from .distributed import VocabParallel
from .divergences import Divergence
from .logprobs import fused_linear_logprobs
from .losses import FusedLinearFGRPOLoss, FusedLinearGIFTLoss, FusedLinearGRPOLoss
from .losses_preference import FusedLinearFDOLoss, FusedLinearFHALLoss
from .reference import group_normalize

__all__ = [
    "Divergence",
    "VocabParallel",
    "FusedLinearFDOLoss",
    "FusedLinearFGRPOLoss",
    "FusedLinearFHALLoss",
    "FusedLinearGIFTLoss",
    "FusedLinearGRPOLoss",
    "__version__",
    "cpu_backend",
    "fused_linear_logprobs",
    "group_normalize",
    "reference",
]
