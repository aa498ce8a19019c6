"""Deprecated: moved to `fgrpo_kernels.losses.preference`. This name stays for one release."""

import sys
import warnings

from .losses import preference as _moved

warnings.warn(
    "fgrpo_kernels.losses_preference moved to fgrpo_kernels.losses.preference; "
    "import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
