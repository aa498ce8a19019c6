"""fgrpo_kernels: fused kernels for GRPO-family RL fine-tuning."""

__version__ = "0.1.0"

from .backends.cpu import cpu_backend
from .backends.distributed import VocabParallel
from .core import reference
from .core.divergences import Divergence
from .core.reference import group_normalize
from .head.logprobs import fused_linear_logprobs

# the loss modules, exported below as `losses.__all__` lists them
from .losses import FusedLinearFGRPOLoss, FusedLinearGIFTLoss, FusedLinearGRPOLoss  # noqa: F401
from .losses import __all__ as _losses
from .losses.packed import PackedLoss  # noqa: F401
from .losses.policy import FusedLinearPolicyLoss  # noqa: F401
from .losses.preference import FusedLinearFDOLoss, FusedLinearFHALLoss  # noqa: F401

__all__ = [
    "Divergence",
    "VocabParallel",
    *_losses,
    "__version__",
    "cpu_backend",
    "fused_linear_logprobs",
    "group_normalize",
    "reference",
]
