"""The fused losses: per-family modules on the fused head, their epilogues, metrics and the
single-pass plan."""

from .fgrpo import FusedLinearFGRPOLoss
from .gift import FusedLinearGIFTLoss
from .grpo import FusedLinearGRPOLoss
from .packed import PackedLoss
from .policy import FusedLinearPolicyLoss
from .preference import FusedLinearFDOLoss, FusedLinearFHALLoss

__all__ = [
    "FusedLinearFDOLoss",
    "FusedLinearFGRPOLoss",
    "FusedLinearFHALLoss",
    "FusedLinearGIFTLoss",
    "FusedLinearGRPOLoss",
    "FusedLinearPolicyLoss",
    "PackedLoss",
]
