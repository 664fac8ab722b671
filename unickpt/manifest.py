"""The manifest ``unickpt.json``: versioned schema, (de)serialisation and validation.

A manifest is plain JSON (never pickle). Loading validates every field a hostile or damaged
manifest could use to mislead a reader: file names are bare names inside the checkpoint
directory, offsets agree with dtype and shape, roles and codecs are known.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import FormatError
from .format import DTYPES, itemsize

__all__ = ["Manifest", "FileEntry", "TensorEntry", "FORMAT_VERSION", "MANIFEST_NAME", "INDEX_NAME"]

FORMAT_NAME = "unickpt"
FORMAT_VERSION = 1
MANIFEST_NAME = "unickpt.json"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_LIMIT = 1 << 30
CODECS = ("raw",)

_FILE = re.compile(r"^[a-z][a-z0-9_]{0,31}-\d{5,}-of-\d{5,}\.safetensors$")
_ROLE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    role: str
    node: str
    writer: int
    size: int
    data_start: int

    def to_json(self) -> dict:
        return {"role": self.role, "node": self.node, "writer": self.writer, "size": self.size, "data_start": self.data_start}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    role: str
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the file's data section (as in the safetensors header)
    end: int
    checksums: tuple[tuple[int, int, str], ...]  # (begin, end, xxh3) tiling the stored bytes
    codec: str = "raw"
    writer: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offsets": [self.begin, self.end],
            "checksums": [list(c) for c in self.checksums],
            "codec": self.codec,
            "writer": self.writer,
        }


@dataclass(slots=True)
class Manifest:
    step: int | None
    files: dict[str, FileEntry]
    tensors: dict[tuple[str, str], TensorEntry]
    state: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    saved_by: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    checksum_algo: str = "xxh3_64"
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        roles: dict[str, dict[str, dict]] = {}
        for (role, name), t in sorted(self.tensors.items()):
            roles.setdefault(role, {})[name] = t.to_json()
        obj = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "created": self.created,
            "checksum_algo": self.checksum_algo,
            "saved_by": self.saved_by,
            "files": {n: f.to_json() for n, f in sorted(self.files.items())},
            "tensors": roles,
            "state": self.state,
            "extra": self.extra,
        }
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def bytes_by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.files.values():
            out[f.role] = out.get(f.role, 0) + f.size
        return dict(sorted(out.items()))

    def hf_index(self) -> bytes | None:
        """Hugging Face ``model.safetensors.index.json`` for the model role, if any."""
        model = {n: t for (r, n), t in self.tensors.items() if r == "model"}
        if not model:
            return None
        obj = {
            "metadata": {"total_size": sum(t.nbytes for t in model.values()), "format": "unickpt"},
            "weight_map": {n: model[n].file for n in sorted(model)},
        }
        return json.dumps(obj, indent=2).encode()

    @staticmethod
    def from_json(data: bytes, where: str) -> "Manifest":
        try:
            obj = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            raise FormatError(f"{where}: manifest is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
        try:
            return _parse(obj, where)
        except (ValueError, TypeError, RecursionError) as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"{where}: malformed manifest ({type(e).__name__}: {str(e)[:200]})") from None


def _int(v, where: str) -> int:
    if type(v) is not int:
        raise FormatError(f"{where}: expected an integer, got {type(v).__name__}")
    return v


def _req(obj: dict, key: str, kind, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise FormatError(f"{where}: missing field {key!r}")
    v = obj[key]
    if kind is int:
        ok = type(v) is int
    else:
        ok = isinstance(v, kind)
    if not ok:
        raise FormatError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


_HEX = re.compile(r"[0-9a-f]{16}")


def _no_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def _checksums(raw: list, nbytes: int, where: str) -> tuple[tuple[int, int, str], ...]:
    """Checksummed ranges must tile ``[0, nbytes)`` in order."""
    out = []
    pos = 0
    for c in raw:
        if not (isinstance(c, list) and len(c) == 3 and type(c[0]) is int and type(c[1]) is int and isinstance(c[2], str)):
            raise FormatError(f"{where}: checksums must be [begin, end, hex] triples")
        b, e, h = c
        if b != pos or e <= b or not _HEX.fullmatch(h):
            raise FormatError(f"{where}: checksum ranges must tile the tensor's bytes in order (got [{b}, {e}) at {pos})")
        out.append((b, e, h))
        pos = e
    if pos != nbytes and not (nbytes == 0 and not out):
        raise FormatError(f"{where}: checksums cover {pos} of {nbytes} bytes")
    return tuple(out)


def _parse(obj: Any, where: str) -> Manifest:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise FormatError(f"{where}: not a unickpt manifest (field 'format' must be {FORMAT_NAME!r})")
    version = _req(obj, "format_version", int, where)
    if version > FORMAT_VERSION or version < 1:
        raise FormatError(
            f"{where}: format_version {version} is not supported by this unickpt (reads 1..{FORMAT_VERSION}); upgrade unickpt"
        )
    step = obj.get("step")
    if step is not None and type(step) is not int:
        raise FormatError(f"{where}: field 'step' must be an integer or null")
    files: dict[str, FileEntry] = {}
    for name, f in _req(obj, "files", dict, where).items():
        w = f"{where}: file {name!r}"
        if not _FILE.fullmatch(name):
            raise FormatError(f"{w}: not a valid checkpoint file name (role-NNNNN-of-NNNNN.safetensors, no path)")
        size = _req(f, "size", int, w)
        start = _req(f, "data_start", int, w)
        writer = _req(f, "writer", int, w)
        if size < 0 or not (8 <= start <= size):
            raise FormatError(f"{w}: data_start {start} and size {size} are inconsistent")
        files[name] = FileEntry(name, _req(f, "role", str, w), _req(f, "node", str, w), writer, size, start)
    tensors: dict[tuple[str, str], TensorEntry] = {}
    for role, group in _req(obj, "tensors", dict, where).items():
        if not _ROLE.fullmatch(role) or not isinstance(group, dict):
            raise FormatError(f"{where}: invalid role {role!r}")
        for name, t in group.items():
            w = f"{where}: tensor {name!r} (role {role})"
            fname = _req(t, "file", str, w)
            if fname not in files:
                raise FormatError(f"{w}: file {fname!r} is not listed in 'files'")
            dtype = _req(t, "dtype", str, w)
            if dtype not in DTYPES:
                raise FormatError(f"{w}: unknown dtype {dtype!r}")
            shape = _req(t, "shape", list, w)
            if not all(type(s) is int and s >= 0 for s in shape):
                raise FormatError(f"{w}: shape must be non-negative integers")
            offs = _req(t, "offsets", list, w)
            if len(offs) != 2 or not all(type(o) is int for o in offs):
                raise FormatError(f"{w}: offsets must be two integers")
            codec = t.get("codec", "raw")
            if codec not in CODECS:
                raise FormatError(f"{w}: unknown codec {codec!r} (this unickpt knows {', '.join(CODECS)})")
            b, e = offs
            fe = files[fname]
            if not (0 <= b <= e <= fe.size - fe.data_start):
                raise FormatError(f"{w}: offsets [{b}, {e}) fall outside file {fname!r}")
            if codec == "raw" and e - b != math.prod(shape) * itemsize(dtype):
                raise FormatError(f"{w}: {e - b} bytes stored, expected {math.prod(shape) * itemsize(dtype)} for {dtype} {shape}")
            checksums = _checksums(_req(t, "checksums", list, w), e - b, w)
            tensors[(role, name)] = TensorEntry(
                role, name, fname, dtype, tuple(shape), b, e, checksums, codec, _int(t.get("writer", 0), w)
            )
    state = obj.get("state") or {}
    extra = obj.get("extra") or {}
    saved_by = obj.get("saved_by") or {}
    if not isinstance(state, dict) or not isinstance(extra, dict) or not isinstance(saved_by, dict):
        raise FormatError(f"{where}: 'state', 'extra' and 'saved_by' must be objects")
    return Manifest(
        step=step,
        files=files,
        tensors=tensors,
        state=state,
        extra=extra,
        saved_by=saved_by,
        created=str(obj.get("created", "")),
        checksum_algo=str(obj.get("checksum_algo", "xxh3_64")),
        format_version=version,
    )
