"""Deprecated: moved to `fgrpo_kernels.backends.distributed`. This name stays for one release."""

import sys
import warnings

from .backends import distributed as _moved

warnings.warn(
    "fgrpo_kernels.distributed moved to fgrpo_kernels.backends.distributed; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
