"""The :class:`~unickpt.io.storage.Storage` of an object store (:class:`ObjectStorage`): paths are
URLs, files are objects written by one writer in parts and read by ranges, the commit is a
conditional put of the manifest."""

from __future__ import annotations

import errno
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np

from ...errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, InvalidArgumentError, StorageError
from ..capabilities import Capabilities
from .clients import CONCURRENCY, Conflict, DEFAULT_S3_CLIENT, MAX_PARTS, Meta, S3_CLIENTS, Client, Upload, ident, make_client, typed, check_options, parse_options


PART = 32 << 20
"""Bytes per multipart part (S3 wants at least 5 MiB; a part is the unit of parallel upload)."""


READ_CHUNK = 16 << 20
"""Bytes per ranged GET: a long read is cut into chunks fetched concurrently."""


class ObjectStorage:
    """A :class:`~unickpt.io.storage.Storage` over an object store. Paths are URLs."""

    def __init__(self, client: Client, scheme: str) -> None:
        self.client, self.scheme = client, scheme
        self.caps = Capabilities(atomic_rename=False, shared_writes=False, process_local=scheme == "memory")
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._inflight = threading.BoundedSemaphore(CONCURRENCY * 2)
        self._free: list[bytearray] = []  # part buffers kept for reuse (fresh memory costs several copies)

    def _take(self, n: int) -> bytearray:
        if self.client.copies_parts:
            with self._pool_lock:
                for i, b in enumerate(self._free):
                    if len(b) == n:
                        return self._free.pop(i)
        return bytearray(n)

    def _give(self, buf) -> None:
        b = buf.obj if isinstance(buf, memoryview) else buf
        if self.client.copies_parts and isinstance(b, bytearray) and len(b) >= PART:
            with self._pool_lock:
                if len(self._free) < 2 * CONCURRENCY + 2:
                    self._free.append(b)

    def __repr__(self) -> str:
        return f"ObjectStorage({self.scheme}://, client={self.client.name})"

    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="unickpt-object")
            return self._pool

    # paths
    def join(self, *parts: str) -> str:
        out = parts[0].rstrip("/")
        for p in parts[1:]:
            out = out + "/" + p.strip("/")
        return out

    def _root_len(self, path: str) -> int:
        rest = path.split("://", 1)[1] if "://" in path else path
        bucket = rest.split("/", 1)[0]
        return len(path) - len(rest) + len(bucket)

    def parent(self, path: str) -> str:
        path = path.rstrip("/")
        i = path.rfind("/")
        return path if i < self._root_len(path) else path[:i]

    def basename(self, path: str) -> str:
        return path.rstrip("/").rsplit("/", 1)[-1]

    def _k(self, url: str) -> str:
        return self.client.key(url)

    # queries
    def exists(self, path: str) -> bool:
        return self.isfile(path) or self.isdir(path)

    def isdir(self, path: str) -> bool:
        """A prefix holding at least one object."""
        with typed(path, "listing"):
            return self.client.nonempty(self._k(path))

    def isfile(self, path: str) -> bool:
        with typed(path, "head"):
            return self.client.head(self._k(path)) is not None

    def listdir(self, path: str) -> list[str]:
        with typed(path, "listing"):
            return self.client.children(self._k(path))

    def list_objects(self, path: str) -> list[Meta]:
        """Every object under prefix ``path`` (recursive); keys relative to ``path``."""
        base = self._k(path).rstrip("/")
        with typed(path, "listing"):
            found = self.client.list(base)
        out = []
        for m in found:
            rel = m.key[len(base):].lstrip("/") if m.key.startswith(base) else m.key
            out.append(Meta(rel, m.size, m.etag, m.mtime))
        return out

    def identity(self, path: str) -> tuple | None:
        with typed(path, "head"):
            m = self.client.head(self._k(path))
        return None if m is None else (m.size, ident(m))

    def mtime(self, path: str) -> float:
        objs = self.list_objects(path)
        return max((m.mtime for m in objs), default=0.0)

    def file_sizes(self, path: str) -> dict[str, int]:
        """Size of each object directly under prefix ``path``, from one listing."""
        return {m.key: m.size for m in self.list_objects(path) if "/" not in m.key}

    # writes
    def makedirs(self, path: str) -> None:
        """Prefixes need no creation."""

    def remove_tree(self, path: str) -> None:
        objs = self.list_objects(path)
        with typed(path, "delete"):
            self.client.delete([self._k(self.join(path, m.key)) for m in objs])

    def remove_file(self, path: str) -> None:
        with typed(path, "delete"):
            self.client.delete([self._k(path)])

    def remove_files(self, paths: list[str]) -> None:
        if paths:
            with typed(paths[0], "delete"):
                self.client.delete([self._k(p) for p in paths])

    def write_bytes(self, path: str, data: bytes) -> None:
        with typed(path, "put"):
            self.client.put(self._k(path), data)

    def put_marker(self, path: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> None:
        """Put ``data`` only if the object is absent (``if_absent``) or still has the identity
        ``if_match``: :class:`CheckpointExistsError` otherwise. Without server-side conditions
        (the client's ``conditional`` False) the check and the put are two steps."""
        try:
            with typed(path, "conditional put"):
                self.client.put(self._k(path), data, if_absent=if_absent,
                                if_match=if_match if self.client.conditional else None)
        except Conflict:
            raise CheckpointExistsError(f"{path}: another write committed here while this one was running; "
                                        "nothing of this one was published") from None

    def read_bytes(self, path: str, limit: int) -> bytes:
        k = self._k(path)
        with typed(path, "read"):
            m = self.client.head(k)
            if m is None:
                raise CheckpointNotFoundError(f"{path}: no such object")
            if m.size > limit:
                raise FormatError(f"{path}: {m.size} bytes, larger than the {limit} bytes allowed for this file")
            if m.size == 0:
                return b""
            data = bytes(self.client.get_ranges(k, [0], [m.size])[0])
            after = self.client.head(k)
        if len(data) != m.size or after is None or ident(after) != ident(m):
            from ...errors import CheckpointChangedError

            raise CheckpointChangedError(f"{path}: the object changed while it was read; read it again")
        return data

    def create_file(self, path: str, size: int) -> None:
        """Nothing to create: the object appears when its writer closes."""

    def open_writer(self, path: str, *, direct: bool | None = None, size: int | None = None) -> "_ObjectWriter":
        if direct:
            raise InvalidArgumentError(f"{path}: direct_io=True needs a local file system")
        return _ObjectWriter(self, path, size)

    def finish_file(self, path: str, fragments: list, size: int) -> None:
        if fragments:
            raise StorageError(errno.EINVAL, "an object has exactly one writer; fragments from other ranks", path)

    def open_reader(self, path: str) -> "_ObjectReader":
        return _ObjectReader(self, path)

    def close(self) -> None:
        """Nothing held between saves (the part pool is kept for the next one)."""


class _ObjectWriter:
    """An object assembled from positional writes into parts of ``part`` bytes.

    A part is uploaded (in a background thread) as soon as every byte of it has been
    written; writes may come in any order (a quantized tensor's codes and scales
    interleave). Clients that take parts only in order get them in order (finished parts
    wait in memory for their predecessors). An object of at most one part is a single put.
    Memory: the parts being filled plus at most ``2 x CONCURRENCY`` parts in flight per store.
    """

    direct = False

    def __init__(self, storage: ObjectStorage, path: str, size: int | None) -> None:
        self.s, self.path, self.size = storage, path, size
        self.part = PART if not size else max(PART, -(-size // MAX_PARTS))
        self.bytes_written = 0
        self._bufs: dict[int, bytearray] = {}
        self._filled: dict[int, int] = {}
        self._ready: dict[int, bytearray] = {}  # complete parts waiting for predecessors (in-order clients)
        self._next = 0  # next part an in-order client takes
        self._upload: Upload | None = None
        self._futs: list[Future] = []
        self._end = 0
        self._error: BaseException | None = None
        self._done = False

    def _part_len(self, i: int) -> int:
        if self.size is None:
            return self.part
        return max(0, min(self.part, self.size - i * self.part))

    def write_at(self, offset: int, data, stable: bool = False) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        if self.size is not None and offset + n > self.size:
            raise StorageError(errno.EINVAL, f"write of {n} bytes at {offset} runs past the planned size {self.size}",
                               self.path)
        pos = 0
        while pos < n:
            i, within = divmod(offset + pos, self.part)
            k = min(n - pos, self.part - within)
            buf = self._bufs.get(i)
            if buf is None:
                if i < self._next and not self.s.client.parallel_parts:
                    raise StorageError(errno.EINVAL, f"write to part {i} after it was uploaded", self.path)
                plen = self._part_len(i) or self.part
                buf = self._bufs[i] = self.s._take(self.part) if plen == self.part else bytearray(plen)
                self._filled[i] = 0
            buf[within : within + k] = view[pos : pos + k]
            self._filled[i] += k
            pos += k
            if self._filled[i] == (self._part_len(i) if self.size is not None else self.part):
                self._complete(i)
        self.bytes_written += n
        self._end = max(self._end, offset + n)

    def _complete(self, i: int) -> None:
        buf = self._bufs.pop(i)
        self._filled.pop(i)
        if self.size is not None and self.size <= self.part:  # one part: a single put at close
            self._ready[i] = buf
            return
        if self.s.client.parallel_parts:
            self._send(i, buf)
            return
        self._ready[i] = buf
        while self._next in self._ready:
            self._send(self._next, self._ready.pop(self._next))
            self._next += 1

    def _send(self, i: int, buf) -> None:
        self._raise()
        if self._upload is None:
            with typed(self.path, "starting a multipart upload"):
                self._upload = self.s.client.upload(self.s._k(self.path), self.part)
        if not self.s.client.parallel_parts:  # in order, on this thread (the client overlaps parts itself)
            with typed(self.path, f"upload of part {i}"):
                self._upload.part(i, buf)
            self.s._give(buf)
            return
        self.s._inflight.acquire()  # bounds the parts held in memory
        up = self._upload

        def run() -> None:
            try:
                with typed(self.path, f"upload of part {i}"):
                    up.part(i, buf)
                self.s._give(buf)
            finally:
                self.s._inflight.release()

        self._futs.append(self.s.pool().submit(run))

    def _raise(self) -> None:
        for f in [f for f in self._futs if f.done()]:
            self._futs.remove(f)
            if f.exception() is not None and self._error is None:
                self._error = f.exception()
        if self._error is not None:
            raise self._error

    def close(self) -> list:
        """Upload what is left and complete the object: it exists, whole, when this returns."""
        try:
            size = self.size if self.size is not None else self._end
            last = -(-size // self.part) if size else 0
            if self.bytes_written != size or (self.size is not None and self._bufs):
                raise StorageError(errno.EIO, f"{self.bytes_written} bytes written of {size}: the object would have "
                                   "holes", self.path)
            if self._upload is None and not self._futs and self._next == 0 and len(self._bufs) + len(self._ready) <= 1:
                buf = (list(self._bufs.values()) + list(self._ready.values()) or [bytearray()])[0]
                with typed(self.path, "put"):
                    self.s.client.put(self.s._k(self.path), memoryview(buf)[:size])
                self.s._give(buf)
                self._bufs.clear()
                self._ready.clear()
                self._done = True
                return []
            for i in sorted(self._bufs):  # the last (short) part; unknown sizes end here
                buf = self._bufs.pop(i)
                n = (size - i * self.part) if i == last - 1 else len(buf)
                self._filled.pop(i, None)
                if self.s.client.parallel_parts:
                    self._send(i, memoryview(buf)[:n])
                else:
                    self._ready[i] = memoryview(buf)[:n]
            while self._next in self._ready:
                self._send(self._next, self._ready.pop(self._next))
                self._next += 1
            for f in self._futs:
                f.exception()
            self._raise()
            if self._ready:  # (cannot happen: every part before the last was complete)
                raise StorageError(errno.EIO, "parts left unwritten", self.path)
            with typed(self.path, "completing the multipart upload"):
                self._upload.complete()
            self._done = True
            return []
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        for f in self._futs:
            f.exception()
        self._bufs.clear()
        self._ready.clear()
        if self._upload is not None:
            try:
                self._upload.abort()
            except Exception:
                pass


class _ObjectReader:
    """Ranged reads into the caller's memory; a long read is cut into ``READ_CHUNK`` ranges
    fetched concurrently."""

    def __init__(self, storage: ObjectStorage, path: str) -> None:
        self.s, self.path = storage, path
        self.key = storage._k(path)
        with typed(path, "head"):
            m = storage.client.head(self.key)
        if m is None:
            raise CheckpointNotFoundError(f"{path}: file listed in the manifest is missing")
        self.size = m.size
        self.bytes_read = 0
        self._lock = threading.Lock()

    def readinto(self, offset: int, out) -> None:
        out = memoryview(out).cast("B")
        n = len(out)
        if offset < 0 or offset + n > self.size:
            raise FormatError(f"{self.path}: read of {n} bytes at {offset} runs past the end ({self.size} bytes)")
        if n == 0:
            return
        dst = np.frombuffer(out, dtype=np.uint8)
        every = list(range(offset, offset + n, READ_CHUNK))
        for i in range(0, len(every), 2 * CONCURRENCY):  # bounded: at most 2 x CONCURRENCY chunks in memory
            starts = every[i : i + 2 * CONCURRENCY]
            ends = [min(s + READ_CHUNK, offset + n) for s in starts]
            with typed(self.path, "ranged read"):
                got = self.s.client.get_ranges(self.key, starts, ends)
            for s, e, b in zip(starts, ends, got):
                b = memoryview(b).cast("B")
                if len(b) != e - s:
                    raise FormatError(f"{self.path}: unexpected end of object at byte {s + len(b)}")
                dst[s - offset : e - offset] = np.frombuffer(b, dtype=np.uint8)
        with self._lock:
            self.bytes_read += n

    def close(self) -> None:
        pass


_CACHE: dict[tuple, ObjectStorage] = {}


_CACHE_LOCK = threading.Lock()


def object_storage(url: str, storage_options: Mapping[str, Any] | None = None) -> ObjectStorage:
    """The storage for URL ``url`` (cached per scheme, bucket and options)."""
    scheme = url.split("://", 1)[0]
    if storage_options is None and os.environ.get("UNICKPT_STORAGE_OPTIONS"):
        storage_options = parse_options(os.environ["UNICKPT_STORAGE_OPTIONS"], "UNICKPT_STORAGE_OPTIONS")
    elif storage_options is not None:
        check_options(storage_options, "storage_options")
    opts = dict(storage_options or {})
    client_name = opts.pop("client", None)
    if scheme in ("s3", "s3a"):
        client_name = client_name or os.environ.get("UNICKPT_S3_CLIENT") or DEFAULT_S3_CLIENT
        if client_name not in S3_CLIENTS:
            raise InvalidArgumentError(f"storage_options client={client_name!r}: expected one of {S3_CLIENTS}")
    elif client_name not in (None, "fsspec"):
        raise InvalidArgumentError(f"{scheme}:// is served by fsspec; client={client_name!r} is for s3:// only")
    bucket = url.split("://", 1)[1].split("/", 1)[0] if client_name == "obstore" else ""
    env = tuple(os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_DEFAULT_REGION"))
    key = (scheme, client_name, bucket, json.dumps(opts, sort_keys=True, default=str), env)
    with _CACHE_LOCK:
        st = _CACHE.get(key)
        if st is None:
            st = _CACHE[key] = ObjectStorage(make_client(scheme, client_name, bucket, opts, url), scheme)
    return st

