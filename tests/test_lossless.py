"""Byte-grouped lossless frames (``Compression(lossless=True)``, unickpt.container): bit-exact
for every element size and value, smaller than the raw bytes where floats are, and every
inconsistent frame refused before a byte reaches the caller's buffer."""

import json
import os
import struct

import numpy as np
import pytest
import torch
import zstandard

import unickpt
from unickpt import container as C
from unickpt.errors import ChecksumError, FormatError, InvalidArgumentError


def _cctx():
    return zstandard.ZstdCompressor(compression_params=C._plane_params())


def _values(dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 0.02).to(dtype) if dtype.is_floating_point else torch.randint(
        -(1 << 30), 1 << 30, (n,), generator=g, dtype=torch.int64).to(dtype)
    if dtype.is_floating_point:  # specials: infinities, NaN with a payload, denormals, signed zeros
        x[:5] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1e-40]).to(dtype)
        bits = x.view(torch.int16 if x.element_size() == 2 else torch.int32)
        bits[5] = 0x7FC1 if x.element_size() == 2 else 0x7FC00123
    return x


def _bytes(x: torch.Tensor) -> bytes:
    return x.contiguous().view(torch.uint8).numpy().tobytes()


def _joined(parts) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) for p in parts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int16])
@pytest.mark.parametrize("extra", [0, 1, 3])  # bytes past the last whole element: stored as is
def test_planes_round_trip_bit_exact(dtype, extra):
    raw = _bytes(_values(dtype, 10_001)) + b"\x07" * extra
    stride = torch.empty(0, dtype=dtype).element_size()
    stored = _joined(C.encode_planes(memoryview(raw), stride, _cctx()))
    assert bytes(C.decode_planes(memoryview(stored), len(raw), "f")) == raw
    out = bytearray(len(raw))  # (and decoded into a caller's buffer)
    C.decode_planes(memoryview(stored), len(raw), "f", memoryview(out))
    assert bytes(out) == raw


@pytest.mark.parametrize("stride", [2, 4])
def test_planes_of_elements_at_odd_addresses_round_trip(stride):
    """The compiled split and join read and write words at any address: a frame cut from a
    buffer at an odd offset, decoded into a caller's window at another odd offset."""
    raw = _bytes(_values(torch.bfloat16 if stride == 2 else torch.float32, 4097))
    src = bytearray(len(raw) + 1)
    src[1:] = raw
    stored = _joined(C.encode_planes(memoryview(src)[1:], stride, _cctx()))
    out = bytearray(len(raw) + 3)
    C.decode_planes(memoryview(stored), len(raw), "f", memoryview(out)[3:])
    assert bytes(out[3:]) == raw and bytes(out[:3]) == b"\0\0\0"


def test_a_caller_buffer_of_another_size_or_read_only_is_refused_before_a_byte_is_written():
    raw = _bytes(_values(torch.float32, 1000))
    stored = _joined(C.encode_planes(memoryview(raw), 4, _cctx()))
    for out in (bytearray(len(raw) + 4), bytearray(len(raw) - 4)):
        with pytest.raises(ValueError, match="f: a byte-grouped frame of 4000 bytes"):
            C.decode_planes(memoryview(stored), len(raw), "f", memoryview(out))
        assert not any(out)
    with pytest.raises(ValueError, match="read-only"):
        C.decode_planes(memoryview(stored), len(raw), "f", memoryview(bytes(len(raw))))


def test_floats_shrink_by_their_exponents_and_zeros_by_every_part():
    w = _bytes(_values(torch.bfloat16, 1 << 20))
    stored = _joined(C.encode_planes(memoryview(w), 2, _cctx()))
    assert len(w) / len(stored) > 1.3  # the exponent plane of normal values is ~2.7 bits
    modes = [stored[1 + 5 * i] for i in range(2)]
    assert modes == [0, 1]  # the mantissa plane is stored as is, the exponent plane coded
    z = np.zeros(1 << 18, dtype=np.float32)
    z[::1000] = 1.5  # mostly zeros (untouched rows of a moment): every part gains
    stored = _joined(C.encode_planes(memoryview(z.view(np.uint8)), 4, _cctx()))
    assert [stored[1 + 5 * i] for i in range(3)] == [1, 1, 1] and len(stored) < z.nbytes / 50


def _frame(parts, stride=2, table=None):
    head = struct.pack("<B", stride) + b"".join(struct.pack("<BI", m, len(p)) for m, p in (table or parts))
    return head + b"".join(p for _, p in parts)


@pytest.mark.parametrize("case", ["stride", "mode", "short", "raw length", "declares more", "declares less",
                                  "not zstd", "tail", "table cut"])
def test_a_damaged_frame_is_refused_before_anything_is_written(case):
    n = 64
    lo, hi = bytes(range(n)), bytes([0x3F] * n)
    z = _cctx().compress(hi)
    frame = {
        "stride": _frame([(0, lo), (1, z)], stride=3),
        "mode": _frame([(2, lo), (1, z)]),
        "short": _frame([(0, lo), (1, z)])[:-3],
        "raw length": _frame([(0, lo[:-1]), (1, z)]),
        "declares more": _frame([(0, lo), (1, _cctx().compress(hi + b"x"))]),
        "declares less": _frame([(0, lo), (1, _cctx().compress(hi[:-1]))]),
        "not zstd": _frame([(0, lo), (1, b"\x00" * 12)]),
        "tail": _frame([(0, lo), (1, z)]) + b"!",
        "table cut": struct.pack("<B", 2) + b"\x00\x01",
    }[case]
    out = bytearray(b"\xee" * (2 * n))
    with pytest.raises(FormatError, match="byte-grouped frame"):
        C.decode_planes(memoryview(frame), 2 * n, "ckpt/f.safetensors", memoryview(out))
    assert out == bytearray(b"\xee" * (2 * n))


def test_frame_tables_accept_byte_grouped_frames_and_refuse_unknown_kinds():
    assert C.check_frames([[0, 10, 0, 7, 2]], 10, 7, "f")
    with pytest.raises(FormatError):
        C.check_frames([[0, 10, 0, 7, 3]], 10, 7, "f")


@pytest.mark.parametrize("kind", [C.ZSTD, C.PLANES])
def test_a_coded_frame_never_stores_more_than_its_logical_bytes(kind):
    """A reader allocates a frame's stored bytes: a table whose coded frame claims more (a
    sparse file makes such a size free on disk) is refused, so a read's memory is bounded by
    FRAME_MAX, not by the file."""
    with pytest.raises(FormatError, match="stores more bytes"):
        C.check_frames([[0, 4096, 0, 4 << 30, kind]], 4096, 4 << 30, "f")
    assert C.check_frames([[0, 4096, 0, 4096, kind]], 4096, 4096, "f")


class _Mem:
    def __init__(self):
        self.buf = bytearray()
        self.path, self.bytes_read = "mem", 0

    def write_at(self, pos, mv):
        self.buf[pos:pos + len(mv)] = mv

    def readinto(self, off, out):
        out[:] = memoryview(self.buf)[off:off + len(out)]

    @property
    def size(self):
        return len(self.buf)

    def close(self):
        pass


def test_reads_of_any_range_equal_the_written_bytes():
    """Whole frames are decoded in place, partial ones through the reader's frame cache:
    both give the logical bytes, across frames of different element sizes."""
    a = _bytes(_values(torch.float32, 3 << 20))  # 12 MiB: three frames
    b = _bytes(_values(torch.bfloat16, (5 << 20) + 3, seed=1))
    raw = a + b
    inner = _Mem()
    w = C.ZstdWriter(inner, elements=[(0, len(a), 4), (len(a), len(raw), 2)])
    w.write_at(0, memoryview(a))
    w.write_at(len(a), memoryview(b))
    assert {f[4] for f in w.frames} == {C.PLANES} and inner.size < len(raw) / 1.15
    r = C.ZstdReader(inner, w.frames, len(raw), inner.size)
    rng = np.random.default_rng(0)
    spans = [(0, len(raw)), (C.FRAME, 2 * C.FRAME), (len(a) - 5, len(a) + 7)]
    spans += [tuple(sorted(rng.integers(0, len(raw), 2).tolist())) for _ in range(20)]
    for lo, hi in spans:
        out = bytearray(hi - lo)
        r.readinto(lo, memoryview(out))
        assert out == raw[lo:hi], (lo, hi)


def _state():
    g = torch.Generator().manual_seed(3)
    w = {f"l{i}.weight": torch.randn(256, 128, generator=g) * 0.02 for i in range(4)}
    return {"model": {k: v.bfloat16() for k, v in w.items()}, "master": w,
            "optimizer": {f"state.{k}.exp_avg": torch.randn(256, 128, generator=g) * 1e-4 for k in w}}


def _zeros(sd):
    return {r: {k: torch.zeros_like(v) for k, v in d.items()} for r, d in sd.items()}


def test_a_lossless_checkpoint_loads_bit_exact_and_is_smaller(tmp_path):
    sd = _state()
    plain, packed = tmp_path / "plain", tmp_path / "lossless"
    unickpt.save(sd, plain)
    unickpt.save(sd, packed, options=unickpt.SaveOptions(compression=unickpt.Compression(lossless=True)))
    man = json.loads((packed / "unickpt.json").read_text())
    assert man["compression"]["lossless"] is True
    size = {d: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
            for d in (plain, packed)}
    assert size[plain] / size[packed] > 1.15
    for f in man["files"].values():  # every role, model included, stored byte-grouped
        assert f["container"] == "zstd" and any(fr[4] == C.PLANES for fr in f["frames"]), f
    for verify in ("auto", "full"):
        t = _zeros(sd)
        unickpt.load(t, packed, verify=verify)
        for r in sd:
            for k in sd[r]:
                assert torch.equal(t[r][k].view(torch.uint8), sd[r][k].view(torch.uint8)), (r, k)


def test_a_damaged_lossless_file_fails_the_load(tmp_path):
    sd = _state()
    p = tmp_path / "ck"
    unickpt.save(sd, p, options=unickpt.SaveOptions(compression=unickpt.Compression(lossless=True)))
    man = json.loads((p / "unickpt.json").read_text())
    fname, fe = next((n, f) for n, f in man["files"].items() if n.startswith("model"))
    frame = next(fr for fr in fe["frames"] if fr[4] == C.PLANES)
    with open(p / fname, "r+b") as f:  # a byte of a raw (mantissa) plane: decodes, the checksum fails
        f.seek(frame[2] + frame[3] - 100)
        b = f.read(1)
        f.seek(frame[2] + frame[3] - 100)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises((ChecksumError, FormatError)):
        unickpt.load(_zeros(sd), p)


def test_lossless_options_are_checked():
    with pytest.raises(InvalidArgumentError, match="replaces zstd"):
        unickpt.Compression(lossless=True, zstd=3)
    with pytest.raises(InvalidArgumentError, match="lossless"):
        unickpt.Compression(lossless="yes")
    assert unickpt.Compression(lossless=True).active


def test_frames_are_coded_on_threads_and_a_forked_child_codes_its_own():
    """Several frames of one write are coded at once and written in order (the same bytes as
    one thread codes); a child forked after the parent coded gets its own coder threads (an
    executor inherited through fork has none: submitting to it would wait forever)."""
    import signal

    raw = _bytes(_values(torch.float32, 3 << 20))
    inner = _Mem()
    C.ZstdWriter(inner, elements=[(0, len(raw), 4)]).write_at(0, memoryview(raw))
    alone = _Mem()
    w = C.ZstdWriter(alone, elements=[(0, len(raw), 4)])
    for a in range(0, len(raw), C.FRAME):  # one frame per call: coded on the caller's thread
        w.write_at(a, memoryview(raw)[a:a + C.FRAME])
    assert inner.buf == alone.buf
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        signal.alarm(60)
        child = _Mem()
        C.ZstdWriter(child, elements=[(0, len(raw), 4)]).write_at(0, memoryview(raw))
        os._exit(0 if child.buf == inner.buf else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_threads_reading_parts_of_one_frame_read_and_decode_it_once():
    """Read threads share the reader's decoded frames: a frame that several pieces cut is
    read from storage once (a rank's reads of a lossless file stay near its stored bytes),
    and every thread gets the right bytes."""
    import threading

    raw = _bytes(_values(torch.float32, 3 << 20))  # three frames
    inner = _Mem()
    w = C.ZstdWriter(inner, elements=[(0, len(raw), 4)])
    w.write_at(0, memoryview(raw))
    reads = []
    real = inner.readinto

    def counted(off, out):
        reads.append(len(out))
        real(off, out)
    inner.readinto = counted
    r = C.ZstdReader(inner, w.frames, len(raw), inner.size)
    bad = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(40):
            lo = int(rng.integers(0, len(raw) - (1 << 20)))
            out = bytearray(1 << 20)
            r.readinto(lo, memoryview(out))
            if out != raw[lo:lo + (1 << 20)]:
                bad.append(lo)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and sum(reads) == inner.size  # each frame's stored bytes once
