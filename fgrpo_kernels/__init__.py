"""fgrpo_kernels: fused kernels for GRPO-family RL fine-tuning."""

__version__ = "0.1.0"

from .backends.cpu import cpu_backend
from .backends.distributed import VocabParallel
from .core import reference
from .core.divergences import Divergence
from .core.reference import group_normalize
from .head.logprobs import fused_linear_logprobs
from .losses import FusedLinearFGRPOLoss, FusedLinearGIFTLoss, FusedLinearGRPOLoss
from .losses.packed import PackedLoss
from .losses.policy import FusedLinearPolicyLoss
from .losses.preference import FusedLinearFDOLoss, FusedLinearFHALLoss

__all__ = [
    "Divergence",
    "VocabParallel",
    "FusedLinearFDOLoss",
    "FusedLinearFGRPOLoss",
    "FusedLinearFHALLoss",
    "FusedLinearGIFTLoss",
    "FusedLinearGRPOLoss",
    "FusedLinearPolicyLoss",
    "PackedLoss",
    "__version__",
    "cpu_backend",
    "fused_linear_logprobs",
    "group_normalize",
    "reference",
]
