"""The fused losses: per-family modules on the fused head, their epilogues, metrics and the
single-pass plan."""

from .modules import FusedLinearFGRPOLoss, FusedLinearGIFTLoss, FusedLinearGRPOLoss
from .preference import FusedLinearFDOLoss, FusedLinearFHALLoss

__all__ = [
    "FusedLinearFDOLoss",
    "FusedLinearFGRPOLoss",
    "FusedLinearFHALLoss",
    "FusedLinearGIFTLoss",
    "FusedLinearGRPOLoss",
]
