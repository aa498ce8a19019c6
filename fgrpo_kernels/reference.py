"""Public name of `fgrpo_kernels.core.reference` (the plain-PyTorch reference of every loss):
`import fgrpo_kernels.reference` gives that same module."""

import sys

from .core import reference

sys.modules[__name__] = reference
