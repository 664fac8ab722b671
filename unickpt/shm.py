"""Named shared-memory files (``/dev/shm``): the staging segments of asynchronous saves and
the node-shared read buffers of loads. One way to name, create, open, reserve, map and sweep
them: :class:`SharedFile` (the file mapped in this process) on :func:`create`,
:func:`open_existing` and :func:`sweep`.

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
* **Reservation**: ``ftruncate`` reserves nothing on tmpfs, and a store into a page
  ``/dev/shm`` has no room for kills the process (SIGBUS), a read into it fails (EFAULT):
  the creator reserves the blocks (``posix_fallocate``) before anyone maps them
  (:class:`SharedFile`), so a full ``/dev/shm`` is an error at creation
  (:class:`ReserveError`) or a published :data:`NO_SPACE`, never a signal.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
import threading
import time
from typing import Sequence

import torch

__all__ = ["SHM_DIR", "new_name", "create", "open_existing", "sweep", "GRACE_S", "SharedFile", "ReserveError",
           "NO_SPACE"]

SHM_DIR = "/dev/shm"
GRACE_S = 10.0
"""Seconds a segment nobody holds a lock on is left alone after its last change."""
_NAME = re.compile(r"^unickpt-[a-z]+-[0-9]+-[0-9a-f]{16}$")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
NO_SPACE = 255
"""The progress byte of a reservation by chunks (:class:`SharedFile`) once ``/dev/shm`` ran out."""


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


_create = create  # (SharedFile's parameter ``create`` hides the function in its body)


class ReserveError(OSError):
    """The blocks of a new shared file could not be reserved (``/dev/shm`` is full, with the
    original error's errno and strerror); nothing of the file is left."""


class SharedFile:
    """A named shared-memory file mapped in this process: ``map`` (the mapping) and ``bytes``
    (a flat ``torch.uint8`` view of it), ``size`` bytes.

    ``create``: made here (exclusively: :func:`create`), its blocks reserved before it is
    mapped (``posix_fallocate``: a full ``/dev/shm`` raises :class:`ReserveError`), and this
    process holds its lock (the file is alive) until :meth:`unlink` or :meth:`close`.
    Otherwise opened by name (:func:`open_existing`: a regular file of this user, not a link,
    of ``size`` bytes).

    The creator may reserve only the first ``reserve`` bytes now and ``chunks``
    (``(offset, bytes)``, in order) afterwards on a thread, so the file's users start on its
    head meanwhile; the byte at offset ``progress`` then counts the parts reserved (the first
    ``reserve`` bytes as one) or holds :data:`NO_SPACE`, and no user touches a part before
    it is counted (see :func:`_reserve_chunks`). Whatever fails in the constructor leaves
    nothing in ``/dev/shm``."""

    def __init__(self, path: str, size: int, *, create: bool = False, reserve: int = 0,
                 chunks: Sequence[tuple[int, int]] = (), progress: int | None = None) -> None:
        self.path = path
        self.map: mmap.mmap | None = None
        self.bytes: torch.Tensor = None  # type: ignore[assignment]  # (a view of map while open)
        self._lock = -1  # the creator's descriptor holding the file's lock, until unlink
        fd = _create(path) if create else open_existing(path, size)
        try:
            if create:
                self._lock = os.dup(fd)
                try:  # reserve the blocks now: a full tmpfs would otherwise SIGBUS a store into them
                    os.posix_fallocate(fd, 0, reserve or size)
                except OSError as e:
                    raise ReserveError(e.errno, e.strerror) from e
                if reserve and reserve < size:
                    os.ftruncate(fd, size)
                if progress is not None:
                    os.pwrite(fd, bytes([1]), progress)  # the first ``reserve`` bytes: one part
            self.size = size
            self.map = mmap.mmap(fd, size)
            self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
            if create and chunks:
                threading.Thread(target=_reserve_chunks, args=(os.dup(fd), list(chunks), progress),
                                 name="unickpt-shm-reserve", daemon=True).start()
        except BaseException:
            self.close()  # nothing left behind in /dev/shm by a file that failed
            raise
        finally:
            os.close(fd)

    def unlink(self, background: bool = False) -> None:
        """Remove the file's name (its pages stay while mapped) and let go of its lock: the
        creator's, once; nothing in a process that opened it. ``background``: on a thread,
        because the unlink waits for the inode lock that a reservation thread
        (:func:`_reserve_chunks`) holds while it zeroes each chunk: 10-35 ms here, which a
        caller about to use the file need not wait for. The thread is not a daemon, so a
        process that exits normally unlinks first; one killed before leaves the name, with no
        lock on it, for :func:`sweep`."""
        self._release(True, background)

    def close(self, unlink: bool = True, background: bool = False) -> None:
        """Unmap (``background``: on a thread, since returning ~100 MiB of pages takes tens of
        milliseconds that the caller need not wait for). The creator first removes the name
        (:meth:`unlink`), or with ``unlink=False`` only lets go of the lock (the name is left
        to :func:`sweep`)."""
        self._release(unlink, False)
        self.bytes = None  # type: ignore[assignment]
        m, self.map = self.map, None
        if m is None:
            return

        def unmap() -> None:
            try:
                m.close()
            except BufferError:  # a view still exists: the mapping goes with the last one
                pass

        if background:
            threading.Thread(target=unmap, name="unickpt-unmap", daemon=True).start()
        else:
            unmap()

    def _release(self, unlink: bool, background: bool) -> None:
        lock, self._lock = self._lock, -1
        if lock < 0:
            return

        def remove() -> None:
            try:
                if unlink:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            finally:
                os.close(lock)  # (releases the lock)

        if background:
            threading.Thread(target=remove, name="unickpt-shm-unlink").start()
        else:
            remove()


def _reserve_chunks(fd: int, chunks: list[tuple[int, int]], progress: int | None) -> None:
    """Reserve ``chunks`` of a shared file in order, storing how many parts are reserved (the
    creator's first one included) in the byte at ``progress``; :data:`NO_SPACE` when
    ``/dev/shm`` runs out. Through the file, not the mapping: the users may be done (and
    have unmapped it) before this ends. One byte, so no reader sees a store half done."""
    try:
        for i, (off, n) in enumerate(chunks):
            try:
                os.posix_fallocate(fd, off, n)
                done = i + 2
            except OSError:
                done = NO_SPACE
            if progress is not None:
                os.pwrite(fd, bytes([done]), progress)
            if done == NO_SPACE:
                return
    finally:
        os.close(fd)
