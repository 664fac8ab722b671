"""The safetensors file layout unickpt writes and the strict parser it reads with.

A file is ``u64 little-endian header length`` + ``JSON header`` + ``data``. unickpt pads the
header with spaces so that data starts at a multiple of 4096 bytes (O_DIRECT writes, aligned
reads) and orders tensors by decreasing element size, then name, so every tensor is aligned
to its element size. Readers never trust a header: sizes, offsets, dtypes and the file size
are all checked, and errors name the file and tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Iterable

import torch
import xxhash

from .errors import FormatError


__all__ = [
    "DTYPES",
    "dtype_name",
    "torch_dtype",
    "itemsize",
    "TensorInfo",
    "build_header",
    "parse_header",
    "Hasher",
    "HEADER_LIMIT",
    "CHECK_BLOCK",
    "block_sums",
    "BlockHasher",
]

DATA_ALIGN = 4096
CHECK_BLOCK = 1 << 20
"""Checksummed ranges are cut at multiples of this many bytes of their tensor (or part), so
a reader of any slice verifies the bytes it returns by reading at most one block more at
each end of a run."""
HEADER_LIMIT = 100 << 20  # safetensors' own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} cannot be stored in safetensors") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise FormatError(f"unknown safetensors dtype {name!r}") from None


_ITEMSIZE = {k: v.itemsize for k, v in DTYPES.items()}  # (torch's dtype.itemsize costs ~2 us a call)


def itemsize(name: str) -> int:
    size = _ITEMSIZE.get(name)
    return size if size is not None else torch_dtype(name).itemsize


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset from the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


MAX_DIMS = 64
_DIM_LIMIT = 1 << 62


def valid_shape(shape) -> bool:
    """A list of at most MAX_DIMS non-negative ints whose product stays below 2^62 (checked
    without multiplying huge numbers: hostile shapes cost linear time)."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        return False
    n = 1
    for s in shape:
        if type(s) is not int or s < 0 or s >= _DIM_LIMIT:
            return False
        n = min(n * s, _DIM_LIMIT)
    return n < _DIM_LIMIT


def order_key(dtype: str, name: str) -> tuple[int, str]:
    """Order of tensors in a file: larger elements first keeps every tensor aligned."""
    return (-itemsize(dtype), name)


def _json_str(s: str) -> str:
    """``json.dumps(s, ensure_ascii=False)``: which escapes only quotes, backslashes and
    control characters, none of which a printable string holds but the first two."""
    return f'"{s}"' if s.isprintable() and '"' not in s and "\\" not in s else json.dumps(s, ensure_ascii=False)


def build_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]
) -> tuple[bytes, list[TensorInfo]]:
    """Header bytes (length prefix included, padded to DATA_ALIGN) for tensors in the given order."""
    infos: list[TensorInfo] = []
    # json.dumps of {"__metadata__": ..., name: {"dtype", "shape", "data_offsets"}, ...},
    # written piece by piece (a plan builds one header per file: thousands at scale)
    text = ['{"__metadata__":', json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False)]
    pos = 0
    seen: set[str] = set()
    for name, dtype, shape in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} twice in one file")
        seen.add(name)
        shape = tuple(int(d) for d in shape)
        n = math.prod(shape) * itemsize(dtype)
        infos.append(TensorInfo(name, dtype, shape, pos, pos + n))
        text.append(f',{_json_str(name)}:{{"dtype":{_json_str(dtype)},"shape":'
                    f'[{",".join(map(str, shape))}],"data_offsets":[{pos},{pos + n}]}}')
        pos += n
    text.append("}")
    raw = "".join(text).encode()
    pad = (-(8 + len(raw))) % DATA_ALIGN
    raw += b" " * pad
    return struct.pack("<Q", len(raw)) + raw, infos


@dataclass(frozen=True, slots=True)
class Header:
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def parse_header(path: str, prefix: bytes, file_size: int) -> Header:
    """Validate a safetensors header. ``prefix`` holds at least the first 8 bytes; if it holds
    less than the whole header a :class:`FormatError` says how many bytes are needed."""
    if file_size < 8 or len(prefix) < 8:
        raise FormatError(f"{path}: too small to be a safetensors file ({file_size} bytes)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > HEADER_LIMIT or 8 + n > file_size:
        raise FormatError(f"{path}: header length {n} is larger than the file or the {HEADER_LIMIT} byte limit")
    if len(prefix) < 8 + n:
        raise _NeedMore(8 + n)
    try:
        obj = json.loads(prefix[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{path}: header is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    data_len = file_size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, t in obj.items():
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"{path}: tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offs = t["dtype"], t["shape"], t["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FormatError(f"{path}: tensor {name!r}: unknown dtype {str(dtype)[:40]!r}")
        if not valid_shape(shape):
            raise FormatError(f"{path}: tensor {name!r}: shape must be a list of at most {MAX_DIMS} non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
            raise FormatError(f"{path}: tensor {name!r}: data_offsets must be two integers")
        b, e = offs
        if not (0 <= b <= e <= data_len) or e - b != math.prod(shape) * itemsize(dtype):
            raise FormatError(
                f"{path}: tensor {name!r}: data_offsets [{b}, {e}) do not fit dtype {dtype} x shape {shape} "
                f"inside {data_len} data bytes"
            )
        tensors[name] = TensorInfo(name, dtype, tuple(shape), b, e)
    pos = 0
    for info in sorted(tensors.values(), key=lambda i: (i.begin, i.end)):
        if info.begin != pos:
            raise FormatError(f"{path}: tensor {info.name!r}: data starts at {info.begin}, expected {pos} (hole or overlap)")
        pos = info.end
    if pos != data_len:
        raise FormatError(f"{path}: {data_len - pos} trailing bytes after the last tensor")
    return Header(8 + n, tensors, meta)


class _NeedMore(FormatError):
    def __init__(self, n: int) -> None:
        super().__init__(f"header needs {n} bytes")
        self.n = n


def read_header(reader) -> Header:
    """Parse the header of an open :class:`~unickpt.io.storage.RandomReader`."""
    first = bytearray(min(reader.size, 64 << 10))
    reader.readinto(0, memoryview(first))
    try:
        return parse_header(reader.path, bytes(first), reader.size)
    except _NeedMore as more:
        full = bytearray(more.n)
        reader.readinto(0, memoryview(full))
        return parse_header(reader.path, bytes(full), reader.size)


class Hasher:
    """Per-tensor checksum: xxh3-64 of the stored bytes, as 16 hex digits."""

    ALGO = "xxh3_64"

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    @staticmethod
    def of(data) -> str:
        return xxhash.xxh3_64_hexdigest(data)

    @staticmethod
    def of128(data) -> str:
        return xxhash.xxh3_128_hexdigest(data)


def block_sums(data, start: int, block: int = CHECK_BLOCK) -> list[list]:
    """``[begin, end, xxh3]`` of ``data``, the bytes at offset ``start`` of their tensor,
    cut at multiples of ``block``."""
    mv = memoryview(data).cast("B")
    out = []
    pos, end = start, start + len(mv)
    while pos < end:
        stop = min(end, (pos // block + 1) * block)
        out.append([pos, stop, xxhash.xxh3_64_hexdigest(mv[pos - start : stop - start])])
        pos = stop
    return out


class BlockHasher:
    """:func:`block_sums` of a tensor's bytes fed in order, from offset 0."""

    def __init__(self, block: int = CHECK_BLOCK) -> None:
        self.block = block
        self.pos = 0
        self.start = 0
        self._h = xxhash.xxh3_64()
        self.ranges: list[list] = []

    def update(self, data) -> None:
        mv = memoryview(data).cast("B")
        i = 0
        while i < len(mv):
            k = min(len(mv) - i, (self.pos // self.block + 1) * self.block - self.pos)
            self._h.update(mv[i : i + k])
            i += k
            self.pos += k
            if self.pos % self.block == 0:
                self._cut()

    def _cut(self) -> None:
        if self.pos > self.start:
            self.ranges.append([self.start, self.pos, self._h.hexdigest()])
        self._h = xxhash.xxh3_64()
        self.start = self.pos

    def finish(self) -> list[list]:
        self._cut()
        return self.ranges
