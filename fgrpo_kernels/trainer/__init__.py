"""A thin GRPO-family trainer for Hugging Face causal LMs (glue; the maths is in the modules).

from fgrpo_kernels.trainer import Trainer, TrainConfig
"""

from .config import TrainConfig
from .loop import Trainer

__all__ = ["TrainConfig", "Trainer"]
