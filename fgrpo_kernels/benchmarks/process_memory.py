"""Peak resident memory of this process above a baseline, read from Linux /proc.

    peak = PeakRSS()      # gc, reset the high-water mark, note the resident set
    ...                   # the work
    peak.extra()          # bytes: VmHWM now − VmRSS at the reset

Every CPU memory figure of `fgrpo bench` and of the scripts in `bench/` comes from here.
"""

from __future__ import annotations

import gc


def status_bytes(key: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM, VmData, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakRSS:
    """Resets the resident-set high-water mark on construction; `extra()` is the rise since."""

    def __init__(self) -> None:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # NB: resets VmHWM to the current RSS (Linux ≥ 4.0)
        self.base = status_bytes("VmRSS")

    def extra(self) -> int:
        """Bytes by which the resident set peaked above the baseline."""
        return status_bytes("VmHWM") - self.base
