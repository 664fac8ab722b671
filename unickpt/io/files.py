"""The checkpoint's files as a load opens them: regular files inside the checkpoint, their size
and header checked against the manifest before a byte is read from them (:class:`Files`,
:func:`open_file`)."""

from __future__ import annotations

from ..errors import CheckpointNotFoundError, ChecksumError, FormatError
from ..format import Hasher, parse_header, read_header
from ..manifest import Manifest
from .storage import RandomReader, Storage


def open_files(storage: Storage, ckpt: str, man: Manifest, names, readers: dict) -> None:
    """Open (and check: regular file, recorded size, intact header) each of ``names`` into
    ``readers`` before anything is allocated or created from the manifest's claims."""
    try:
        for f in sorted(names):
            if f not in readers:
                readers[f] = open_file(storage, ckpt, man, f)
    except BaseException:
        for r in readers.values():
            r.close()
        readers.clear()
        raise


def read_side_file(storage: Storage, ckpt: str, man: Manifest, name: str, limit: int) -> bytes:
    """A side file the manifest lists (``config.json``, ``save(extra_files=...)``): a regular
    file inside the checkpoint of at most ``limit`` bytes, with the size and checksum the
    manifest records (:class:`CheckpointNotFoundError`, :class:`ChecksumError` otherwise)."""
    path = storage.join(ckpt, name)
    if not storage.exists(path):
        raise CheckpointNotFoundError(f"{path}: listed in the manifest but missing")
    data = storage.read_bytes(path, limit)
    if (len(data), Hasher.of(data)) != tuple(man.aux[name]):
        raise ChecksumError(f"{path}: does not match the size and checksum the manifest records", [(name, "")])
    return data


def open_file(storage: Storage, ckpt: str, man: Manifest, fname: str) -> RandomReader:
    """A reader of the logical (safetensors) bytes of a checkpoint file, header checked."""
    fe = man.files[fname]
    try:
        r = storage.open_reader(storage.join(ckpt, fname))
    except CheckpointNotFoundError as e:
        if len({f.node for f in man.files.values()}) < 2:
            raise
        where = ", ".join([fe.node, *fe.replicas])
        raise CheckpointNotFoundError(f"{e} (written on node {where}: if the checkpoint is node-local, that "
                                      "node's directory holds it)") from None
    try:
        if fe.container == "zstd":
            from ..container import ZstdReader

            r = ZstdReader(r, [list(f) for f in fe.frames], fe.size, fe.stored_size)
        check_file(r, man, fname)
    except BaseException:
        r.close()
        raise
    return r


class Files:
    """Open readers, each header checked once against the manifest."""

    def __init__(self, storage: Storage, ckpt: str, man: Manifest) -> None:
        self.storage, self.ckpt, self.man = storage, ckpt, man
        self.readers: dict[str, RandomReader] = {}
        self.bytes_read = 0

    def get(self, fname: str) -> RandomReader:
        r = self.readers.get(fname)
        if r is None:
            r = self.readers[fname] = open_file(self.storage, self.ckpt, self.man, fname)
        return r

    def close(self) -> None:
        for r in self.readers.values():
            self.bytes_read += r.bytes_read
            r.close()
        self.readers.clear()


def check_file(reader: RandomReader, man: Manifest, fname: str) -> None:
    fe = man.files[fname]
    if reader.size != fe.size:
        raise FormatError(f"{reader.path}: {reader.size} bytes on disk, the manifest records {fe.size} (truncated or replaced?)")
    hdr = None
    if fe.header_xxh3:  # format >= 2: every header byte (metadata, padding) is checksummed
        head = bytearray(min(fe.data_start, reader.size))
        reader.readinto(0, memoryview(head))
        if Hasher.of(head) != fe.header_xxh3:
            raise ChecksumError(f"{reader.path}: safetensors header does not match its checksum in the manifest",
                                [(fname, "")])
        try:  # the verified bytes hold the whole header: parse them, not a second read
            hdr = parse_header(reader.path, bytes(head), reader.size)
        except FormatError:  # longer than recorded, or unparsable: read_header below says which
            pass
    if hdr is None:
        hdr = read_header(reader)
    if hdr.data_start != fe.data_start:
        raise FormatError(f"{reader.path}: data starts at {hdr.data_start}, the manifest records {fe.data_start}")
    for (role, name), t in man.tensors.items():
        if t.file != fname:
            continue
        for _, key, dt, shape, b, e, _ in t.stored():
            h = hdr.tensors.get(key)
            if h is None or (h.begin, h.end) != (b, e) or h.dtype != dt or h.shape != shape:
                raise FormatError(f"{reader.path}: header entry {key!r} of tensor {name!r} disagrees with the manifest")

