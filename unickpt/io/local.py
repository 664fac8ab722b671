"""The POSIX store (:class:`LocalStorage`): pread readers, O_DIRECT writers staged through
huge-page buffers, block reservation, fsync, atomic renames (renameat2 exchange), node locks."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import mmap
import os
import shutil
import stat
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, LockTimeoutError, StorageError
from .capabilities import Capabilities
from .localfs import open_regular, read_regular


if TYPE_CHECKING:  # (the protocols: this module is one of their implementations)
    from .storage import ExtentWriter, RandomReader


ALIGN = 4096  # O_DIRECT alignment of offsets, sizes and buffers
FROM_MEMORY_MIN = 1 << 20  # stable data at least this long may be written without a copy
FROM_MEMORY_CHUNK = 32 << 20  # one O_DIRECT write straight from a caller's memory
_O_DIRECT = getattr(os, "O_DIRECT", 0)

class LocalStorage:
    """POSIX file system. Writes are durable once ``close()`` returns (fsync)."""

    caps = Capabilities(atomic_rename=True, shared_writes=True)

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def parent(self, path: str) -> str:
        return os.path.dirname(os.path.abspath(path))

    def basename(self, path: str) -> str:
        return os.path.basename(os.path.abspath(path))

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def isdir(self, path: str) -> bool:
        """A real directory (a symbolic link to one is not)."""
        try:
            return stat.S_ISDIR(os.lstat(path).st_mode)
        except (OSError, ValueError):
            return False

    def isfile(self, path: str) -> bool:
        """A regular file (a symbolic link to one is not)."""
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except (OSError, ValueError):
            return False

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FormatError(f"{path}: a loop of symbolic links") from None
            raise StorageError(e.errno, e.strerror, path) from None

    @contextlib.contextmanager
    def lock(self, path: str, timeout_s: float | None = None):
        """Exclusive lock on directory ``path`` (flock): commits and sweeps of one parent
        directory never interleave between processes of this machine. Anyone who can read the
        directory can hold it (another user too), so the wait is bounded: a lock still held
        after ``timeout_s`` (else :func:`lock_wait_s`'s default) is a
        :class:`~unickpt.errors.LockTimeoutError` naming the directory."""
        wait = lock_wait_s(timeout_s)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            try:
                _flock_within(fd, wait, path)
            except OSError as e:  # file systems without flock: renames that never replace still protect
                if isinstance(e, LockTimeoutError):
                    raise
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                if not _NO_LOCK_WARNED:
                    _NO_LOCK_WARNED.append(path)
                    from .._metrics import log

                    log.warning("%s: the file system does not support flock (%s); commits are not serialised "
                                "between processes (a commit still never replaces a checkpoint it did not mean to)",
                                path, e.strerror)
            yield
        finally:
            os.close(fd)  # releases the lock

    def identity(self, path: str) -> tuple | None:
        """What tells one file or directory from its replacement; None if absent."""
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def file_sizes(self, path: str) -> dict[str, int]:
        """Bytes each regular file directly in directory ``path`` takes on disk (a sparse
        file counts what it stores); links and other entries are left out."""
        out = {}
        try:
            with os.scandir(path) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        out[e.name] = min(st.st_size, st.st_blocks * 512) if hasattr(st, "st_blocks") else st.st_size
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FormatError(f"{path}: a loop of symbolic links") from None
            raise StorageError(e.errno, e.strerror, path) from None
        return out

    def mtime(self, path: str) -> float:
        """Newest modification time of ``path`` and of the entries directly inside it (a
        file: its own)."""
        try:
            st = os.lstat(path)
            t = st.st_mtime
            if not stat.S_ISDIR(st.st_mode):
                return t
            with os.scandir(path) as it:
                for e in it:
                    try:
                        t = max(t, e.stat(follow_symlinks=False).st_mtime)
                    except OSError:
                        pass
            return t
        except OSError:
            return 0.0

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def remove_tree(self, path: str) -> None:
        """Remove the directory ``path`` and what it holds, never through a link; anything
        else at ``path`` (a file, link, FIFO, socket or device planted under a temporary's
        name) is unlinked, never opened (``rmtree`` opens its argument: a FIFO blocked it)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise StorageError(e.errno, e.strerror, path) from None
        if not stat.S_ISDIR(st.st_mode):
            self.remove_file(path)
            return
        shutil.rmtree(path, ignore_errors=True)

    def remove_file(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomic rename that never replaces ``dst`` (renameat2 RENAME_NOREPLACE; where that
        is unavailable, a plain rename, which still refuses a non-empty ``dst``)."""
        rc = _renameat2(src, dst, 1)  # RENAME_NOREPLACE
        if rc is None:
            if os.path.lexists(dst) and not (os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst)):
                raise CheckpointExistsError(f"{dst}: already exists; refusing to replace it")
            try:
                os.rename(src, dst)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise CheckpointExistsError(f"{dst}: already exists; refusing to replace it") from None
                raise
            return
        if rc == errno.EEXIST:
            raise CheckpointExistsError(f"{dst}: already exists; refusing to replace it")
        if rc:
            raise OSError(rc, os.strerror(rc), dst)

    def exchange_dirs(self, a: str, b: str) -> bool:
        """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
        rc = _renameat2(a, b, 2)  # RENAME_EXCHANGE
        if rc is None:
            return False
        if rc:
            raise OSError(rc, os.strerror(rc), a)
        return True

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_bytes(self, path: str, data: bytes) -> None:
        """A small file (manifest, index, owner record) inside a directory this write made:
        never written through a link planted there."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FormatError(f"{path}: is a symbolic link; not written through") from None
            raise
        try:
            view = memoryview(data)
            while view:
                view = view[_progress(os.write(fd, view), path) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_bytes(self, path: str, limit: int) -> bytes:
        """The content of regular file ``path`` (see :func:`open_regular`), at most ``limit`` bytes."""
        return read_regular(path, limit)

    def create_file(self, path: str, size: int) -> None:
        """Create (or truncate) ``path`` with its final size, so every writer can open it.

        The blocks are reserved now (:func:`_reserve`): the file system lays the file out in
        a few large extents instead of allocating blocks as concurrent writers reach them, and
        a disk without room for the file fails here, before a byte is written."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _reserve(fd, size, path)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def open_writer(self, path: str, *, direct: bool | None = None, size: int | None = None) -> ExtentWriter:
        if direct is not False and _O_DIRECT:
            try:
                fd = os.open(path, os.O_WRONLY | _O_DIRECT)
            except OSError as e:
                if direct or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
            else:
                if getattr(self, "_engine", None) is None or not self._engine.stg:
                    self._engine = _DirectEngine()
                return _DirectWriter(path, fd, self._engine)
        return _BufferedWriter(path)

    def close(self) -> None:
        """Release shared write buffers (kept in a pool for the next save). Never raises:
        write errors surface through the writers' ``close()``/``abort()``."""
        eng = getattr(self, "_engine", None)
        self._engine = None
        if eng is not None:
            try:
                eng.release()
            except Exception:
                pass

    def finish_file(self, path: str, fragments: list[tuple[int, bytes]], size: int) -> None:
        """Owner: write the pages that fragments from every writer complete, fix the size, fsync."""
        pages: dict[int, bytearray] = {}
        for off, data in fragments:
            pos = 0
            while pos < len(data):
                page = (off + pos) // ALIGN
                within = (off + pos) % ALIGN
                k = min(len(data) - pos, ALIGN - within)
                buf = pages.setdefault(page, bytearray(ALIGN))
                buf[within : within + k] = data[pos : pos + k]
                pos += k
        direct = bool(_O_DIRECT)
        try:
            fd = os.open(path, os.O_WRONLY | (_O_DIRECT if direct else 0))
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            fd, direct = os.open(path, os.O_WRONLY), False
        try:
            if pages:
                staging = _Staging.get(ALIGN)
                try:
                    for page in sorted(pages):
                        staging.arr[:ALIGN] = np.frombuffer(pages[page], dtype=np.uint8)
                        view = memoryview(staging.buf)[:ALIGN]
                        try:
                            if os.pwrite(fd, view, page * ALIGN) != ALIGN:
                                raise OSError(errno.EIO, f"short write of page {page}", path)
                        finally:
                            view.release()
                finally:
                    _Staging.put(staging)
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def open_reader(self, path: str) -> RandomReader:
        return _Reader(path)


def _progress(n: int, path: str) -> int:
    """A write's byte count; a write that makes no progress is an I/O error, never a spin."""
    if n <= 0:
        raise StorageError(errno.EIO, "write made no progress", path)
    return n


_LIBC_FNS: dict[str, Any] = {}


def _libc(name: str, argtypes: list, restype=ctypes.c_int):
    """The C library's function ``name``, typed, its errno kept for ``ctypes.get_errno()``;
    None where this C library lacks it (looked up once per process)."""
    if name not in _LIBC_FNS:
        try:
            fn = getattr(ctypes.CDLL(None, use_errno=True), name)
            fn.argtypes, fn.restype = argtypes, restype
        except (OSError, AttributeError):
            fn = None
        _LIBC_FNS[name] = fn
    return _LIBC_FNS[name]


LOCK_WAIT_S = 5.0
"""How long :func:`_node_lock` waits for another process's reservation before going on without."""
_FS_TYPES: dict[str, str] = {}


def _fs_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (``/proc/self/mounts``; "" if unknown)."""
    d = os.path.dirname(os.path.realpath(path))
    if d not in _FS_TYPES:
        best, kind = "", ""
        try:
            with open("/proc/self/mounts") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 3:
                        mnt = parts[1].replace("\\040", " ")
                        if (d == mnt or d.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                            best, kind = mnt, parts[2]
        except OSError:
            pass
        _FS_TYPES[d] = kind
    return _FS_TYPES[d]


@contextlib.contextmanager
def _node_lock(name: str, wait_s: float | None = None):
    """An exclusive lock among this user's processes on this machine (``flock`` on a file in
    /dev/shm), taken around ``fallocate``: ranks of a node that reserve their files at the
    same moment get their blocks handed out in turns of 8 MiB, so each file is laid out as
    dozens of extents interleaved with the other files' and a later sequential read of one
    file skips every other 8 MiB on disk (1.5x as long here, docs/performance.md). A
    reservation on a disk file system takes well under a millisecond.

    Only an optimisation, so never a reason to fail or hang: without /dev/shm or fcntl, with a
    lock file that is not a regular file of this user's with one link (planted by someone
    else), or when the lock stays taken for ``wait_s`` (default :data:`LOCK_WAIT_S`: a stopped
    process holds it, or a child forked while it was held), the caller goes on without it."""
    fd = -1
    try:
        try:
            import fcntl

            fd = os.open(os.path.join("/dev/shm", f"unickpt-{name}-{os.getuid()}.lock"),
                         os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0), 0o600)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_nlink != 1:
                raise OSError(errno.EPERM, "not this user's lock file")
            deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else wait_s)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise OSError(errno.ETIMEDOUT, "lock held too long") from None
                    time.sleep(0.001)
        except (OSError, ImportError):
            if fd >= 0:
                os.close(fd)
            fd = -1
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock


def _reserve(fd: int, size: int, path: str) -> None:
    """fallocate(2) ``size`` bytes of ``fd`` (mode 0: blocks reserved, reads return zeros).

    Why: blocks allocated as O_DIRECT writers reach them (several files written at once by
    several ranks) end up as dozens of small interleaved extents per file; reserved up front
    they are a few large ones, and the save and the loads of the checkpoint are faster
    (docs/performance.md). Not ``os.posix_fallocate``: where the file system cannot
    allocate, glibc emulates it by writing every block, which would double the save's
    writes. Here an unsupported call leaves the file sparse, as before; a disk without room
    is :class:`~unickpt.errors.StorageError` (ENOSPC) naming the file and the size."""
    if size <= 0 or os.environ.get("UNICKPT_NO_FALLOCATE"):
        return
    fn = _libc("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
    if fn is None:
        return
    # one reservation at a time on the machine, where the layout matters (not in memory)
    with _node_lock("alloc") if _fs_type(path) not in ("tmpfs", "ramfs") else contextlib.nullcontext():
        rc = fn(fd, 0, 0, size)
    if rc == 0:
        return
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return  # the file system cannot (tmpfs without it, some network file systems)
    raise StorageError(err, f"cannot reserve {size} bytes ({os.strerror(err)})", path)


_NO_LOCK_WARNED: list[str] = []

LOCK_SHARE = 0.8
"""The share of a call's ``timeout_s`` a commit lock is waited for: the coordinator's
:class:`~unickpt.errors.LockTimeoutError` then reaches the other ranks, which wait for it in
a collective bounded by the whole ``timeout_s``, as that error rather than as a timeout."""


def lock_wait_s(timeout_s: float | None) -> float:
    """Seconds a commit lock is waited for under ``timeout_s`` (None: ``UNICKPT_TIMEOUT_S``,
    else the default of :func:`unickpt.transport.resolve_timeout`)."""
    from ..transport import resolve_timeout

    return LOCK_SHARE * resolve_timeout(timeout_s)


def _flock_within(fd: int, wait: float, path: str) -> None:
    """``flock(LOCK_EX)`` on ``fd``, waiting at most ``wait`` seconds."""
    import fcntl

    deadline = time.monotonic() + wait
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockTimeoutError(errno.ETIMEDOUT, f"the commit lock of {path} (an flock on the directory) is "
                                       f"held by another process (of this user or another who can read it); waited "
                                       f"{wait:g} s ({LOCK_SHARE:g} x timeout_s); retry, or find the holder with "
                                       f"`fuser {path}`", path) from None
            time.sleep(delay)
            delay = min(2 * delay, 0.05)


def _renameat2(src: str, dst: str, flags: int) -> int | None:
    """renameat2(2): 0, an errno, or None where the call or the flag is unsupported."""
    fn = _libc("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
    if fn is None or os.environ.get("UNICKPT_NO_RENAMEAT2"):
        return None
    if fn(-100, os.fsencode(src), -100, os.fsencode(dst), flags) == 0:  # AT_FDCWD
        return 0
    err = ctypes.get_errno()
    return None if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP) else err


def _huge_buffer(size: int) -> mmap.mmap:
    """Private anonymous memory, asked for in 2 MiB pages where the kernel gives them
    (transparent huge pages in "madvise" mode or "always").

    Why: an O_DIRECT write is built from the buffer's physical pages, at most ``max_segments``
    (254 here) of them per request. From scattered 4 KiB pages that is ~0.8-1 MB per
    request; the same save wrote 0.8 MB requests 50-70 deep and took 1.2-2.4 s once the
    process had churned through a few GB of memory, against 3.1 MB and 0.9 s when its buffers
    happened to be contiguous (docs/performance.md). ``mmap.mmap(-1, n)`` alone is shared
    anonymous memory (shmem), which huge pages skip where ``shmem_enabled`` is "never"."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):
        pass
    return buf


class _Staging:
    """Page-aligned staging buffers, kept across saves (first-touch of fresh memory costs
    several times a copy into a touched buffer)."""

    _free: list["_Staging"] = []
    _lock = threading.Lock()

    def __init__(self, size: int) -> None:
        self.buf = _huge_buffer(size)
        self.arr = np.frombuffer(self.buf, dtype=np.uint8)
        self.size = size

    @classmethod
    def get(cls, size: int) -> "_Staging":
        with cls._lock:
            for i, s in enumerate(cls._free):
                if s.size >= size:
                    return cls._free.pop(i)
        return cls(size)

    @classmethod
    def put(cls, s: "_Staging") -> None:
        with cls._lock:
            if len(cls._free) < 6:
                cls._free.append(s)
                return
        del s.arr
        s.buf.close()


class _BufferedWriter:
    """Plain positional writes through the page cache; fsync on close. No fragments."""

    direct = False

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY)
        self.bytes_written = 0

    def write_at(self, offset: int, data: memoryview, stable: bool = False) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = _progress(os.pwrite(self.fd, view, offset), self.path)
            self.bytes_written += n
            offset += n
            view = view[n:]

    def close(self) -> list[tuple[int, bytes]]:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
        return []

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _DirectEngine:
    """Staging shared by every O_DIRECT writer of one storage object: BUFFERS page-aligned
    buffers (one fills while the others are written by helper threads). Writers are used
    from one thread at a time; switching writers ends the previous writer's run."""

    STAGING = 32 << 20
    BUFFERS = 6  # one fills while up to five writes are in flight: short runs (one per tensor
    # piece) still keep several requests queued, as one long sequential stream would

    def __init__(self) -> None:
        self.stg = [_Staging.get(self.STAGING) for _ in range(self.BUFFERS)]
        self.cur = 0
        self.pending: list[Future | None] = [None] * self.BUFFERS
        self.inflight: collections.deque[Future] = collections.deque()  # writes from callers' memory
        self.pool = ThreadPoolExecutor(self.BUFFERS - 1, thread_name_prefix="unickpt-odirect")
        self.owner: "_DirectWriter | None" = None
        self.users = 0

    def submit_direct(self, fn, *args) -> None:
        """Queue a write straight from a caller's memory; at most ``BUFFERS - 1`` such
        writes are queued at once (the oldest is waited for first)."""
        while len(self.inflight) >= self.BUFFERS - 1:
            self.inflight.popleft().result()
        self.inflight.append(self.pool.submit(fn, *args))

    def next(self) -> None:
        """Move to the next staging buffer, waiting until its previous write is done."""
        self.cur = (self.cur + 1) % len(self.stg)
        self.wait(self.cur)

    def wait(self, i: int) -> None:
        fut = self.pending[i]
        self.pending[i] = None
        if fut is not None:
            fut.result()

    def drain(self) -> None:
        """Wait for every write in flight; then raise the first error, if any."""
        first: BaseException | None = None
        for i in range(len(self.pending)):
            try:
                self.wait(i)
            except BaseException as e:  # keep waiting: no write may outlive its buffer
                first = first or e
        while self.inflight:
            try:
                self.inflight.popleft().result()
            except BaseException as e:  # nor its caller's memory
                first = first or e
        if first is not None:
            raise first

    def release(self) -> None:
        try:
            self.drain()
        finally:
            self.pool.shutdown(wait=True)
            for s in self.stg:
                _Staging.put(s)
            self.stg = []


class _DirectWriter:
    """O_DIRECT positional writer. A run of contiguous ``write_at`` calls is copied into the
    engine's staging buffer at its in-page offset, so whole pages go to disk directly; the
    partial pages at a run's ends become fragments for the file's owner.

    Stable data (see :class:`ExtentWriter`) of at least :data:`FROM_MEMORY_MIN` bytes whose
    address has the same offset within a page as its file offset is not copied: its whole
    pages are written straight from the caller's memory (in :data:`FROM_MEMORY_CHUNK`
    writes, queued on the engine's threads); only its partial first and last pages go
    through the staging buffer, as the edges of the run they belong to."""

    direct = True

    def __init__(self, path: str, fd: int, engine: _DirectEngine) -> None:
        self.path = path
        self.fd = fd
        self.eng = engine
        engine.users += 1
        self.bytes_written = 0
        self._base = 0  # file offset of staging byte 0 (page aligned)
        self._fill = 0  # staging bytes in use
        self._skip = 0  # leading staging bytes that are not ours (run started mid-page)
        self._run_end = -1
        self._fragments: list[tuple[int, bytes]] = []
        self._closed = False

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        done, n = 0, len(view)
        try:
            while done < n:
                done += _progress(os.pwrite(self.fd, view[done:], offset + done), self.path)
        finally:
            view.release()

    def _flush(self, final: bool) -> None:
        """Write the whole pages staged; emit partial edge pages as fragments on ``final``."""
        eng = self.eng
        i = eng.cur
        stg = eng.stg[i]
        lo, hi = self._skip, self._fill
        if hi <= lo:
            self._skip = self._fill = 0
            return
        first_full = -(-lo // ALIGN) * ALIGN
        last_full = (hi // ALIGN) * ALIGN
        if lo % ALIGN:  # the run started mid-page
            self._fragments.append((self._base + lo, bytes(stg.arr[lo : min(first_full, hi)])))
        if final and hi % ALIGN and max(last_full, first_full) < hi:
            start = max(last_full, first_full)
            self._fragments.append((self._base + start, bytes(stg.arr[start:hi])))
        if last_full > first_full:
            view = memoryview(stg.buf)[first_full:last_full]
            eng.pending[i] = eng.pool.submit(self._pwrite_all, view, self._base + first_full)
        eng.next()
        # a run that continues (buffer full) starts page aligned in the other buffer
        self._base += last_full
        self._skip = self._fill = 0

    def write_at(self, offset: int, data: memoryview, stable: bool = False) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        n = len(src)
        if n == 0:
            return
        eng = self.eng
        if eng.owner is not self:
            if eng.owner is not None:
                eng.owner._end_run()
            eng.owner = self
            self._run_end = -1
        if offset != self._run_end:
            self._flush(final=True)
            self._base = (offset // ALIGN) * ALIGN
            self._skip = self._fill = offset - self._base
        if stable and n >= FROM_MEMORY_MIN and (src.ctypes.data - offset) % ALIGN == 0:
            head = -offset % ALIGN  # up to the first page boundary: completes the staged run
            body = (n - head) // ALIGN * ALIGN
            self._stage(src[:head])
            self._flush(final=True)  # the run ends on a page boundary: no trailing fragment
            view = memoryview(src)
            for a in range(head, head + body, FROM_MEMORY_CHUNK):
                b = min(a + FROM_MEMORY_CHUNK, head + body)
                eng.submit_direct(self._pwrite_all, view[a:b], offset + a)
            self._base = offset + head + body  # the run goes on in staging from here
            self._skip = self._fill = 0
            self._stage(src[head + body :])
        else:
            self._stage(src)
        self._run_end = offset + n
        self.bytes_written += n

    def _stage(self, src: np.ndarray) -> None:
        """Copy ``src`` into staging after the run's bytes, writing each buffer that fills."""
        eng = self.eng
        i, n, cap = 0, len(src), eng.STAGING
        while i < n:
            k = min(n - i, cap - self._fill)
            eng.stg[eng.cur].arr[self._fill : self._fill + k] = src[i : i + k]
            self._fill += k
            i += k
            if self._fill == cap:
                self._flush(final=False)

    def _end_run(self) -> None:
        self._flush(final=True)
        self._run_end = -1
        if self.eng.owner is self:
            self.eng.owner = None

    def close(self) -> list[tuple[int, bytes]]:
        try:
            if self.eng.owner is self:
                self._end_run()
            self.eng.drain()
            os.fsync(self.fd)
        finally:
            self._release()
        return self._fragments

    def abort(self) -> None:
        try:
            self.eng.drain()
        except Exception:  # the error that made us abort is reported elsewhere
            pass
        self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.eng.owner is self:
            self.eng.owner = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.eng.users -= 1


def _resident(fd: int, offset: int, n: int) -> int | None:
    """Page-cache residency of a file range through mmap + mincore (Linux); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    mmap_ = _libc("mmap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64],
                  ctypes.c_void_p)
    munmap = _libc("munmap", [ctypes.c_void_p, ctypes.c_size_t])
    mincore = _libc("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p])
    if mmap_ is None or munmap is None or mincore is None:
        return None
    page = mmap.PAGESIZE
    lo = offset - offset % page
    length = offset + n - lo
    addr = mmap_(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        vec = ctypes.create_string_buffer(-(-length // page))
        if mincore(addr, length, vec) != 0:
            return None
        return int(np.frombuffer(vec.raw, dtype=np.uint8).__and__(1).sum()) * page
    finally:
        munmap(addr, length)


class _Reader:
    """Positional reads straight into the caller's memory (no intermediate copy)."""

    sequential = True
    """Reads of one stream go best one after another on one thread (the kernel's read-ahead
    follows them; concurrent reads of one stream reach the disk as smaller requests)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd, st = open_regular(path)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"{path}: file listed in the manifest is missing") from None
        self.size = st.st_size
        self.bytes_read = 0
        self._lock = threading.Lock()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def readinto(self, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        n = len(out)
        if offset < 0 or offset + n > self.size:
            raise FormatError(f"{self.path}: read of {n} bytes at {offset} runs past the end ({self.size} bytes)")
        done = 0
        while done < n:
            k = os.preadv(self.fd, [out[done:]], offset + done)
            if k <= 0:
                raise FormatError(f"{self.path}: unexpected end of file at byte {offset + done}")
            done += k
        with self._lock:  # reads may run on several threads
            self.bytes_read += n

    def mapped(self, offset: int, n: int) -> mmap.mmap:
        """Bytes ``[offset, offset + n)`` mapped private (copy-on-write: never written back),
        for handing the page cache's pages to a transfer without copying them; ``offset`` a
        multiple of the page size. The caller closes the map once nothing refers to it."""
        if offset < 0 or offset + n > self.size or offset % mmap.ALLOCATIONGRANULARITY:
            raise FormatError(f"{self.path}: cannot map {n} bytes at {offset} ({self.size} bytes)")
        m = mmap.mmap(self.fd, n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        with self._lock:
            self.bytes_read += n
        return m

    def prefetch(self, offset: int, n: int) -> None:
        """Ask the kernel to start reading ``[offset, offset + n)`` into the page cache now
        (a hint: the bytes count as read when :meth:`readinto` reads them)."""
        if hasattr(os, "posix_fadvise") and n > 0:
            os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_WILLNEED)

    def resident(self, offset: int, n: int) -> int | None:
        """Bytes of ``[offset, offset + n)`` in the page cache now (``mincore``; no I/O, the
        file's pages are not touched), or None where that cannot be asked."""
        return _resident(self.fd, offset, n) if n > 0 else 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

