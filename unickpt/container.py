"""zstd-framed checkpoint files: a safetensors file stored as independent zstd frames.

A compressed file holds the bytes of an ordinary unickpt safetensors file (its *logical*
bytes: header and data, at the offsets the manifest records) cut into frames of at most
``FRAME`` logical bytes, each compressed on its own (or stored as is when zstd would not
shrink it). The manifest lists every frame as ``[logical begin, logical end, file offset,
stored length, kind]``; the frames tile the logical file. A reader of any logical
byte range decompresses only the frames it overlaps, so lazy slices, resharding and
checksums (which cover logical bytes) work exactly as with plain files.

Writes may come in any order (a quantized tensor's codes and scales interleave); frames are
appended to the file as they come.

A frame is stored one of three ways (the frame's ``kind`` in the manifest):

* ``0``: as is (zstd would not shrink it);
* ``1``: one zstd frame (``zstd=LEVEL``);
* ``2``: **byte-grouped** (``Compression(lossless=True)``, ZipNN's method): the elements of
  the tensor the frame lies in are cut into byte planes (plane ``i`` holds byte ``i`` of every
  element: for bf16 the high plane holds the sign and 7 exponent bits, for fp32 the two high
  planes the sign, the exponent and the top mantissa bits), and each plane that shrinks is
  entropy-coded on its own by zstd with matching turned all but off (its Huffman coding of
  literals is what gains: exponents are few and skewed, mantissas near random). Layout:
  ``stride`` (u8), then per part (:data:`PARTS`: two byte planes for two-byte elements; the
  low halves, byte 2's plane and byte 3's for four-byte ones) ``mode`` (u8: 0 raw, 1 zstd)
  and stored length (u32 LE), then the parts, then the ``len % stride`` tail bytes as is.
"""

from __future__ import annotations

import bisect
import functools
import io
import struct
import threading
from collections import OrderedDict

import numpy as np
import zstandard

from ._coders import in_order
from .errors import FormatError
from .format import itemsize


__all__ = ["FRAME", "FRAME_MAX", "ZstdWriter", "ZstdReader", "check_frames", "elements_of", "encode_planes",
           "decode_planes"]

FRAME = 4 << 20  # logical bytes per frame written
FRAME_MAX = 64 << 20  # largest frame a reader accepts (bounds decompression memory)
WORTH = 0.97  # keep a compressed frame only if it is at most this fraction of the raw bytes
# Most logical bytes one stored byte of a zstd frame can hold: a block regenerates at most
# 128 KiB and takes at least 4 bytes (an RLE block), so no valid frame expands further.
ZSTD_MAX_RATIO = 1 << 15
RAW, ZSTD, PLANES = 0, 1, 2  # how a frame is stored (its kind in the manifest)
SAMPLE = 64 << 10  # bytes of a low plane tried first: the whole plane is coded only if these shrink
SAMPLE_WORTH = 0.9


def _plane_params() -> zstandard.ZstdCompressionParameters:
    """zstd as an entropy coder: matches all but off (a byte plane of floats has few), so the
    time goes to the Huffman coding of its literals. Measured on a trained Llama's bf16
    weights: 1.49x at ~1 GB/s per plane, where level 1 gives 1.46x at under half that."""
    return zstandard.ZstdCompressionParameters(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
                                               target_length=0, strategy=zstandard.STRATEGY_FAST)


def elements_of(header: bytes) -> list[tuple[int, int, int]]:
    """``[(begin, end, itemsize)]`` in logical file bytes of the tensors a safetensors header
    (one this process built) describes: where a byte-grouped writer cuts planes of which size."""
    import json

    (n,) = struct.unpack("<Q", header[:8])
    obj = json.loads(bytes(header[8:8 + n]))
    return sorted((8 + n + t["data_offsets"][0], 8 + n + t["data_offsets"][1], itemsize(t["dtype"]))
                  for k, t in obj.items() if k != "__metadata__")


_WORD = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # an element as a little-endian word: byte i is (w >> 8i) & 0xff


def _fused():
    """The compiled byte-plane loops (numba, imported on first use; :mod:`unickpt.codecs.fused`)."""
    from .codecs import fused

    return fused


def _planes(raw: memoryview, stride: int, n: int) -> list[np.ndarray]:
    """The parts of the first ``n`` elements of ``raw`` (:data:`PARTS`): for two-byte elements
    the low and the high byte planes; for four-byte ones the low halves (two bytes each:
    mantissa, near random) and the planes of byte 2 and byte 3 of each element. One
    compiled pass over the elements."""
    f = _fused()
    if stride == 2:
        lo, hi = np.empty(n, np.uint8), np.empty(n, np.uint8)
        f.split2(np.frombuffer(raw, dtype=_WORD[2], count=n), lo, hi)
        return [lo, hi]
    low, b2, b3 = np.empty(n, _WORD[2]), np.empty(n, np.uint8), np.empty(n, np.uint8)
    f.split4(np.frombuffer(raw, dtype=_WORD[4], count=n), low, b2, b3)
    return [low.view(np.uint8), b2, b3]


def _interleave(parts: list[np.ndarray], out: memoryview, stride: int, n: int) -> None:
    """Inverse of :func:`_planes`, into the first ``n`` elements of ``out``."""
    f = _fused()
    if stride == 2:
        f.join2(parts[0], parts[1], np.frombuffer(out, dtype=_WORD[2], count=n))
        return
    f.join4(parts[0].view(_WORD[2]), parts[1], parts[2], np.frombuffer(out, dtype=_WORD[4], count=n))


PARTS = {2: (1, 1), 4: (2, 1, 1)}
"""Bytes per element of each part of a byte-grouped frame, by element size: two-byte elements
as two byte planes (low, high); four-byte elements as their low halves, then the planes of
byte 2 and byte 3 (the sign and exponent live in the last part, the top mantissa bits of
fp32 in the one before)."""


def encode_planes(raw: memoryview, stride: int, cctx: zstandard.ZstdCompressor) -> list:
    """A byte-grouped frame (kind 2, see the module doc) of ``raw``, elements of ``stride``
    bytes, as the buffers to store one after another."""
    if stride not in PARTS:
        raise ValueError(f"byte planes of {stride}-byte elements")
    raw = memoryview(raw).cast("B")
    n = len(raw) // stride
    parts = _planes(raw, stride, n)
    head = [struct.pack("<B", stride)]
    body: list = []
    for i, part in enumerate(parts):
        # the exponent's part is coded; the others only if a sample of them shrinks (mantissa
        # bytes are near random: coding them costs time for nothing)
        coded = None
        if i == len(parts) - 1 or len(cctx.compress(part[:SAMPLE])) < SAMPLE_WORTH * min(SAMPLE, len(part)):
            coded = cctx.compress(part)
        if coded is not None and len(coded) < len(part):
            head.append(struct.pack("<BI", 1, len(coded)))
            body.append(coded)
        else:
            head.append(struct.pack("<BI", 0, len(part)))
            body.append(memoryview(part))
    return [b"".join(head), *body, raw[n * stride:]]


def decode_planes(stored: memoryview, size: int, where: str, out: memoryview | None = None) -> memoryview:
    """The ``size`` logical bytes of a byte-grouped frame, into ``out`` (``size`` bytes) or a
    new buffer; anything inconsistent (a stride, mode or length no encoder writes, a part
    that does not decode to exactly its bytes) is a :class:`FormatError` naming ``where``,
    raised before anything is written into ``out``. Memory: its parts (and ``size`` bytes
    without ``out``)."""
    stored = memoryview(stored).cast("B")
    if out is not None:  # (a caller's error, before anything is decoded or written)
        out = memoryview(out).cast("B")
        if len(out) != size or out.readonly:
            raise ValueError(f"{where}: a byte-grouped frame of {size} bytes decodes into a writable buffer of "
                             f"that size, not {'a read-only one' if out.readonly else f'{len(out)} bytes'}")
    if len(stored) < 1 or stored[0] not in PARTS:
        raise FormatError(f"{where}: byte-grouped frame with stride {stored[0] if len(stored) else None}")
    stride = stored[0]
    n = size // stride
    widths = PARTS[stride]
    pos = 1 + 5 * len(widths)
    if len(stored) < pos:
        raise FormatError(f"{where}: byte-grouped frame shorter than its part table")
    parts = []
    for i, width in enumerate(widths):
        mode, length = struct.unpack_from("<BI", stored, 1 + 5 * i)
        blob = stored[pos:pos + length]
        want = n * width
        if mode not in (0, 1) or len(blob) != length or (mode == 0 and length != want):
            raise FormatError(f"{where}: part {i} of a byte-grouped frame: mode {mode}, {length} bytes "
                              f"({len(blob)} stored, {want} expected)")
        if mode:
            try:
                declared = zstandard.frame_content_size(blob)
            except zstandard.ZstdError:
                declared = None
            if declared != want:  # never trust a frame's own size: it must say exactly the part's
                raise FormatError(f"{where}: part {i} of a byte-grouped frame declares {declared} bytes, "
                                  f"expected {want}")
            try:
                blob = zstandard.ZstdDecompressor().decompress(blob, max_output_size=want)
            except zstandard.ZstdError as err:
                raise FormatError(f"{where}: part {i} of a byte-grouped frame does not decompress ({err})") from None
            if len(blob) != want:
                raise FormatError(f"{where}: part {i} of a byte-grouped frame holds {len(blob)} bytes, expected {want}")
        parts.append(np.frombuffer(blob, dtype=np.uint8))
        pos += length
    tail = stored[pos:]
    if len(tail) != size - n * stride:
        raise FormatError(f"{where}: byte-grouped frame has {len(tail)} tail bytes, expected {size - n * stride}")
    out = memoryview(np.empty(size, dtype=np.uint8)) if out is None else out
    _interleave(parts, out, stride, n)
    out[n * stride:] = tail
    return out


class ZstdWriter:
    """Wraps an :class:`~unickpt.io.storage.ExtentWriter` of a fresh (empty) file, framing what
    is written: zstd frames at ``level``, or (``elements``: ``[(begin, end, itemsize)]`` of
    the file's logical bytes, the tensors' element sizes) byte-grouped frames, each cut at
    the element size of the tensor it starts in (other sizes: one zstd frame as an entropy
    coder)."""

    direct = False

    def __init__(self, inner, level: int | None = None, elements: list[tuple[int, int, int]] | None = None) -> None:
        self.inner = inner
        self.level = level or 3
        self.elements = sorted(elements) if elements is not None else None
        self._starts = [e[0] for e in self.elements or ()]
        self._ctx = threading.local()  # a compressor per thread (zstd contexts are not shared)
        self.pos = 0  # stored bytes so far
        self.frames: list[list[int]] = []
        self.logical = 0  # logical bytes written

    @property
    def cctx(self) -> zstandard.ZstdCompressor:
        c = getattr(self._ctx, "c", None)
        if c is None:
            c = self._ctx.c = (zstandard.ZstdCompressor(compression_params=_plane_params()) if self.elements is not None
                               else zstandard.ZstdCompressor(level=self.level))
        return c

    @property
    def bytes_written(self) -> int:
        return self.logical

    def _stride(self, offset: int) -> int:
        i = bisect.bisect_right(self._starts, offset) - 1
        if i >= 0 and offset < self.elements[i][1]:
            return self.elements[i][2]
        return 1

    def _encode(self, offset: int, raw: memoryview) -> tuple[int, bytes | memoryview]:
        if self.elements is not None:
            stride = self._stride(offset)
            if stride in PARTS and len(raw) >= stride:
                out = encode_planes(raw, stride, self.cctx)
                n = sum(len(memoryview(b).cast("B")) for b in out)
                return (PLANES, out) if n <= WORTH * len(raw) else (RAW, [raw])
        comp = self.cctx.compress(raw)
        return (ZSTD, [comp]) if len(comp) <= WORTH * len(raw) else (RAW, [raw])

    def write_at(self, offset: int, data: memoryview, stable: bool = False) -> None:
        """Frame ``data`` (logical bytes from ``offset``) and append the frames; returns once
        every byte of ``data`` is coded and handed to the file. Several frames are coded at
        once on the process's coder threads (:mod:`unickpt._coders`: zstd and the compiled
        byte-plane loops release the GIL), written in order."""
        view = memoryview(data).cast("B")
        starts = range(0, len(view), FRAME)
        coded = in_order(functools.partial(self._encode, offset + a, view[a : a + FRAME]) for a in starts)
        try:
            for a, (kind, parts) in zip(starts, coded):
                raw = view[a : a + FRAME]
                start = self.pos
                for b in parts:
                    b = memoryview(b).cast("B")
                    if len(b):
                        self.inner.write_at(self.pos, b)
                        self.pos += len(b)
                self.frames.append([offset + a, offset + a + len(raw), start, self.pos - start, kind])
                self.logical += len(raw)
        finally:
            coded.close()  # (after an error: no coder still reads ``data``)

    def close(self) -> list:
        self.inner.close()
        self.frames.sort()
        return []

    def abort(self) -> None:
        self.inner.abort()


def check_frames(frames, size: int, stored: int, where: str) -> list[tuple[int, int, int, int, int]]:
    """Validate a manifest frame list: tiles ``[0, size)`` logically, frames bounded, and
    their stored ranges tile ``[0, stored)`` without overlap (so the logical size is bounded
    by what the file really holds: at most FRAME_MAX per stored frame, and at most what zstd
    can expand its stored bytes to)."""
    out = []
    pos = 0
    if not isinstance(frames, list):
        raise FormatError(f"{where}: frames must be a list")
    for f in frames:
        if not (isinstance(f, list) and len(f) == 5 and all(type(x) is int for x in f)):
            raise FormatError(f"{where}: each frame must be [begin, end, offset, length, compressed]")
        b, e, off, n, z = f
        if b != pos or e <= b or e - b > FRAME_MAX or off < 0 or n < 0 or off + n > stored or z not in (RAW, ZSTD, PLANES):
            raise FormatError(f"{where}: frame {f} does not continue the logical file at {pos} within {stored} stored bytes")
        if not z and n != e - b:
            raise FormatError(f"{where}: uncompressed frame {f} must store exactly its logical bytes")
        if z and e - b > n * ZSTD_MAX_RATIO:
            raise FormatError(f"{where}: compressed frame {f} claims more logical bytes than {n} zstd bytes can hold")
        if z and n > e - b:  # writers keep a coded frame only when it is smaller: this bounds a read's memory
            raise FormatError(f"{where}: coded frame {f} stores more bytes than its logical ones")
        out.append((b, e, off, n, z))
        pos = e
    if pos != size:
        raise FormatError(f"{where}: frames cover {pos} of {size} logical bytes")
    spos = 0
    for _, _, off, n, _ in sorted(out, key=lambda f: f[2]):
        if off != spos:
            raise FormatError(f"{where}: stored frames overlap or leave a gap at byte {spos} of {stored}")
        spos = off + n
    if spos != stored:
        raise FormatError(f"{where}: stored frames cover {spos} of {stored} bytes")
    return out


class ZstdReader:
    """A :class:`~unickpt.io.storage.RandomReader` over the logical bytes of a framed file."""

    def __init__(self, inner, frames, size: int, stored: int) -> None:
        self.inner = inner
        self.path = inner.path
        if inner.size != stored:
            raise FormatError(f"{inner.path}: {inner.size} bytes on disk, the manifest records {stored} (truncated or replaced?)")
        self.frames = check_frames(frames, size, stored, inner.path)
        self.starts = [f[0] for f in self.frames]
        self.size = size
        # a few decompressed frames, shared by the reading threads (a frame two pieces cut is
        # read and decoded once; codes and scales alternate), and the frames being decoded now
        self._cache: OrderedDict[int, memoryview] = OrderedDict()
        self._busy: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    CACHE = 8

    def _stored(self, i: int) -> memoryview:
        _, _, off, n, _ = self.frames[i]
        buf = memoryview(np.empty(n, dtype=np.uint8))
        self.inner.readinto(off, buf)
        return buf

    def _frame(self, i: int) -> memoryview:
        with self._lock:
            if i in self._cache:
                self._cache.move_to_end(i)
                return self._cache[i]
            ev = self._busy.get(i)
            mine = ev is None
            if mine:
                ev = self._busy[i] = threading.Event()
        if not mine:  # another thread decodes it: wait, then take it (or, gone already, decode it here)
            ev.wait()
            with self._lock:
                if i in self._cache:
                    return self._cache[i]
            return self._decode(i)
        try:
            mv = self._decode(i)
            with self._lock:
                self._cache[i] = mv
                if len(self._cache) > self.CACHE:
                    self._cache.popitem(last=False)
            return mv
        finally:
            with self._lock:
                self._busy.pop(i, None)
            ev.set()

    def _decode(self, i: int) -> memoryview:
        b, e, off, n, z = self.frames[i]
        buf = self._stored(i)
        if z == PLANES:
            buf = decode_planes(buf, e - b, f"{self.path}: frame at logical byte {b}")
        elif z:
            # never trust the frame's own content size: read at most one byte more than expected
            try:
                parts, want = [], e - b + 1
                with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(buf)) as r:
                    while want > 0:
                        chunk = r.read(want)
                        if not chunk:
                            break
                        parts.append(chunk)
                        want -= len(chunk)
                data = b"".join(parts)
            except zstandard.ZstdError as err:
                raise FormatError(f"{self.path}: frame at logical byte {b} does not decompress ({err})") from None
            if len(data) != e - b:
                raise FormatError(f"{self.path}: frame at logical byte {b} holds {len(data)}+ bytes, expected {e - b}")
            buf = data
        return memoryview(buf)

    def readinto(self, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        n = len(out)
        if offset < 0 or offset + n > self.size:
            raise FormatError(f"{self.path}: read of {n} bytes at {offset} runs past the end ({self.size} logical bytes)")
        done = 0
        i = bisect.bisect_right(self.starts, offset) - 1
        while done < n:
            b, e, z = self.frames[i][0], self.frames[i][1], self.frames[i][4]
            a = offset + done - b
            k = min(n - done, e - b - a)
            if z == RAW:  # stored as is: only the bytes asked for
                self.inner.readinto(self.frames[i][2] + a, out[done : done + k])
            elif z == PLANES and a == 0 and k == e - b:  # a whole byte-grouped frame: decoded in place
                decode_planes(self._stored(i), k, f"{self.path}: frame at logical byte {b}", out[done : done + k])
            else:
                out[done : done + k] = self._frame(i)[a : a + k]
            done += k
            i += 1

    def close(self) -> None:
        with self._lock:
            self._cache.clear()
        self.inner.close()
