"""Deprecated: moved to `fgrpo_kernels.head.logprobs`. This name stays for one release."""

import sys
import warnings

from .head import logprobs as _moved

warnings.warn(
    "fgrpo_kernels.logprobs moved to fgrpo_kernels.head.logprobs; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
