"""The clients of object stores, one interface (:class:`Client`) over obstore, s3fs and any fsspec
file system: every call bounded in time, listings bounded in size, conditional puts, multipart
uploads; the options of a URL parsed and checked."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import errno
import inspect
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from ...errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, InvalidArgumentError, StorageError


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
def typed(url: str, what: str):
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


class Client:
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
    def upload(self, key: str, part_size: int) -> "Upload": ...


class Upload:
    """One object written in parts: ``part(i, data)`` (0-based; in order unless the client
    has ``parallel_parts``), then ``complete()`` (the object exists and is durable) or
    ``abort()`` (it never appears)."""

    def part(self, index: int, data) -> None: ...
    def complete(self) -> None: ...
    def abort(self) -> None: ...


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
    """A listing beyond :data:`LIST_MAX` objects (``typed`` makes it a StorageError naming the URL)."""


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


class _FsspecClient(Client):
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
                if if_match is not None and (cur is None or ident(cur) != if_match):
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


class _StreamUpload(Upload):
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


def ident(m: Meta) -> str:
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


class _S3fsUpload(Upload):
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


class _ObstoreClient(Client):
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


class _ObstoreUpload(Upload):
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


def make_client(scheme: str, client_name: str | None, bucket: str, opts: dict, url: str) -> Client:
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

