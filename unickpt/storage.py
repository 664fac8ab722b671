"""Storage: the one place that touches files.

Save and load only talk to a :class:`Storage`; today the implementation is
:class:`LocalStorage` (POSIX paths: pread, O_DIRECT writes, fsync, atomic rename). Object
stores (fsspec URLs with a commit marker instead of rename) slot in behind the same small
interface; until then a URL with a scheme other than ``file://`` raises
``NotImplementedError``.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from .errors import CheckpointNotFoundError, FormatError

__all__ = ["Storage", "LocalStorage", "storage_for", "SequentialWriter", "RandomReader"]

ALIGN = 4096  # O_DIRECT alignment of offsets, sizes and buffers
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class SequentialWriter(Protocol):
    path: str
    bytes_written: int
    direct: bool

    def write(self, data: memoryview) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


class RandomReader(Protocol):
    path: str
    size: int
    bytes_read: int

    def readinto(self, offset: int, out: memoryview) -> None: ...
    def close(self) -> None: ...


class Storage(Protocol):
    def join(self, *parts: str) -> str: ...
    def parent(self, path: str) -> str: ...
    def basename(self, path: str) -> str: ...
    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def makedirs(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def rename_dir(self, src: str, dst: str) -> None: ...
    def exchange_dirs(self, a: str, b: str) -> bool: ...
    def fsync_dir(self, path: str) -> None: ...
    def write_bytes(self, path: str, data: bytes) -> None: ...
    def read_bytes(self, path: str, limit: int) -> bytes: ...
    def open_writer(self, path: str, *, direct: bool | None = None) -> SequentialWriter: ...
    def open_reader(self, path: str) -> RandomReader: ...


def storage_for(path: str | os.PathLike) -> tuple["Storage", str]:
    """The storage for ``path`` and the path in that storage's terms."""
    p = os.fspath(path)
    if "://" in p:
        scheme, rest = p.split("://", 1)
        if scheme == "file":
            return LocalStorage(), os.path.abspath(rest)
        raise NotImplementedError(
            f"{scheme}:// paths are not supported yet: only local paths are (object stores through "
            "fsspec are on the roadmap, see docs/design.md)"
        )
    return LocalStorage(), os.path.abspath(p)


class LocalStorage:
    """POSIX file system. Writes are durable once ``close()`` returns (fsync)."""

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def parent(self, path: str) -> str:
        return os.path.dirname(os.path.abspath(path))

    def basename(self, path: str) -> str:
        return os.path.basename(os.path.abspath(path))

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def rename_dir(self, src: str, dst: str) -> None:
        os.rename(src, dst)  # atomic; fails if dst is a non-empty directory

    def exchange_dirs(self, a: str, b: str) -> bool:
        """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.renameat2
        except (OSError, AttributeError):
            return False
        AT_FDCWD, RENAME_EXCHANGE = -100, 2
        rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
        if rc != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                return False
            raise OSError(err, os.strerror(err), a)
        return True

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_bytes(self, path: str, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_bytes(self, path: str, limit: int) -> bytes:
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{path}: no such file") from e
        if len(data) > limit:
            raise FormatError(f"{path}: larger than the {limit} bytes allowed for this file")
        return data

    def open_writer(self, path: str, *, direct: bool | None = None) -> SequentialWriter:
        if direct is not False and _O_DIRECT:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
            except OSError as e:
                if direct or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
            else:
                return _DirectWriter(path, fd)
        return _BufferedWriter(path)

    def open_reader(self, path: str) -> RandomReader:
        return _Reader(path)


class _BufferedWriter:
    """Plain writes through the page cache; fsync on close."""

    direct = False

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.bytes_written = 0

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, self.bytes_written)
            self.bytes_written += n
            view = view[n:]

    def close(self) -> None:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _DirectWriter:
    """O_DIRECT sequential writer: data is copied into two page-aligned staging buffers; one
    fills while a helper thread writes the other, so the copy hides behind the disk."""

    direct = True
    STAGING = 32 << 20

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.bytes_written = 0  # bytes accepted (file size at close)
        self._flushed = 0  # bytes on disk (multiple of ALIGN until close)
        self._bufs = [mmap.mmap(-1, self.STAGING) for _ in range(2)]
        self._arrs = [np.frombuffer(b, dtype=np.uint8) for b in self._bufs]
        self._cur = 0
        self._fill = 0
        self._pending: list[Future | None] = [None, None]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="unickpt-odirect")
        self._lock = threading.Lock()

    def _pwrite_all(self, buf: mmap.mmap, n: int, offset: int) -> None:
        view = memoryview(buf)[:n]
        done = 0
        try:
            while done < n:
                done += os.pwrite(self.fd, view[done:], offset + done)
        finally:
            view.release()

    def _submit(self) -> None:
        i, n = self._cur, self._fill
        padded = -(-n // ALIGN) * ALIGN
        if padded != n:
            self._arrs[i][n:padded] = 0
        self._pending[i] = self._pool.submit(self._pwrite_all, self._bufs[i], padded, self._flushed)
        self._flushed += n
        self._cur, self._fill = 1 - i, 0
        fut = self._pending[self._cur]
        if fut is not None:
            fut.result()
            self._pending[self._cur] = None

    def write(self, data: memoryview) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        i, n = 0, len(src)
        while i < n:
            k = min(n - i, self.STAGING - self._fill)
            self._arrs[self._cur][self._fill : self._fill + k] = src[i : i + k]
            self._fill += k
            i += k
            if self._fill == self.STAGING:
                self._submit()
        self.bytes_written += n

    def close(self) -> None:
        try:
            if self._fill:
                self._submit()  # the tail is padded to ALIGN, then truncated below
            for j, fut in enumerate(self._pending):
                if fut is not None:
                    fut.result()
                    self._pending[j] = None
            os.ftruncate(self.fd, self.bytes_written)
            os.fsync(self.fd)
        finally:
            self._release()

    def abort(self) -> None:
        for fut in self._pending:
            if fut is not None:
                try:
                    fut.result()
                except OSError:
                    pass
        self._release()

    def _release(self) -> None:
        self._pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._arrs = []
        for b in self._bufs:
            b.close()
        self._bufs = []


class _Reader:
    """Positional reads straight into the caller's memory (no intermediate copy)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{path}: file listed in the manifest is missing") from e
        self.size = os.fstat(self.fd).st_size
        self.bytes_read = 0
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
        self.bytes_read += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
