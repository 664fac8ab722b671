"""The safetensors files of one write, the one way every writer makes them: a save's ranks
(:mod:`unickpt.saving.writer`), ``reshard``/``convert`` (:mod:`unickpt.offline`) and
``export`` (:mod:`unickpt.export`).

* :func:`split_by_size`: items cut into files of at most ``cap`` bytes (the first item of a
  file always fits: a tensor larger than the cap gets a file of its own);
* :func:`file_name`: ``role-NNNNN-of-NNNNN.safetensors``;
* :func:`pack`: a file's stored tensors in safetensors order, its header and where each
  one goes;
* :func:`file_entry`, :func:`new_manifest`: the manifest's records of what was written;
* :class:`FileSet`: files created at full size (so several writers can fill one in place),
  opened (framed by zstd where asked), written by offset into their data section, closed
  (fsynced), with the page fragments of O_DIRECT writes handed to the file's owner and
  merged there (:meth:`FileSet.finish`).
"""

from __future__ import annotations

import datetime as _dt
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Sequence, TypeVar

from .._version import __version__
from ..container import ZstdWriter, elements_of
from ..format import Hasher, TensorInfo, build_header, order_key
from ..manifest import FileEntry, Manifest


if TYPE_CHECKING:  # (the planner uses the functions without any storage)
    from .storage import ExtentWriter, Storage

__all__ = ["FileSet", "file_entry", "file_name", "pack", "new_manifest", "split_by_size"]

T = TypeVar("T")


def split_by_size(items: Iterable[T], size_of: Callable[[T], int], cap: int | None) -> list[list[T]]:
    """``items`` in order, cut before an item that would take a file beyond ``cap`` bytes
    (None: one file). Always at least one (possibly empty) list."""
    parts: list[list[T]] = []
    cur: list[T] = []
    size = 0
    for x in items:
        n = size_of(x)
        if cur and cap and size + n > cap:
            parts.append(cur)
            cur, size = [], 0
        cur.append(x)
        size += n
    parts.append(cur)
    return parts


def file_name(role: str, i: int, n: int) -> str:
    """The ``i``-th of ``n`` data files of ``role`` (1-based)."""
    return f"{role}-{i:05d}-of-{n:05d}.safetensors"


def pack(stored: Iterable[tuple[str, str, Sequence[int], Any]], metadata: dict[str, str]
            ) -> tuple[bytes, list[tuple[str, str, tuple[int, ...], Any, TensorInfo]]]:
    """A file holding ``stored`` (``(key, dtype, shape, what)``): its header, and each
    ``(key, dtype, shape, what, info)`` in safetensors order (by dtype size, then key), with
    ``info`` its offsets in the data section."""
    items = sorted(((k, dt, tuple(sh), what) for k, dt, sh, what in stored), key=lambda x: order_key(x[1], x[0]))
    header, infos = build_header(((k, dt, sh) for k, dt, sh, _ in items), metadata)
    return header, [(*x, info) for x, info in zip(items, infos)]


def file_entry(name: str, role: str, node: str, writer: int, size: int, header: bytes, stored: int | None = None,
               frames: Iterable = ()) -> FileEntry:
    """The manifest's record of a written file (``stored``, ``frames``: a zstd-framed one's)."""
    if stored is not None:
        return FileEntry(name, role, node, writer, size, len(header), "zstd", stored, tuple(sorted(frames)),
                         Hasher.of(header))
    return FileEntry(name, role, node, writer, size, len(header), header_xxh3=Hasher.of(header))


def new_manifest(*, world_size: int, nodes: Iterable[str], strategy: dict, **fields: Any) -> Manifest:
    """A manifest of what this unickpt and torch wrote now (``saved_by``, ``created``);
    ``fields``: the rest of :class:`~unickpt.manifest.Manifest`'s."""
    import torch

    return Manifest(saved_by={"world_size": world_size, "nodes": sorted(set(nodes)), "strategy": strategy,
                              "unickpt_version": __version__, "torch_version": torch.__version__.split("+")[0]},
                    created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **fields)


class FileSet:
    """Files being written under ``folder`` (a write transaction's), by key (a plan's file
    index, or the stored name). Each :meth:`open` file is closed by :meth:`close` (fsynced:
    its O_DIRECT page fragments returned) or :meth:`abort`."""

    def __init__(self, storage: Storage, folder: str, name_of: Callable[[str], str] = str) -> None:
        self.storage, self.folder, self.name_of = storage, folder, name_of
        self.writers: dict[Hashable, ExtentWriter | ZstdWriter] = {}
        self.headers: dict[Hashable, int] = {}

    def path(self, name: str) -> str:
        return self.storage.join(self.folder, self.name_of(name))

    def create(self, name: str, size: int, framed: bool = False) -> None:
        """Create file ``name`` at its full ``size`` (framed files grow as they are written)."""
        self.storage.create_file(self.path(name), 0 if framed else size)

    def open(self, key: Hashable, name: str, size: int, *, header: bytes | None = None, header_len: int | None = None,
             zstd: int | None = None, lossless: bool = False, direct: bool | None = None) -> None:
        """Open file ``name`` (created already) for writing as ``key``; with ``header``,
        write it first (the file's owner does). ``header_len``: the header's length when
        another writer writes it (offsets of :meth:`write` are in the data section).
        ``zstd`` (a level) or ``lossless`` (byte-grouped, the tensors' element sizes read
        from ``header``): a framed file, which its owner alone writes."""
        path = self.path(name)
        if lossless:
            if header is None:
                raise ValueError(f"{name}: a byte-grouped file is written by its owner, who has its header")
            self.writers[key] = ZstdWriter(self.storage.open_writer(path, direct=False), elements=elements_of(header))
        elif zstd:
            self.writers[key] = ZstdWriter(self.storage.open_writer(path, direct=False), zstd)
        else:
            self.writers[key] = self.storage.open_writer(path, direct=direct, size=size)
        self.headers[key] = len(header) if header is not None else (header_len or 0)
        if header is not None:
            self.writers[key].write_at(0, memoryview(header))

    def write(self, key: Hashable, offset: int, data: memoryview, stable: bool = False) -> None:
        """``data`` at ``offset`` of the file's data section (after its header)."""
        w, at = self.writers[key], self.headers[key] + offset
        if stable:  # (the promise only where made: a writer may take the bytes without a copy)
            w.write_at(at, data, stable=True)
        else:
            w.write_at(at, data)

    def close(self) -> tuple[dict[Hashable, int], dict[Hashable, ZstdWriter], list[tuple[Hashable, int, bytes]]]:
        """Close (fsync) every open file: bytes written per key, the framed writers (their
        stored size and frames), and the page fragments ``(key, offset, bytes)`` that the
        files' owners must merge (:meth:`finish`)."""
        written = {k: w.bytes_written for k, w in self.writers.items()}
        framed = {k: w for k, w in self.writers.items() if isinstance(w, ZstdWriter)}
        fragments = []
        for k, w in list(self.writers.items()):
            fragments.extend((k, off, data) for off, data in w.close())
            del self.writers[k]
        return written, framed, fragments

    def finish(self, name: str, fragments: list[tuple[int, bytes]], size: int) -> None:
        """The owner of file ``name``: merge every writer's fragments, fix the size, fsync."""
        self.storage.finish_file(self.path(name), fragments, size)

    def abort(self) -> None:
        """Drop every open file's writer (after a failure: the files go with the transaction's
        temporary; a writer that fails to abort does not hide the failure being handled)."""
        for w in self.writers.values():
            try:
                w.abort()
            except Exception:
                pass
        self.writers.clear()
