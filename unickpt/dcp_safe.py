"""Reading torch.distributed.checkpoint (DCP) directories without trusting them.

Trust model
-----------
A DCP directory handed to ``unickpt convert --from-dcp`` is **untrusted input**: it may come
from another team, a download or a shared file system. DCP itself trusts it completely:

* ``FileSystemReader.read_metadata`` unpickles ``DIR/.metadata`` with plain :mod:`pickle`,
  so a crafted file runs arbitrary code (``os.system``, ``builtins.exec``...) the moment it
  is read. ``dcp.load`` also swallows that reader's errors and falls back to the rank-local
  ``DIR/__<rank>.metadata``, unpickled the same way.
* ``FileSystemReader.read_data`` opens ``DIR/<relative_path>`` where ``relative_path`` comes
  from that metadata (``../../x`` and absolute paths are followed), through symbolic links,
  and blocks forever on a FIFO.
* Tensor payloads are read with ``torch.load(..., weights_only=True)`` (restricted unpickler:
  acceptable), but **non-tensor entries** (``BytesStorageMetadata``) are read by the planner
  with ``torch.load(..., weights_only=False)``: full unpickling. Never load them from an
  untrusted directory; ``convert_from_dcp`` only asks DCP for tensor entries.

This module keeps the metadata on a leash:

* :func:`read_dcp_metadata` opens the metadata file without following a symbolic link and
  without blocking (``O_NOFOLLOW | O_NONBLOCK``), requires a regular file of at most
  :data:`MAX_METADATA_BYTES`, and unpickles it with :class:`_MetadataUnpickler`, whose
  ``find_class`` admits only the globals real DCP metadata contains (:data:`ALLOWED_GLOBALS`).
  Anything else, and any other unpickling failure, is a :class:`~unickpt.errors.FormatError`
  naming the file. The result is then validated: a :class:`Metadata` whose entries have the
  expected types, whose chunks lie inside their tensors and whose storage entries name bare
  file names inside the directory with non-negative integer offsets and lengths.
* :class:`SafeFileSystemReader` is DCP's reader with that metadata reader, and with a file
  system that opens only regular files directly inside the DCP directory (same flags),
  read-only.

What the allow-list holds, and why
----------------------------------
It was established by saving DCP checkpoints with this torch (tensors of every dtype, 0-d
and empty tensors, nested dicts and lists, non-tensor values of many kinds, DTensors,
rank-local metadata, several files per rank, zstd-compressed, ``Path`` checkpoint ids) and
recording every global their ``.metadata`` unpickles (protocol 4, ``STACK_GLOBAL``):

* the DCP metadata dataclasses ``Metadata``, ``TensorStorageMetadata``,
  ``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``,
  ``StorageMeta``, the enum ``_MEM_FORMAT_ENCODING`` (how ``TensorProperties`` pickles its
  memory format) and the file system's ``_StorageInfo``. Building them runs only dataclass
  constructors / ``__setstate__``, which store values;
* ``torch.Size`` (a tuple subclass) and the ``torch.<dtype>`` objects (pickled by name; only
  names that are ``torch.dtype`` values resolve);
* ``torch.serialization._get_layout`` (how ``torch.layout`` pickles): replaced by a lookup
  that returns a ``torch.layout`` by its name and nothing else;
* ``pathlib.PosixPath`` / ``pathlib.WindowsPath`` (``StorageMeta.checkpoint_id`` is the
  writer's ``Path``): replaced by ``PurePosixPath`` / ``PureWindowsPath``, which never touch
  the file system (and a checkpoint written on Windows still reads elsewhere).

Nothing else: no ``builtins`` (``eval``, ``exec``, ``getattr``...), no ``os``/``posix``/
``subprocess``, no ``torch`` functions (``torch.load``, ``torch._utils._rebuild_*``), no
dotted names (``module.os.system``), no ``copyreg`` helpers, no persistent ids.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
import reprlib
import weakref
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (


    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    _MEM_FORMAT_ENCODING,
)

from .errors import FormatError

__all__ = ["read_dcp_metadata", "SafeFileSystemReader", "ALLOWED_GLOBALS", "MAX_METADATA_BYTES",
           "METADATA_NAME"]

#: Name of DCP's global metadata file (rank-local ones are ``__<rank>.metadata``).
METADATA_NAME = ".metadata"
#: Largest metadata file read (a million-tensor checkpoint is well below).
MAX_METADATA_BYTES = 256 << 20

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _layout_by_name(name: object) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: a ``torch.layout`` by name, nothing else."""
    if isinstance(name, str) and name.startswith("torch.") and name.count(".") == 1:
        v = torch.__dict__.get(name[6:])  # no getattr: torch lazily imports submodules
        if isinstance(v, torch.layout):
            return v
    raise pickle.UnpicklingError(f"unknown torch.layout {_short.repr(name)}")


_DCP_MD = "torch.distributed.checkpoint.metadata"
#: ``(module, name)`` -> object the restricted unpickler hands out. ``torch.<dtype>`` names
#: are admitted besides (see :meth:`_MetadataUnpickler.find_class`).
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    (_DCP_MD, "Metadata"): Metadata,
    (_DCP_MD, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP_MD, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP_MD, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP_MD, "TensorProperties"): TensorProperties,
    (_DCP_MD, "MetadataIndex"): MetadataIndex,
    (_DCP_MD, "StorageMeta"): StorageMeta,
    (_DCP_MD, "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout_by_name,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
}


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler admitting only :data:`ALLOWED_GLOBALS` and ``torch.<dtype>``."""

    def find_class(self, module: str, name: str) -> Any:
        obj = ALLOWED_GLOBALS.get((module, name))
        if obj is not None:
            return obj
        if module == "torch" and name.isidentifier():
            v = torch.__dict__.get(name)
            if isinstance(v, torch.dtype):
                return v
        raise _Refused(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not used by DCP metadata")


# -- opening files -------------------------------------------------------------------------


def _safe_name(name: object) -> bool:
    """A bare file name of the DCP directory: no separator, not hidden, nothing special."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and not name.startswith(".")
            and not any(c in name for c in "/\\\0:"))


def _open_regular(path: str) -> int:
    """fd of ``path`` read-only, only if it is a regular file reached without following a
    final symbolic link (:func:`unickpt.io.localfs.open_regular`); blocking reads afterwards."""
    from .errors import CheckpointNotFoundError
    from .io.localfs import open_regular

    try:
        fd, _ = open_regular(path)
    except CheckpointNotFoundError:
        raise FormatError(f"{path}: no such file (not a torch.distributed.checkpoint directory?)") from None
    try:
        if _FLAGS & getattr(os, "O_NONBLOCK", 0):
            import fcntl

            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_capped(path: str, cap: int) -> bytes:
    fd = _open_regular(path)
    try:
        if os.fstat(fd).st_size > cap:
            raise FormatError(f"{path}: {os.fstat(fd).st_size} bytes, more than the {cap} bytes a DCP metadata file "
                              "may have")
        chunks, n = [], 0
        while True:
            b = os.read(fd, min(1 << 20, cap + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if n > cap:
                raise FormatError(f"{path}: more than the {cap} bytes a DCP metadata file may have")
        return b"".join(chunks)
    finally:
        os.close(fd)


# -- validation ----------------------------------------------------------------------------


_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80
_short.maxlevel = 3


def _nonneg_int(x: object) -> bool:
    return type(x) is int and x >= 0


def _size(x: object) -> bool:
    return isinstance(x, torch.Size) and all(_nonneg_int(d) for d in x)


#: Metadata objects :func:`_validate` passed, by id (weakly): handing one to a reader again
#: (``convert_from_dcp`` makes one reader per tensor) costs nothing. Callers must not mutate them.
_VALIDATED: "weakref.WeakValueDictionary[int, Metadata]" = weakref.WeakValueDictionary()


def _validated(meta: object, where: str) -> Metadata:
    """``meta`` if validated before, else :func:`_validate` it."""
    if _VALIDATED.get(id(meta)) is meta:
        return meta  # type: ignore[return-value]
    return _validate(meta, where)


def _validate(meta: object, where: str) -> Metadata:
    if type(meta) is not Metadata:
        raise FormatError(f"{where}: holds a {type(meta).__name__}, not torch.distributed.checkpoint Metadata")

    def bad(what: str) -> FormatError:
        return FormatError(f"{where}: {what}")

    sdm = getattr(meta, "state_dict_metadata", None)
    if type(sdm) is not dict:
        raise bad("state_dict_metadata is not a dict")
    for key, md in sdm.items():
        if type(key) is not str:
            raise bad(f"state_dict_metadata key {_short.repr(key)} is not a string")
        if type(md) is BytesStorageMetadata:
            continue
        if type(md) is not TensorStorageMetadata:
            raise bad(f"entry {_short.repr(key)} is a {type(md).__name__}, not tensor or bytes storage metadata")
        props, size, chunks = (getattr(md, a, None) for a in ("properties", "size", "chunks"))
        if (type(props) is not TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype)
                or not isinstance(getattr(props, "layout", None), torch.layout)):
            raise bad(f"tensor {_short.repr(key)} has malformed properties")
        if not _size(size):
            raise bad(f"tensor {_short.repr(key)} has a malformed size {_short.repr(size)}")
        if type(chunks) is not list:
            raise bad(f"tensor {_short.repr(key)} has malformed chunks")
        for c in chunks:
            off, sz = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if (type(c) is not ChunkStorageMetadata or not _size(off) or not _size(sz)
                    or len(off) != len(size) or len(sz) != len(size)
                    or any(o + s > d for o, s, d in zip(off, sz, size))):
                raise bad(f"tensor {_short.repr(key)} has a chunk outside its size {tuple(size)}")

    sd = getattr(meta, "storage_data", None)
    if type(sd) is not dict:
        raise bad("storage_data is not a dict")
    for idx, info in sd.items():
        if type(idx) is not MetadataIndex or type(getattr(idx, "fqn", None)) is not str:
            raise bad(f"storage_data key {_short.repr(idx)} is not a MetadataIndex")
        if idx.offset is not None and not _size(idx.offset):
            raise bad(f"storage_data key {_short.repr(idx)} has a malformed offset")
        if type(info) is not _StorageInfo:
            raise bad(f"storage_data of {_short.repr(idx.fqn)} is a {type(info).__name__}, not _StorageInfo")
        rel = getattr(info, "relative_path", None)
        if not _safe_name(rel):
            raise bad(f"storage_data of {_short.repr(idx.fqn)} names {_short.repr(rel)}: DCP data files must be "
                      "bare file names inside the checkpoint directory")
        if not _nonneg_int(getattr(info, "offset", None)) or not _nonneg_int(getattr(info, "length", None)):
            raise bad(f"storage_data of {_short.repr(idx.fqn)} has a malformed offset or length")
        td = getattr(info, "transform_descriptors", None)
        if td is not None and (type(td) not in (list, tuple) or not all(type(t) is str and len(t) <= 64 for t in td)):
            raise bad(f"storage_data of {_short.repr(idx.fqn)} has malformed transform descriptors")

    sm = getattr(meta, "storage_meta", None)
    if sm is not None and type(sm) is not StorageMeta:
        raise bad("storage_meta is not a StorageMeta")
    version = getattr(meta, "version", None)
    if version is not None and type(version) is not str:
        raise bad("version is not a string")
    # planner_data is the planner's business (default planner: fqn -> key path); the
    # allow-list already confines it to plain values and the classes above.
    _VALIDATED[id(meta)] = meta
    return meta


# -- public API ----------------------------------------------------------------------------


def read_dcp_metadata(dcp_dir: str | os.PathLike, name: str = METADATA_NAME) -> Metadata:
    """The :class:`Metadata` of DCP directory ``dcp_dir`` (``name``: ``.metadata``, or a
    rank-local ``__<rank>.metadata``), unpickled through the allow-list and validated.
    Raises :class:`FormatError` (naming the file) for anything else."""
    if name != METADATA_NAME and not (name.startswith("__") and name.endswith(METADATA_NAME)
                                      and name[2:-len(METADATA_NAME)].isdigit()):
        raise FormatError(f"{name!r} is not a DCP metadata file name")
    path = os.path.join(os.fspath(dcp_dir), name)
    data = _read_capped(path, MAX_METADATA_BYTES)
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise FormatError(f"{path}: refuses to unpickle {_short.repr(e.qualname)} (only torch.distributed.checkpoint "
                          "metadata classes are allowed)") from None
    except (RecursionError, MemoryError) as e:
        raise FormatError(f"{path}: not a loadable DCP metadata pickle ({type(e).__name__})") from None
    except Exception as e:  # truncated, garbage, bad constructor arguments...
        raise FormatError(f"{path}: not a DCP metadata pickle ({type(e).__name__}: {e})") from None
    try:
        return _validate(meta, path)
    except FormatError:
        raise
    except (RecursionError, MemoryError, Exception) as e:  # a validation step tripped on odd values
        raise FormatError(f"{path}: malformed DCP metadata ({type(e).__name__}: {e})") from None


class _ConfinedFileSystem(FileSystem):
    """DCP's local file system, read-only and confined to regular files directly inside
    the reader's directory."""

    def __init__(self, reader: "SafeFileSystemReader") -> None:
        self._reader = reader

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        p = pathlib.Path(path)
        root = pathlib.Path(self._reader.path)
        if mode != "rb":
            raise FormatError(f"{p}: the DCP reader opens files read-only (asked {_short.repr(mode)})")
        if p.parent != root or not (_safe_name(p.name) or p.name == METADATA_NAME):
            raise FormatError(f"{p}: not a file directly inside the DCP directory {root}")
        with os.fdopen(_open_regular(str(p)), "rb") as f:
            yield f

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise FormatError("the DCP reader does not modify the checkpoint directory")

    rename = mkdir = rm_file = _refuse


class SafeFileSystemReader(FileSystemReader):
    """:class:`~torch.distributed.checkpoint.FileSystemReader` for untrusted directories:
    metadata through :func:`read_dcp_metadata`, data files only regular files directly inside
    the directory. ``metadata``: metadata already read by :func:`read_dcp_metadata` (not
    mutated since), returned by :meth:`read_metadata` instead of reading the file again;
    anything else passed there is validated first.

    It does not make ``BytesStorageMetadata`` entries safe: DCP's planner unpickles them with
    ``torch.load(weights_only=False)``. Load only tensor entries from untrusted directories."""

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None, *,
                 metadata: Metadata | None = None) -> None:
        self._metadata: Metadata | None = None
        super().__init__(path, _extension_registry)
        self.fs = _ConfinedFileSystem(self)
        self._metadata = None if metadata is None else _validated(metadata, os.path.join(str(self.path), METADATA_NAME))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id and pathlib.Path(checkpoint_id) != pathlib.Path(self.path):
            self._metadata = None  # another directory: the cached metadata is not its own
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None:
            meta = self._metadata if self._metadata is not None else read_dcp_metadata(self.path)
        elif type(rank) is int and rank >= 0:
            meta = read_dcp_metadata(self.path, f"__{rank}{METADATA_NAME}")
        else:
            raise FormatError(f"rank {_short.repr(rank)} is not a rank")
        if meta.storage_meta is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Metadata may reach here without read_metadata (broadcast by another rank): check it.
        _validated(metadata, os.path.join(str(self.path), METADATA_NAME))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
