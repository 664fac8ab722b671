"""The validation trainer's metrics log: one JSON line per event, appended to the file the
user named. A FIFO, socket or device there is refused at once (opened with ``O_NONBLOCK``,
then ``fstat``), never waited on."""

from __future__ import annotations

import errno
import os
import stat

from unickpt.errors import FormatError, StorageError

__all__ = ["append_line"]


def append_line(path: str, text: str) -> None:
    """Append ``text`` to ``path`` (created if absent; a regular file only)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO without reader
            raise FormatError(f"{path}: is a FIFO, not a regular file") from None
        raise StorageError(e.errno, e.strerror, path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else \
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file"
            raise FormatError(f"{path}: is {kind}, not a regular file")
        view = memoryview(text.encode())
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
