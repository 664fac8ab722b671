"""Storage: the one place that touches files.

Save and load only talk to a :class:`Storage`. :class:`LocalStorage` is the POSIX fast path
(pread, O_DIRECT writes, fsync, atomic rename); :class:`unickpt.io.objstore.ObjectStorage`
serves fsspec URLs (``s3://``, ``memory://``, ``gs://``...). Each declares its
:class:`Capabilities`; :func:`storage_for` picks one from a path.
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from typing import Any, Mapping, Protocol

from ..errors import DistributedError, InvalidArgumentError
from ..format import Hasher
from .capabilities import Capabilities
from .local import LocalStorage


__all__ = ["Storage", "RenameStorage", "MarkerStorage", "Paths", "Namespace", "ByteReader", "FileWriter", "ExtentWriter", "RandomReader", "storage_for", "join_path", "per_node", "is_url"]


class ExtentWriter(Protocol):
    """Positional writer into an existing file (created and sized by its owner).

    ``write_at`` may be called with any offsets; contiguous calls are merged. With O_DIRECT
    only whole aligned pages reach the disk: bytes of partial pages at run edges come back
    from ``close()`` as *fragments* ``(offset, bytes)``, to be merged by the file's owner
    with :meth:`Storage.finish_file` (several ranks may write disjoint ranges of one file).

    ``stable=True`` promises that ``data`` stays unchanged until ``close()`` or ``abort()``
    returns: a writer may then write straight from it, after ``write_at`` has returned,
    instead of copying it first (the O_DIRECT writer does where the memory's page offset
    matches the file's). Without it the writer is done with ``data`` when ``write_at``
    returns.
    """

    path: str
    bytes_written: int
    direct: bool

    def write_at(self, offset: int, data: memoryview, stable: bool = False) -> None: ...
    def close(self) -> list[tuple[int, bytes]]: ...
    def abort(self) -> None: ...


class RandomReader(Protocol):
    path: str
    size: int
    bytes_read: int

    def readinto(self, offset: int, out: memoryview) -> None: ...
    def close(self) -> None: ...


class Paths(Protocol):
    """Paths in the storage's own terms (absolute local paths, or URLs), built only here."""

    def join(self, *parts: str) -> str: ...
    def parent(self, path: str) -> str: ...
    def basename(self, path: str) -> str: ...


class Namespace(Protocol):
    """What exists where: checks, listings, creation and removal of directories (prefixes)
    and files (objects)."""

    def exists(self, path: str) -> bool: ...
    def isdir(self, path: str) -> bool: ...
    def isfile(self, path: str) -> bool: ...
    def listdir(self, path: str) -> list[str]: ...
    def file_sizes(self, path: str) -> dict[str, int]: ...
    def identity(self, path: str) -> tuple | None: ...
    def mtime(self, path: str) -> float: ...
    def makedirs(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def remove_file(self, path: str) -> None: ...


class ByteReader(Protocol):
    """Reads: small files whole (bounded), data files by ranges into the caller's memory."""

    def read_bytes(self, path: str, limit: int) -> bytes: ...
    def open_reader(self, path: str) -> RandomReader: ...


class FileWriter(Protocol):
    """Writes: small files whole (durable when it returns), data files sized by their owner
    and written by ranges by their holders (:class:`ExtentWriter`), page fragments merged by
    the owner."""

    def write_bytes(self, path: str, data: bytes) -> None: ...
    def create_file(self, path: str, size: int) -> None: ...
    def open_writer(self, path: str, *, direct: bool | None = None, size: int | None = None) -> ExtentWriter: ...
    def finish_file(self, path: str, fragments: list[tuple[int, bytes]], size: int) -> None: ...


class Storage(Paths, Namespace, ByteReader, FileWriter, Protocol):
    """What save, load and the write transaction (:mod:`unickpt.io.commit`) need of every
    store: its paths, namespace, reads and writes (one protocol per role above); a store with
    ``caps.atomic_rename`` is also a :class:`RenameStorage`, one without a
    :class:`MarkerStorage` (the transaction's two publish strategies use one each).

    Paths are strings in the storage's own terms (absolute local paths, or URLs), built only
    with ``join``/``parent``/``basename``. Who calls what:

    * **plan** reads ``caps``.
    * **transaction** (the coordinator rank: rank 0, or each node's first rank for
      ``{node}`` paths) calls ``isdir``/``isfile``/``exists``/``listdir``/``identity``/
      ``mtime``/``makedirs`` to check and record the destination, ``write_bytes`` for small
      files (durable when it returns), ``lock``/``rename_dir``/``exchange_dirs``/
      ``fsync_dir`` to publish (:class:`RenameStorage`) or ``put_marker`` (:class:`MarkerStorage`),
      ``remove_tree``/``remove_file`` to abort, sweep and retire.
    * **writers** (every rank that owns or holds data of a file): the file's owner calls
      ``create_file`` (sized, so holders can open it; nothing on object stores), each writer
      ``open_writer`` then ``write_at``... and ``close()`` (its bytes are durable when close
      returns; on object stores the object exists when its single writer closes), the owner
      ``finish_file`` with the partial O_DIRECT pages other writers returned (durable when it
      returns), and ``close()`` on the storage to release shared buffers.
    * **loads** call ``read_bytes`` (the manifest and small files, bounded) and
      ``open_reader`` (ranged reads into the caller's memory) and ``file_sizes`` (one listing).

    Reads open only regular files (objects), never through a symbolic link, and never block
    on FIFOs or devices: anything else is a :class:`~unickpt.errors.FormatError` naming the
    path; a missing one is :class:`~unickpt.errors.CheckpointNotFoundError`; any other
    failure of the store is :class:`~unickpt.errors.StorageError` naming the path.
    ``listdir`` lists real entries; ``isdir`` is false for a link to a directory.
    ``rename_dir`` never replaces an existing destination
    (:class:`~unickpt.errors.CheckpointExistsError`); ``exchange_dirs`` swaps two directories
    atomically or returns False where the store cannot.
    """

    caps: Capabilities

    def close(self) -> None: ...


class RenameStorage(Storage, Protocol):
    """A store with ``atomic_rename`` (POSIX): the write transaction publishes by renaming a
    temporary directory into place (:class:`~unickpt.io.commit.RenamePublish`), under a lock
    of the parent directory, and makes the rename durable with ``fsync_dir``."""

    def rename_dir(self, src: str, dst: str) -> None: ...
    def exchange_dirs(self, a: str, b: str) -> bool: ...
    def fsync_dir(self, path: str) -> None: ...
    def lock(self, path: str, timeout_s: float | None = None) -> contextlib.AbstractContextManager: ...


class MarkerStorage(Storage, Protocol):
    """A store without ``atomic_rename`` (object stores): the write transaction commits by
    ``put_marker`` (the manifest, put conditionally), finds a write's objects with
    ``list_objects`` and deletes them in batches with ``remove_files``."""

    def put_marker(self, path: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> None: ...
    def list_objects(self, path: str) -> list: ...
    def remove_files(self, paths: list[str]) -> None: ...


NODE = "{node}"


def per_node(path: str | os.PathLike) -> bool:
    """True when ``path`` names node-local storage: it contains ``{node}``."""
    return NODE in os.fspath(path)


def compared_path(path: str | os.PathLike) -> str:
    """The part of a checkpoint path that every rank of a save or load must give alike, in one
    spelling: a local directory as an absolute path; a URL less its user, password, query
    and fragment (a digest of them instead: the comparison's message reaches every rank); on
    node-local storage (``{node}``) only what follows ``{node}``, since each node's root may
    lie elsewhere (a memory tier under another directory per node, as two "nodes" on one
    host have it)."""
    p = os.fspath(path)
    if NODE in p:
        p = "{node}" + os.path.normpath(p.split(NODE, 1)[1] or ".")
    elif "://" in p:  # a URL: the same spelling, less what may hold credentials (shown to every rank)
        u = urllib.parse.urlsplit(p)
        rest = "".join(x for x in (u.username or "", u.password or "", u.query, u.fragment))
        p = f"{u.scheme}://{u.netloc.rpartition('@')[2]}{u.path}"
        if rest:
            p += f" (+ xxh3 {Hasher.of(rest.encode())} of its credentials and query)"
    else:  # one spelling of a local directory: relative or not, a trailing slash or not
        p = os.path.abspath(p)
    return p


def expand_node(path: str | os.PathLike) -> str:
    """``{node}`` replaced by this process's node identity (see :func:`unickpt.transport.node_id`)."""
    from ..transport import node_id

    p = os.fspath(path)
    if NODE not in p:
        return p
    n = node_id()
    if not n or "/" in n or n in (".", "..") or "\0" in n:
        raise DistributedError(f"node identity {n!r} cannot name a directory in {p!r} (set UNICKPT_NODE_ID)")
    return p.replace(NODE, n)


def storage_for(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> tuple["Storage", str]:
    """The storage for ``path`` and the path in that storage's terms (``{node}`` expanded).
    ``storage_options`` go to the fsspec file system of a URL (ignored for local paths)."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str) or not os.fspath(path):
        raise InvalidArgumentError(f"a checkpoint path must be a non-empty str or os.PathLike, got {path!r}")
    p = expand_node(path)
    if is_url(p):
        scheme, rest = p.split("://", 1)
        if scheme == "file":  # always the local fast path (links are never followed there)
            return LocalStorage(), os.path.abspath(rest)
        rest = rest.rstrip("/")
        parts = rest.split("/")
        if not rest or "" in parts or any(x in (".", "..") for x in parts):
            raise InvalidArgumentError(f"{p!r}: a URL needs a path of non-empty names after {scheme}:// (no '//', "
                                       "'.' or '..'), e.g. s3://bucket/run")
        where = "/".join([parts[0].rpartition("@")[2], *parts[1:]])  # (not the credentials a URL may carry)
        bad = sorted({c for c in where if c in URL_SPECIAL or _unusable(ord(c))})
        if bad:  # a client would read them as a query, fragment, escape or pattern: refused before any write
            raise InvalidArgumentError(
                f"{p!r}: characters {''.join(bad)!r} in an object-store path are read specially by the clients (a "
                "query, a fragment, an escape, a glob pattern, a control character, a surrogate or a Unicode "
                "non-character): a checkpoint saved under "
                "such a key could not be found again; use letters, digits and - _ . + = @ , : ! $ & ' ( ) space")
        from .objstore import object_storage

        return object_storage(p, storage_options), f"{scheme}://{rest}"
    return LocalStorage(), os.path.abspath(p)


URL_SPECIAL = frozenset('?#%*[]{}\\^~`"<>|')
"""Characters refused in object-store paths: URL syntax (``?``, ``#``, ``%``), glob patterns
fsspec expands (``*``, ``[``, ``]``), and what obstore percent-encodes (``\\ { } ^ ~ ` " < > |``),
beside control characters. Everything else (Unicode included) is stored and found again."""


def _unusable(cp: int) -> bool:
    """Code points no object key may hold: control characters, surrogates (not UTF-8) and
    Unicode non-characters (XML 1.0, which S3's delete requests are, cannot carry them: such a
    checkpoint commits, but nothing of it can ever be deleted)."""
    return (cp < 0x20 or cp == 0x7F or 0xD800 <= cp <= 0xDFFF or 0xFDD0 <= cp <= 0xFDEF
            or (cp & 0xFFFE) == 0xFFFE)


def join_path(root: str | os.PathLike, name: str) -> str:
    """``root/name`` for a local path or a URL, as the caller gave it (``{node}`` kept)."""
    r = os.fspath(root)
    return r.rstrip("/") + "/" + name if is_url(r) else os.path.join(r, name)


def is_url(path: str | os.PathLike) -> bool:
    """``scheme://...`` (an fsspec URL)."""
    p = os.fspath(path)
    i = p.find("://")
    return i > 0 and p[:i].replace("+", "").replace("-", "").replace(".", "").isalnum()


