"""Named shared-memory files (``/dev/shm``): the staging segments of asynchronous saves and
the node-shared read buffers of loads. One way to name, create, open and sweep them.

* **Names** are ``unickpt-KIND-PID-TOKEN``, TOKEN 64 random bits: two processes never pick
  the same name, also when they have the same pid (a container restarted in a fresh PID
  namespace gets the same small pids again).
* **Creation** is exclusive (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600): a name that is
  already there (a dead process's segment, or a file another user planted) is never reused
  or written through.
* **Opening** by name (the peer ranks and the writer process) follows no link and takes
  only a regular file of this user of the expected size.
* **Liveness** is the kernel's, not a pid's: the creator holds a shared ``flock`` on its
  segment for as long as the segment is meant to exist (the descriptor it keeps), and the
  kernel drops it when the process dies, whatever its pid or namespace. :func:`sweep`
  removes this user's segments nobody holds a lock on, once older than :data:`GRACE_S`
  (the moment between a creator's ``open`` and its ``flock``).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time

__all__ = ["SHM_DIR", "new_name", "create", "open_existing", "sweep", "GRACE_S"]

SHM_DIR = "/dev/shm"
GRACE_S = 10.0
"""Seconds a segment nobody holds a lock on is left alone after its last change."""
_NAME = re.compile(r"^unickpt-[a-z]+-[0-9]+-[0-9a-f]{16}$")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def new_name(kind: str) -> str:
    """A segment name no other process uses: ``unickpt-KIND-PID-TOKEN``."""
    return f"unickpt-{kind}-{os.getpid()}-{secrets.token_hex(8)}"


def create(path: str) -> int:
    """A new segment file at ``path`` (exclusive: ``FileExistsError`` when the name is taken,
    by anyone), mode 0600, with this process's shared lock on it: the returned descriptor
    holds the lock; keep it open while the segment is in use, close it to let it be swept."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    return fd


def open_existing(path: str, size: int | None = None) -> int:
    """A descriptor of the segment another process of this user created at ``path``: a
    regular file reached without following a link, owned by this user, of ``size`` bytes
    (when given); ``OSError`` otherwise."""
    fd = os.open(path, os.O_RDWR | _NOFOLLOW | _CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or (size is not None and st.st_size != size):
            raise OSError(errno.EPERM, f"{path}: not the shared-memory segment expected (another user's file, or "
                          "another size)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep(directory: str = SHM_DIR, now: float | None = None) -> list[str]:
    """Unlink this user's segments that no live process holds (see the module doc); returns
    the paths removed. Other users' files, links and files of other names are never touched."""
    import fcntl

    try:
        names = [n for n in os.listdir(directory) if _NAME.match(n)]
    except OSError:
        return []
    now = time.time() if now is None else now
    removed = []
    for n in names:
        path = os.path.join(directory, n)
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or now - st.st_mtime < GRACE_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its creator runs
                continue
            try:
                if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
                    continue  # replaced meanwhile
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        finally:
            os.close(fd)
    return removed


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
