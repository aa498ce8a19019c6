"""Public name of `fgrpo_kernels.core.divergences` (the divergence table):
`import fgrpo_kernels.divergences` gives that same module, and `python -m fgrpo_kernels.divergences`
prints the table."""

import sys

from .core import divergences

if __name__ == "__main__":
    print(divergences.markdown_table())
else:
    sys.modules[__name__] = divergences
