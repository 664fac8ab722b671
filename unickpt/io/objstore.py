"""Object stores: the :class:`~unickpt.io.storage.Storage` interface over fsspec URLs and S3.

Paths are URLs (``s3://bucket/prefix/step-00000100``, ``memory://ckpt``); a "directory" is a
key prefix. What an object store cannot do (rename a directory, let several ranks write one
object) is declared in :attr:`ObjectStorage.caps`; the planner and the write transaction
(:mod:`unickpt.io.commit`) read those and use a commit marker written last instead of a
rename, and one writer per object (nor can it lock: :meth:`ObjectStorage.lock` does nothing).

Three clients sit behind one small :class:`_Client` interface:

* ``obstore`` (the default for ``s3://``; Rust ``object_store``): parallel multipart uploads
  from memory, concurrent ranged reads, conditional puts;
* ``s3fs`` (fsspec's S3 file system): the same, with parts uploaded by a thread pool;
* any other fsspec file system (``memory://``, ``gs://``, ``az://``, ``file://``...): ranged
  reads through ``cat_ranges``, writes streamed in order.

Data are sent from and read into memory: nothing is staged in a local temporary file.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import errno
import inspect
import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, InvalidArgumentError, StorageError
from .capabilities import Capabilities


__all__ = ["ObjectStorage", "object_storage", "PART", "READ_CHUNK"]

PART = 32 << 20
"""Bytes per multipart part (S3 wants at least 5 MiB; a part is the unit of parallel upload)."""
READ_CHUNK = 16 << 20
"""Bytes per ranged GET: a long read is cut into chunks fetched concurrently."""
MAX_PARTS = 9000  # S3 allows 10,000 parts per object; larger objects get larger parts
CONCURRENCY = int(os.environ.get("UNICKPT_OBJECT_CONCURRENCY", "8"))
S3_CLIENTS = ("obstore", "s3fs")
DEFAULT_S3_CLIENT = "obstore"
"""Faster of the two on the loopback S3 server (bench/storage.py; docs/performance.md)."""
def _object_timeout() -> float:
    v = os.environ.get("UNICKPT_OBJECT_TIMEOUT_S", "").strip() or "60"
    try:
        t = float(v)
    except ValueError:
        t = float("nan")
    if not 0.1 <= t <= 86400:
        raise InvalidArgumentError(f"UNICKPT_OBJECT_TIMEOUT_S must be seconds between 0.1 and 86400, got {v!r}")
    return t


OBJECT_TIMEOUT = _object_timeout()
"""Seconds one call to the store may take, retries included, before it fails
(``UNICKPT_OBJECT_TIMEOUT_S``, default 60): a server that accepts connections and never
answers fails each call after about this long, with either S3 client (docs/storage.md)."""
S3FS_ATTEMPTS = 3
"""s3fs (botocore): attempts per call, each with a read timeout of ``OBJECT_TIMEOUT / 3``;
s3fs's own retry loop (5 more rounds of botocore's, 17-20 minutes against a silent server)
is off."""
CONNECT_TIMEOUT = 10.0
"""Seconds to open a connection (capped by the attempt's share of ``OBJECT_TIMEOUT``)."""
CALL_SLACK = 5.0
"""Seconds beyond ``OBJECT_TIMEOUT`` a whole call of an asynchronous fsspec client (s3fs:
its attempts and botocore's backoff between them) may take before it is cancelled."""
LIST_MAX = 500_000
"""Objects one listing may return: a server answering page after page without end fails the
listing (:class:`StorageError`) before it fills the memory."""
LIST_SECONDS_PER_OBJECT_TIMEOUT = 10
"""A whole listing (every page) may take this many ``OBJECT_TIMEOUT`` s."""


class Conflict(Exception):
    """A conditional put found the object in another state than required."""


@dataclass(frozen=True)
class Meta:
    key: str  # client key (no scheme)
    size: int
    etag: str | None
    mtime: float


def _ts(v) -> float:
    if isinstance(v, _dt.datetime):
        return v.timestamp()
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


@contextlib.contextmanager
def _typed(url: str, what: str):
    """Client errors as unickpt errors naming the URL."""
    try:
        yield
    except (Conflict, CheckpointNotFoundError, CheckpointExistsError, StorageError, FormatError, InvalidArgumentError):
        raise
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{url}: not found ({what}: {e})") from None
    except PermissionError as e:
        raise StorageError(errno.EACCES, f"{what}: permission denied ({e}); check the credentials "
                           "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or storage_options)", url) from None
    except Exception as e:
        if _is_conflict(e):
            raise Conflict(str(e)) from None
        if _is_not_found(e):
            raise CheckpointNotFoundError(f"{url}: not found ({what}: {e})") from None
        raise StorageError(errno.EIO, f"{what} failed: {type(e).__name__}: {_first_line(e)}", url) from None


def _is_conflict(e: BaseException) -> bool:
    name = type(e).__name__
    if name in ("AlreadyExistsError", "PreconditionError", "FileExistsError"):
        return True
    resp = getattr(e, "response", None)
    code = ((resp or {}).get("Error") or {}).get("Code", "") if isinstance(resp, dict) else ""
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or "PreconditionFailed" in str(e)


def _is_not_found(e: BaseException) -> bool:
    return type(e).__name__ in ("NotFoundError", "NoSuchKey", "NoSuchBucket")


class _Client:
    """What :class:`ObjectStorage` needs of a store. Keys are the client's own (no scheme)."""

    conditional = False  # put-if-absent / put-if-match, enforced by the server
    parallel_parts = False  # parts may be uploaded concurrently and in any order
    copies_parts = False  # ``part()`` has copied the data when it returns (the buffer may be reused)
    name = "?"

    def key(self, url: str) -> str: ...
    def put(self, key: str, data, *, if_absent: bool = False, if_match: str | None = None) -> None: ...
    def head(self, key: str) -> Meta | None: ...
    def list(self, prefix: str) -> list[Meta]: ...
    def children(self, prefix: str) -> list[str]: ...

    def nonempty(self, prefix: str) -> bool:
        """At least one object under ``prefix``."""
        return bool(self.children(prefix))

    def get_ranges(self, key: str, starts: list[int], ends: list[int]) -> list: ...
    def delete(self, keys: list[str]) -> None: ...
    def upload(self, key: str, part_size: int) -> "_Upload": ...


class _Upload:
    """One object written in parts: ``part(i, data)`` (0-based; in order unless the client
    has ``parallel_parts``), then ``complete()`` (the object exists and is durable) or
    ``abort()`` (it never appears)."""

    def part(self, index: int, data) -> None: ...
    def complete(self) -> None: ...
    def abort(self) -> None: ...


# -- fsspec ---------------------------------------------------------------------------------


class _Bounded:
    """An asynchronous fsspec file system (s3fs, gcsfs, adlfs...) whose every call, retries
    included, ends within ``seconds``: its coroutine runs under ``asyncio.wait_for`` on the
    file system's loop (cancelled at the deadline, an ``FSTimeoutError``). A client's own
    timeouts bound each socket read, not a call: a server that never answers a request with
    a body (``Expect: 100-continue``) or trickles a byte at a time held s3fs for ever.
    Methods without a coroutine twin (``open``, ``invalidate_cache``) are the file
    system's own."""

    def __init__(self, fs, seconds: float) -> None:
        self.fs, self.seconds = fs, seconds

    def __getattr__(self, name: str):
        attr = getattr(self.fs, name)
        twin = getattr(self.fs, "_" + name, None) if not name.startswith("_") else None
        if twin is None or not callable(attr) or not inspect.iscoroutinefunction(twin):
            return attr

        def call(*args, **kwargs):
            return self.run(twin(*args, **kwargs))

        return call

    def run(self, coro):
        from fsspec.asyn import sync

        return sync(self.fs.loop, _within, coro, self.seconds)

    def cat_ranges(self, paths, starts, ends, on_error="raise"):
        """Each range bounded on its own (a call reading many ranges may take longer than one)."""
        from fsspec.asyn import sync

        async def each():
            sem = asyncio.Semaphore(CONCURRENCY)

            async def one(p, a, b):
                async with sem:
                    return await _within(self.fs._cat_file(p, start=a, end=b), self.seconds)

            return await asyncio.gather(*(one(p, a, b) for p, a, b in zip(paths, starts, ends)))

        return sync(self.fs.loop, each)


class ListingTooLong(Exception):
    """A listing beyond :data:`LIST_MAX` objects (``_typed`` makes it a StorageError naming the URL)."""


class CallTimeout(Exception):
    """A call to the store did not end within its bound (not a ``TimeoutError``: fsspec would
    turn that into an ``FSTimeoutError`` without its message)."""


def _bounded_listing(pages, count):
    """The pages of one listing (each counted by ``count``), within :data:`LIST_MAX` objects
    and :data:`LIST_SECONDS_PER_OBJECT_TIMEOUT` x ``OBJECT_TIMEOUT`` s for all of them (each
    request is bounded by its client): a server paging without end fails the listing."""
    import time

    seconds = LIST_SECONDS_PER_OBJECT_TIMEOUT * OBJECT_TIMEOUT
    deadline = time.monotonic() + seconds
    n = 0
    for page in pages:
        n += count(page)
        if n > LIST_MAX:
            raise ListingTooLong(f"the listing holds more than {LIST_MAX} objects (a server that never ends its listing?)")
        if time.monotonic() > deadline:
            raise CallTimeout(f"the listing did not end within {seconds:g} s ({LIST_SECONDS_PER_OBJECT_TIMEOUT} x "
                              "UNICKPT_OBJECT_TIMEOUT_S)")
        yield page


async def _within(coro, seconds: float):
    try:
        return await asyncio.wait_for(coro, seconds)
    except asyncio.TimeoutError:
        raise CallTimeout(f"no answer within {seconds:g} s (UNICKPT_OBJECT_TIMEOUT_S + {CALL_SLACK:g} s)") from None


class _FsspecClient(_Client):
    copies_parts = True  # file objects copy what they are given into their buffer

    def __init__(self, fs, protocol: str) -> None:
        self.fs, self.protocol, self.name = fs, protocol, f"fsspec:{protocol}"
        # memory:// lives in this process: a lock makes its conditional puts atomic
        self._mem_lock = threading.Lock() if protocol == "memory" else None
        self.conditional = self._mem_lock is not None

    def key(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    def put(self, key, data, *, if_absent=False, if_match=None):
        with self._mem_lock or contextlib.nullcontext():
            if if_absent or if_match is not None:
                cur = self.head(key)
                if if_absent and cur is not None:
                    raise Conflict(f"{key} exists")
                if if_match is not None and (cur is None or _ident(cur) != if_match):
                    raise Conflict(f"{key} changed")
            self.fs.pipe_file(key, bytes(data))

    def head(self, key):
        try:
            info = self.fs.info(key)
        except FileNotFoundError:
            return None
        if info.get("type") != "file":
            return None
        return _meta(key, info)

    def list(self, prefix):
        try:
            found = self.fs.find(prefix, detail=True, withdirs=False)
        except FileNotFoundError:
            return []
        return [_meta(k, v) for k, v in found.items() if v.get("type", "file") == "file"]

    def children(self, prefix):
        own = prefix.rstrip("/")
        try:  # (a file lists itself: it has no children)
            return sorted({os.path.basename(p.rstrip("/")) for p in self.fs.ls(prefix, detail=False)
                           if p.rstrip("/") != own})
        except (FileNotFoundError, NotADirectoryError):
            return []

    def get_ranges(self, key, starts, ends):
        if len(starts) == 1:
            return [self.fs.cat_file(key, start=starts[0], end=ends[0])]
        return self.fs.cat_ranges([key] * len(starts), list(starts), list(ends), on_error="raise")

    def delete(self, keys):
        for k in keys:
            try:
                self.fs.rm_file(k)
            except FileNotFoundError:
                pass

    def upload(self, key, part_size):
        return _StreamUpload(self.fs.open(key, "wb"))


class _StreamUpload(_Upload):
    """Parts written in order to a file object; the object appears on ``close``."""

    def __init__(self, f) -> None:
        self.f = f

    def part(self, index, data):
        self.f.write(data)

    def complete(self):
        self.f.close()

    def abort(self):
        discard = getattr(self.f, "discard", None)
        if discard is not None:
            discard()
        else:  # a plain file object: it never reaches the store if we do not close it
            self.f = None


def _meta(key: str, info: Mapping) -> Meta:
    etag = info.get("ETag") or info.get("etag") or info.get("e_tag")
    t = info.get("LastModified") or info.get("mtime") or info.get("created") or info.get("last_modified")
    return Meta(key, int(info.get("size") or 0), str(etag) if etag else None, _ts(t))


def _ident(m: Meta) -> str:
    return m.etag or f"{m.size}:{m.mtime}"


class _S3fsClient(_FsspecClient):
    """s3fs with conditional puts and parallel multipart uploads through its S3 client."""

    parallel_parts = True

    def __init__(self, fs) -> None:
        super().__init__(fs, "s3")
        self.name = "s3fs"
        self.conditional = True  # (the server enforces IfNoneMatch/IfMatch)
        self._buckets: set[str] = set()

    def _bk(self, key: str) -> tuple[str, str]:
        bucket, _, rest = key.partition("/")
        return bucket, rest

    def put(self, key, data, *, if_absent=False, if_match=None):
        bucket, k = self._bk(key)
        kw: dict[str, Any] = {}
        if if_absent:
            kw["IfNoneMatch"] = "*"
        if if_match is not None:
            kw["IfMatch"] = if_match
        self.fs.call_s3("put_object", Bucket=bucket, Key=k, Body=bytes(data), **kw)
        self.fs.invalidate_cache(key)

    def list(self, prefix):
        bucket = self._bk(prefix)[0]
        out = [Meta(f"{bucket}/{o['Key']}", int(o.get("Size") or 0), o.get("ETag"), _ts(o.get("LastModified")))
               for r in self._pages(prefix) for o in r.get("Contents", ())]
        return self._check_bucket(prefix, out)

    def children(self, prefix):
        k = self._bk(prefix.strip("/"))[1]
        cut = len(k) + 1 if k else 0
        names = set()
        for r in self._pages(prefix, delimiter="/"):
            names |= {c["Prefix"][cut:].rstrip("/") for c in r.get("CommonPrefixes", ())}
            names |= {o["Key"][cut:] for o in r.get("Contents", ())}
        return self._check_bucket(prefix, sorted(n for n in names if n and "/" not in n))

    def nonempty(self, prefix):
        return self._check_bucket(prefix, [r for r in self._pages(prefix, first_page=True)
                                           if r.get("Contents") or r.get("CommonPrefixes")]) != []

    def _pages(self, prefix, delimiter: str | None = None, first_page: bool = False):
        """ListObjectsV2 pages under ``prefix`` (one bounded request each), within
        :data:`LIST_MAX` objects and :data:`LIST_SECONDS_PER_OBJECT_TIMEOUT` x
        ``OBJECT_TIMEOUT`` s for the whole listing (s3fs's own listing follows the pages
        without end)."""
        bucket, k = self._bk(prefix.strip("/"))
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": k + "/" if k else ""}
        if delimiter:
            kw["Delimiter"] = delimiter

        def pages():
            while True:
                try:
                    r = self.fs.call_s3("list_objects_v2", **kw)
                except FileNotFoundError:
                    return
                yield r
                if first_page or not r.get("IsTruncated"):
                    return
                if not r.get("NextContinuationToken"):
                    raise ListingTooLong("a truncated listing page without a continuation token")
                kw["ContinuationToken"] = r["NextContinuationToken"]

        return _bounded_listing(pages(), lambda r: len(r.get("Contents", ())) + len(r.get("CommonPrefixes", ())))

    def _check_bucket(self, key: str, listing: list) -> list:
        """``listing``; if empty, a missing bucket is an error, not an empty root."""
        if listing:
            return listing
        bucket = key.split("/", 1)[0]
        if bucket not in self._buckets:
            try:
                self.fs.call_s3("head_bucket", Bucket=bucket)
            except Exception as e:
                raise StorageError(errno.ENOENT, f"bucket {bucket!r} cannot be used: {type(e).__name__}: "
                                   f"{_first_line(e)}", f"s3://{bucket}") from None
            self._buckets.add(bucket)
        return listing

    def head(self, key):
        self.fs.invalidate_cache(key)
        return super().head(key)

    def delete(self, keys):
        if keys:
            self.fs.rm(list(keys))
            for k in keys:
                self.fs.invalidate_cache(k)

    def upload(self, key, part_size):
        return _S3fsUpload(self, key)


class _S3fsUpload(_Upload):
    def __init__(self, client: _S3fsClient, key: str) -> None:
        self.c, self.key = client, key
        self.bucket, self.k = client._bk(key)
        self.id = client.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.k)["UploadId"]
        self.etags: dict[int, str] = {}
        self.lock = threading.Lock()

    def part(self, index, data):
        r = self.c.fs.call_s3("upload_part", Bucket=self.bucket, Key=self.k, UploadId=self.id,
                              PartNumber=index + 1, Body=bytes(data))
        with self.lock:
            self.etags[index] = r["ETag"]

    def complete(self):
        parts = [{"PartNumber": i + 1, "ETag": self.etags[i]} for i in sorted(self.etags)]
        self.c.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self.k, UploadId=self.id,
                          MultipartUpload={"Parts": parts})
        self.c.fs.invalidate_cache(self.key)

    def abort(self):
        self.c.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.k, UploadId=self.id)


# -- obstore --------------------------------------------------------------------------------


class _ObstoreClient(_Client):
    """obstore (Rust object_store) for one bucket."""

    conditional = True
    name = "obstore"

    def __init__(self, bucket: str, options: Mapping[str, Any]) -> None:
        import obstore
        from obstore.store import S3Store

        self.obs, self.bucket = obstore, bucket
        config, client_options = _obstore_config(options)
        # retries (of throttling, 5xx, lost connections) only within OBJECT_TIMEOUT of the first
        # request: a request that itself timed out after OBJECT_TIMEOUT is not retried
        retry = {"max_retries": 4, "retry_timeout": _dt.timedelta(seconds=OBJECT_TIMEOUT)}
        self.store = S3Store(bucket, config=config or None, client_options=client_options or None, retry_config=retry)

    def key(self, url: str) -> str:
        rest = url.split("://", 1)[1]
        bucket, _, k = rest.partition("/")
        return k.strip("/")

    def put(self, key, data, *, if_absent=False, if_match=None):
        mode: Any = None
        if if_absent:
            mode = "create"
        elif if_match is not None:
            mode = {"e_tag": if_match}
        self.obs.put(self.store, key, memoryview(data), mode=mode, use_multipart=False)

    def head(self, key):
        try:
            m = self.obs.head(self.store, key)
        except FileNotFoundError:
            return None
        return Meta(key, int(m["size"]), m.get("e_tag"), _ts(m.get("last_modified")))

    def list(self, prefix):
        return [Meta(m["path"], int(m["size"]), m.get("e_tag"), _ts(m.get("last_modified"))) for m in self._pages(prefix)]

    def children(self, prefix):
        # from the bounded page stream, not list_with_delimiter: that one gathers every page in
        # Rust, so a server that never ends its listing grows the process until it aborts
        p = prefix.strip("/")
        cut = len(p) + 1 if p else 0
        return sorted({m["path"][cut:].split("/", 1)[0] for m in self._pages(prefix) if len(m["path"]) > cut})

    def nonempty(self, prefix):
        return any(True for _ in self._pages(prefix, first_page=True))

    def _pages(self, prefix, first_page: bool = False):
        """Every object under ``prefix``, page by page, within :data:`LIST_MAX` objects and
        :data:`LIST_SECONDS_PER_OBJECT_TIMEOUT` x ``OBJECT_TIMEOUT`` s (each request is bounded
        by the client's own timeout)."""
        p = prefix.strip("/")
        for batch in _bounded_listing(self.obs.list(self.store, prefix=(p + "/") if p else None), len):
            yield from batch
            if first_page:
                return

    def get_ranges(self, key, starts, ends):
        return self.obs.get_ranges(self.store, key, starts=list(starts), ends=list(ends))

    def delete(self, keys):
        if keys:
            self.obs.delete(self.store, list(keys))

    def upload(self, key, part_size):
        return _ObstoreUpload(self.obs.open_writer(self.store, key, buffer_size=part_size, max_concurrency=CONCURRENCY))


class _ObstoreUpload(_Upload):
    def __init__(self, w) -> None:
        self.w = w

    def part(self, index, data):
        self.w.write(memoryview(data))

    def complete(self):
        self.w.close()

    def abort(self):
        self.w = None  # never closed: the multipart upload is not completed, no object appears


_OBSTORE_KEYS = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token",
                 "endpoint_url": "endpoint", "region": "region"}


def _obstore_config(options: Mapping[str, Any]) -> tuple[dict, dict]:
    """s3fs-style storage options (key, secret, token, endpoint_url, client_kwargs) as obstore
    config; the standard AWS environment is read by obstore itself."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for k, v in options.items():
        if k in _OBSTORE_KEYS:
            config[_OBSTORE_KEYS[k]] = v
        elif k == "client_kwargs" and isinstance(v, Mapping):
            for ck, cv in v.items():
                if ck == "endpoint_url":
                    config["endpoint"] = cv
                elif ck == "region_name":
                    config["region"] = cv
                else:
                    raise InvalidArgumentError(f"storage_options client_kwargs[{ck!r}] is not understood by the "
                                               "obstore client (use client='s3fs' for s3fs-specific options)")
        elif k == "config" and isinstance(v, Mapping):
            config.update(v)
        else:
            raise InvalidArgumentError(f"storage_options[{k!r}] is not understood by the obstore client (known: "
                                       f"{sorted(_OBSTORE_KEYS)}, client_kwargs, config; or client='s3fs')")
    endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and str(endpoint).startswith("http://"):
        client["allow_http"] = True
    client.setdefault("timeout", f"{int(OBJECT_TIMEOUT * 1000)}ms")  # a request (a 32 MiB part) that takes longer fails
    client.setdefault("connect_timeout", f"{int(min(CONNECT_TIMEOUT, OBJECT_TIMEOUT) * 1000)}ms")
    return config, client


# -- the storage ----------------------------------------------------------------------------


class ObjectStorage:
    """A :class:`~unickpt.io.storage.Storage` over an object store. Paths are URLs."""

    def __init__(self, client: _Client, scheme: str) -> None:
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
        with _typed(path, "listing"):
            return self.client.nonempty(self._k(path))

    def isfile(self, path: str) -> bool:
        with _typed(path, "head"):
            return self.client.head(self._k(path)) is not None

    def listdir(self, path: str) -> list[str]:
        with _typed(path, "listing"):
            return self.client.children(self._k(path))

    def list_objects(self, path: str) -> list[Meta]:
        """Every object under prefix ``path`` (recursive); keys relative to ``path``."""
        base = self._k(path).rstrip("/")
        with _typed(path, "listing"):
            found = self.client.list(base)
        out = []
        for m in found:
            rel = m.key[len(base):].lstrip("/") if m.key.startswith(base) else m.key
            out.append(Meta(rel, m.size, m.etag, m.mtime))
        return out

    def identity(self, path: str) -> tuple | None:
        with _typed(path, "head"):
            m = self.client.head(self._k(path))
        return None if m is None else (m.size, _ident(m))

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
        with _typed(path, "delete"):
            self.client.delete([self._k(self.join(path, m.key)) for m in objs])

    def remove_file(self, path: str) -> None:
        with _typed(path, "delete"):
            self.client.delete([self._k(path)])

    def remove_files(self, paths: list[str]) -> None:
        if paths:
            with _typed(paths[0], "delete"):
                self.client.delete([self._k(p) for p in paths])

    def write_bytes(self, path: str, data: bytes) -> None:
        with _typed(path, "put"):
            self.client.put(self._k(path), data)

    def put_marker(self, path: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> None:
        """Put ``data`` only if the object is absent (``if_absent``) or still has the identity
        ``if_match``: :class:`CheckpointExistsError` otherwise. Without server-side conditions
        (the client's ``conditional`` False) the check and the put are two steps."""
        try:
            with _typed(path, "conditional put"):
                self.client.put(self._k(path), data, if_absent=if_absent,
                                if_match=if_match if self.client.conditional else None)
        except Conflict:
            raise CheckpointExistsError(f"{path}: another write committed here while this one was running; "
                                        "nothing of this one was published") from None

    def read_bytes(self, path: str, limit: int) -> bytes:
        k = self._k(path)
        with _typed(path, "read"):
            m = self.client.head(k)
            if m is None:
                raise CheckpointNotFoundError(f"{path}: no such object")
            if m.size > limit:
                raise FormatError(f"{path}: {m.size} bytes, larger than the {limit} bytes allowed for this file")
            if m.size == 0:
                return b""
            data = bytes(self.client.get_ranges(k, [0], [m.size])[0])
            after = self.client.head(k)
        if len(data) != m.size or after is None or _ident(after) != _ident(m):
            from ..errors import CheckpointChangedError

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
        self._upload: _Upload | None = None
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
            with _typed(self.path, "starting a multipart upload"):
                self._upload = self.s.client.upload(self.s._k(self.path), self.part)
        if not self.s.client.parallel_parts:  # in order, on this thread (the client overlaps parts itself)
            with _typed(self.path, f"upload of part {i}"):
                self._upload.part(i, buf)
            self.s._give(buf)
            return
        self.s._inflight.acquire()  # bounds the parts held in memory
        up = self._upload

        def run() -> None:
            try:
                with _typed(self.path, f"upload of part {i}"):
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
                with _typed(self.path, "put"):
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
            with _typed(self.path, "completing the multipart upload"):
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
        with _typed(path, "head"):
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
            with _typed(self.path, "ranged read"):
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


# -- construction ---------------------------------------------------------------------------

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
            st = _CACHE[key] = ObjectStorage(_make_client(scheme, client_name, bucket, opts, url), scheme)
    return st


OPTIONS_DEPTH = 32
"""Nesting of storage options allowed (the clients' own options nest two or three levels)."""


def parse_options(text: str, source: str) -> dict:
    """Storage options given as JSON text (``UNICKPT_STORAGE_OPTIONS``, ``--storage-options``):
    a JSON object of at most :data:`OPTIONS_DEPTH` levels, no NaN or infinities, else an
    :class:`~unickpt.errors.InvalidArgumentError` naming ``source`` (never a RecursionError)."""
    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    try:
        opts = json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError) as e:
        raise InvalidArgumentError(f"{source}: not JSON ({str(e)[:200]})") from None
    if not isinstance(opts, dict):
        raise InvalidArgumentError(f"{source}: expected a JSON object such as '{{\"client\": \"s3fs\"}}'")
    check_options(opts, source)
    return opts


def check_options(opts: Any, source: str) -> None:
    """``opts`` is a mapping nested at most :data:`OPTIONS_DEPTH` levels (walked without
    recursion): InvalidArgumentError otherwise."""
    if not isinstance(opts, Mapping):
        raise InvalidArgumentError(f"{source} must be a dict, got {type(opts).__name__}")
    stack: list[tuple[Any, int]] = [(opts, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (Mapping, list, tuple)):
            if depth > OPTIONS_DEPTH:
                raise InvalidArgumentError(f"{source}: nested deeper than {OPTIONS_DEPTH} levels")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, Mapping) else v))


def _make_client(scheme: str, client_name: str | None, bucket: str, opts: dict, url: str) -> _Client:
    if client_name == "obstore":
        try:
            return _ObstoreClient(bucket, opts)
        except ImportError:
            raise StorageError(errno.ENOPKG if hasattr(errno, "ENOPKG") else errno.EINVAL,
                               "the obstore client is not installed (pip install obstore), or choose "
                               "storage_options={'client': 's3fs'}", url) from None
        except (InvalidArgumentError, StorageError):
            raise
        except Exception as e:
            raise StorageError(errno.EINVAL, f"cannot configure the S3 client: {e}", url) from None
    import fsspec

    try:
        # (our own cache is keyed by the AWS environment too; fsspec's instance cache is not)
        fs = fsspec.filesystem(scheme, skip_instance_cache=True,
                               **(_s3fs_defaults(opts) if scheme in ("s3", "s3a") else opts))
    except (ImportError, ValueError) as e:
        from fsspec.registry import known_implementations

        known = known_implementations.get(scheme)
        hint = f" (install it: {known.get('err') or known['class'].split('.')[0]})" if known else \
            " (no fsspec implementation is registered for this scheme)"
        raise StorageError(errno.EINVAL, f"{scheme}:// URLs need an fsspec file system that is not available: "
                           f"{e}{hint}", url) from None
    except TypeError as e:
        raise InvalidArgumentError(f"{url}: storage_options not accepted by {scheme}:// ({e})") from None
    if getattr(fs, "async_impl", False):  # every call bounded as a whole (not only each socket read)
        fs = _Bounded(fs, OBJECT_TIMEOUT + CALL_SLACK)
    if scheme in ("s3", "s3a"):
        if "retries" not in opts:
            fs.fs.retries = 1  # botocore retries (above); s3fs's loop would repeat them 5 times
        return _S3fsClient(fs)
    return _FsspecClient(fs, scheme)


def _s3fs_defaults(opts: dict) -> dict:
    """Bounded timeouts and retries for s3fs unless the caller set them: botocore makes
    :data:`S3FS_ATTEMPTS` attempts of ``OBJECT_TIMEOUT / S3FS_ATTEMPTS`` each, so a silent
    server fails a call after about ``OBJECT_TIMEOUT``, as with obstore (botocore's defaults
    let it hold each call for minutes, and s3fs retries botocore's retries five times)."""
    out = dict(opts)
    ck = dict(out.get("config_kwargs") or {})
    share = OBJECT_TIMEOUT / S3FS_ATTEMPTS
    ck.setdefault("connect_timeout", min(CONNECT_TIMEOUT, share))
    ck.setdefault("read_timeout", share)
    ck.setdefault("retries", {"total_max_attempts": S3FS_ATTEMPTS, "mode": "standard"})
    out["config_kwargs"] = ck
    return out


def _first_line(e: BaseException) -> str:
    """A client's message without its debug dump (obstore appends one)."""
    text = str(e).strip().split("\n", 1)[0]
    return text if len(text) <= 500 else text[:500] + "..."
