"""One writer per run folder: `fgrpo train` holds DIR/.lock (an flock, which the kernel drops
when the process ends however it ends) for as long as it runs. A second process on the same
folder is refused with the holder's PID; a lock file left by a process that is gone (SIGKILL,
a reboot) is not locked any more and is simply taken over, with a message.

The file stays in the folder after the run (emptied); `run_dir` ignores it."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from pathlib import Path

NAME = ".lock"


def _holder(text: str) -> str:
    """'PID 123 on host, since 2026-12-06 03:40:00' from the file's 'pid host time' line."""
    parts = text.split()
    if len(parts) < 3:
        return "a process that left no PID"
    pid, host, since = parts[0], parts[1], " ".join(parts[2:])
    return f"PID {pid} on {host}, since {since}"


def _try_lock(fd: int) -> bool:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _busy(out: Path, fd: int) -> ValueError:
    held = os.pread(fd, 4096, 0).decode(errors="replace")
    return ValueError(
        f"out: {str(out)!r} is in use by another fgrpo train ({_holder(held)}); wait for it to "
        f"end or stop it, or choose another --out"
    )


def check(out: Path) -> None:
    """Refuse (ValueError naming the holder) when a live process holds `out`'s lock; take
    nothing. A folder without a lock file is free."""
    path = Path(out) / NAME
    if not path.is_file():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if not _try_lock(fd):
            raise _busy(Path(out), fd)
    finally:
        os.close(fd)  # closing drops a lock taken just now


class RunLock:
    """Holds `out`'s lock from `acquire` to `release` (or the process's end)."""

    def __init__(self, out: Path):
        self.out, self.fd = Path(out), None

    def acquire(self) -> RunLock:
        self.out.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.out / NAME, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(fd):
            error = _busy(self.out, fd)
            os.close(fd)
            raise error
        left = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if left:
            print(
                f"fgrpo train: taking over {self.out / NAME}, left by {_holder(left)}, which is "
                f"no longer running",
                file=sys.stderr,
            )
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {stamp}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)  # an empty file: nobody to name as its holder
        os.close(self.fd)
        self.fd = None
