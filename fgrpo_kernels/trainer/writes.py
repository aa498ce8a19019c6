"""Every write into the run folder goes through here, so that a full disk (ENOSPC), a quota
(EDQUOT) or a read-only folder stops the run with one line that names the file and the free
space, and leaves nothing half-written: a metrics line is cut back to the last complete one, a
JSON file is written beside its old version and renamed over it, and a checkpoint is written in
a temporary folder (see `run_dir.save_checkpoint`)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

# the errors that mean "this folder cannot take the write", not a bug
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


class RunFolderError(OSError):
    """A write into the run folder failed for lack of room or permission. Its message is one
    line that starts with "out: " (the option that names the folder)."""


def free_space(path: Path) -> str:
    """The free space of the filesystem that holds `path` (its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return "unknown free space"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit} free"
    return f"{free} bytes free"


def _no_room(error: BaseException | None) -> OSError | None:
    """The OSError behind `error` when it means no room: raised as such, wrapped (torch.save
    into a file object raises a RuntimeError whose cause is the OSError), or only named in the
    message (safetensors: "I/O error: No space left on device (os error 28)")."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in NO_ROOM:
            return error
        named = re.search(r"os error (\d+)", str(error))
        if named and int(named.group(1)) in NO_ROOM:
            return OSError(int(named.group(1)), os.strerror(int(named.group(1))))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def writing(path: Path):
    """Turn a no-room failure while writing `path` into a RunFolderError naming it (or the
    file the error names, inside it) and the free space left."""
    try:
        yield
    except Exception as e:
        cause = _no_room(e)
        if cause is None or isinstance(e, RunFolderError):
            raise
        name = getattr(cause, "filename", None) or path
        why = cause.strerror or os.strerror(cause.errno or errno.ENOSPC)
        error = RunFolderError(f"out: cannot write {name}: {why} ({free_space(Path(path))})")
        error.errno = cause.errno
        raise error from e


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def append_line(path: Path, line: str) -> None:
    """Append one line whole or not at all: a failed write is cut back to the old length."""
    data = (line + "\n").encode()
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            try:
                _write_all(fd, data)
            except OSError:
                os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)


def replace_text(path: Path, text: str) -> None:
    """Write `text` beside `path` and rename it over: the old file stays whole on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with writing(path):
            tmp.write_text(text)
            tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
