"""zstd-framed checkpoint files: a safetensors file stored as independent zstd frames.

A compressed file holds the bytes of an ordinary unickpt safetensors file (its *logical*
bytes: header and data, at the offsets the manifest records) cut into frames of at most
``FRAME`` logical bytes, each compressed on its own (or stored as is when zstd would not
shrink it). The manifest lists every frame as ``[logical begin, logical end, file offset,
stored length, compressed?]``; the frames tile the logical file. A reader of any logical
byte range decompresses only the frames it overlaps, so lazy slices, resharding and
checksums (which cover logical bytes) work exactly as with plain files.

Writes may come in any order (a quantized tensor's codes and scales interleave); frames are
appended to the file as they come.
"""

from __future__ import annotations

import bisect
import io
import threading
from collections import OrderedDict

import zstandard

from .errors import FormatError


__all__ = ["FRAME", "FRAME_MAX", "ZstdWriter", "ZstdReader", "check_frames"]

FRAME = 4 << 20  # logical bytes per frame written
FRAME_MAX = 64 << 20  # largest frame a reader accepts (bounds decompression memory)
WORTH = 0.97  # keep a compressed frame only if it is at most this fraction of the raw bytes
# Most logical bytes one stored byte of a zstd frame can hold: a block regenerates at most
# 128 KiB and takes at least 4 bytes (an RLE block), so no valid frame expands further.
ZSTD_MAX_RATIO = 1 << 15


class ZstdWriter:
    """Wraps an :class:`~unickpt.io.storage.ExtentWriter` of a fresh (empty) file."""

    direct = False

    def __init__(self, inner, level: int) -> None:
        self.inner = inner
        self.cctx = zstandard.ZstdCompressor(level=level)
        self.pos = 0  # stored bytes so far
        self.frames: list[list[int]] = []
        self.logical = 0  # logical bytes written

    @property
    def bytes_written(self) -> int:
        return self.logical

    def write_at(self, offset: int, data: memoryview, stable: bool = False) -> None:
        view = memoryview(data).cast("B")
        for a in range(0, len(view), FRAME):
            raw = view[a : a + FRAME]
            comp = self.cctx.compress(raw)
            z = len(comp) <= WORTH * len(raw)
            out = comp if z else raw
            self.inner.write_at(self.pos, memoryview(out))
            self.frames.append([offset + a, offset + a + len(raw), self.pos, len(out), int(z)])
            self.pos += len(out)
            self.logical += len(raw)

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
        if b != pos or e <= b or e - b > FRAME_MAX or off < 0 or n < 0 or off + n > stored or z not in (0, 1):
            raise FormatError(f"{where}: frame {f} does not continue the logical file at {pos} within {stored} stored bytes")
        if not z and n != e - b:
            raise FormatError(f"{where}: uncompressed frame {f} must store exactly its logical bytes")
        if z and e - b > n * ZSTD_MAX_RATIO:
            raise FormatError(f"{where}: compressed frame {f} claims more logical bytes than {n} zstd bytes can hold")
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
        self._local = threading.local()  # a few decompressed frames, per thread (codes and scales alternate)

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    CACHE = 4

    def _frame(self, i: int) -> memoryview:
        cache = getattr(self._local, "c", None)
        if cache is None:
            cache = self._local.c = OrderedDict()
        if i in cache:
            cache.move_to_end(i)
            return cache[i]
        b, e, off, n, z = self.frames[i]
        buf = bytearray(n)
        self.inner.readinto(off, memoryview(buf))
        if z:
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
        mv = memoryview(buf)
        cache[i] = mv
        if len(cache) > self.CACHE:
            cache.popitem(last=False)
        return mv

    def readinto(self, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        n = len(out)
        if offset < 0 or offset + n > self.size:
            raise FormatError(f"{self.path}: read of {n} bytes at {offset} runs past the end ({self.size} logical bytes)")
        done = 0
        i = bisect.bisect_right(self.starts, offset) - 1
        while done < n:
            b, e = self.frames[i][0], self.frames[i][1]
            data = self._frame(i)
            a = offset + done - b
            k = min(n - done, e - b - a)
            out[done : done + k] = data[a : a + k]
            done += k
            i += 1

    def close(self) -> None:
        self._local = threading.local()
        self.inner.close()
