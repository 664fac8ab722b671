"""Codecs for optimizer state and master weights. Pure torch, no I/O, no communication.

Quantization groups are defined on the **full** tensor's row-major flattening, as
consecutive ranges of ``group`` elements (the last one may be shorter), so any reader of any
element range (another ZeRO partition, a TP block, one process) can decode exactly its slice:
it needs the codes of its range and the scales of the groups the range touches.

* O1 (8 bits): ``group`` = one row (``prod(shape[1:])`` elements; 2048-element blocks for
  1-D tensors).  O2 (4 bits): blocks of ``block`` elements (default 64), two codes per byte,
  element ``i`` in the low nibble of byte ``i // 2`` when ``i`` is even, the high nibble when
  odd.
* Adam's first moment ``m``: symmetric, ``q = round(m / s)`` with ``s = absmax / qmax``
  (qmax 127 or 7) per group; an all-zero group has ``s = 0`` and decodes to 0.
* The second moment ``v`` is quantized as ``w = sqrt(v) + eps`` (``eps`` the optimizer's own,
  so ``w`` is Adam's denominator) on a **geometric** grid per group: ``2^bits`` levels from the
  group's min ``w`` to its max, ``w_k = lo * (hi/lo)^(k/L)`` (``L = 2^bits - 1``), and
  ``v = (w - eps)^2`` on decode (codec ``q8_logw``/``q4_logw``). Every code decodes inside
  ``[lo, hi]``, so no code can give an update larger than the largest the group had at save
  (no zero denominator), and a value is never off by more than one level's ratio
  ``(hi/lo)^(1/L)``: the error is relative, the same for the group's large and small values.
  (Formats before this one quantized ``r = 1/w`` on a linear grid, ``q8_rinv``/``q4_rinv``:
  still decoded; docs/compression.md says why it was replaced.)
* O2's first moment (``q4_logm``) uses signed geometric levels instead of 15 linear ones:
  ``absmax * 1.5^-k`` (k = 0..6) and zero, nearest in log space (:func:`encode_mlog`).
* **Rounding.** The second moment is rounded stochastically (with a ``seed``) so that what
  Adam divides by is unbiased: ``E[1/w'] = 1/w``; v is forgotten slowly (``1/(1-beta2)``
  steps, 1000 at 0.999), so the errors of successive save/resume cycles must not line up.
  The uniforms come from a counter-based generator (Philox) keyed by the seed and addressed
  by the element's index in the full tensor: the codes do not depend on how the tensor is
  cut into chunks or ranks, and a state saved with the same seed gives the same bytes. The
  first moment is forgotten within ``1/(1-beta1)`` steps (10), long before the next cycle,
  and is rounded to nearest (half the error of stochastic rounding).
* Non-finite values, and negative ``v``, are refused with :class:`CodecError`.
* Master weights: ``split_master`` keeps the low 16 bits of each fp32 master weight next to
  the bf16 model weight (its round-to-nearest-even), and lists the rare elements the pair
  cannot reproduce (ties whose rounding went up, NaN payloads) as exceptions, so
  ``merge_master`` is bit-exact for every input.

The saved codecs (``q8_sym``, ``q4_logm``, ``q8_logw``, ``q4_logw``) and the master residual
run as compiled kernels (:mod:`.fused`, numba): one pass over each value's group while it is
in cache, the error record computed in the same pass, the GIL released (the writer's coder
threads run them side by side). What this module keeps in torch: the decoders' per-group
value tables (16 or 256 values per group, from the formulas above, gathered by a kernel),
and the codecs of earlier checkpoints (``q4_sym``, ``q8_rinv``/``q4_rinv``), worked in chunks
of whole groups (``CHUNK`` elements) so temporaries stay in cache and memory bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UnickptError

__all__ = [
    "CodecError",
    "group_size",
    "dither",
    "encode_m",
    "decode_m",
    "encode_mlog",
    "decode_mlog",
    "encode_w",
    "decode_w",
    "encode_v",
    "decode_v",
    "pack4",
    "unpack4",
    "split_master",
    "merge_master",
]

CHUNK = 1 << 18  # elements per chunk (1 MiB of fp32: stays in cache)
BLOCK = 64  # O2's default group (``Compression.block``): the one place it is set
ROW_BLOCK_1D = 2048


class CodecError(UnickptError, ValueError):
    """A value cannot be encoded (non-finite, negative variance) or stored codes are inconsistent."""


def group_size(shape: tuple[int, ...], bits: int, block: int = BLOCK) -> int:
    """Elements per quantization group of a tensor of ``shape`` (>= 1)."""
    if bits == 4:
        if block < 2 or block % 2:
            raise ValueError(f"O2 block size must be an even number >= 2, got {block}")
        return block
    if len(shape) >= 2:
        return max(1, math.prod(shape[1:]))
    return ROW_BLOCK_1D


def _qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return 127 if bits == 8 else 7


def _check_finite(x: torch.Tensor, what: str, base: int = 0) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).nonzero()[0, 0])
        raise CodecError(
            f"{what}: non-finite value {float(x.reshape(-1)[bad])} at element {bad + base}; refusing to quantize"
        )


RUN = 1 << 14
"""Elements per run of the fused kernels' scratch (64 KiB per buffer: stays in L2)."""


def _fk():
    """The compiled kernels (:mod:`fused`), imported on first use: numba's import (0.3 s)
    is paid by processes that quantize, not by every process that imports unickpt."""
    from . import fused

    return fused


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().reshape(-1).contiguous().numpy()


FLT_MIN, FLT_MAX = float(torch.finfo(torch.float32).tiny), float(torch.finfo(torch.float32).max)


def _scratch(dtype) -> np.ndarray:
    return np.empty(RUN, dtype=dtype)


def _errors(stats: list | None) -> np.ndarray:
    """The fused kernels' error record: ``[sum of squared errors, sum of squares, max |error|]``
    (empty: not asked for, not computed)."""
    return np.zeros(4 if stats is not None else 0, dtype=np.float64)  # (the 4th: kernel scratch)


def _record(stats: list | None, err: np.ndarray, n: int) -> None:
    """Add a kernel's record of ``n`` elements to ``stats`` (:func:`_tally`'s layout)."""
    if stats is None or n == 0:
        return
    _merge(stats, [float(err[0]), float(err[1]), float(err[2]), 0.0, n])


def _merge(stats: list, new: list) -> None:
    """``stats`` += one record ``[sum of squared errors, sum of squares, max |error|, 0, n]``."""
    if not stats:
        stats.extend(new)
    else:
        stats[0] += new[0]
        stats[1] += new[1]
        stats[2] = max(stats[2], new[2])
        stats[4] += new[4]


def _refused(x: np.ndarray, bad: int, what: str, base: int, nonneg: bool) -> None:
    """Raise for the element a kernel refused (``bad`` >= 0): non-finite, or negative where
    ``nonneg`` (the second moment)."""
    if bad < 0:
        return
    value = float(x[bad])
    if nonneg and math.isfinite(value) and value < 0:
        raise CodecError(f"{what}: negative second moment at element {bad + base}")
    raise CodecError(f"{what}: non-finite value {value} at element {bad + base}; refusing to quantize")


def _groups(start: int, count: int, group: int) -> int:
    """Groups that elements ``[start, start+count)`` touch."""
    return 0 if count <= 0 else (start + count - 1) // group - start // group + 1


def _enough(t: torch.Tensor, n: int, what: str, dtype: torch.dtype | None = None) -> None:
    """The compiled kernels index without bounds checks: their inputs are checked here
    (elements of ``dtype``, when given: counted as the kernel will read them)."""
    if dtype is not None and t.dtype != dtype:
        raise CodecError(f"{what}: {dtype} expected, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] < n:
        raise CodecError(f"{n} {what} needed, {t.numel()} given" + (f" (shape {list(t.shape)})" if t.dim() != 1 else ""))


MAX_INDEX = 1 << 62
"""Elements and groups the kernels address (int64 arithmetic: no sum of two may overflow);
the manifest caps shapes below it."""


def _check_args(bits: int, group: int, start: int = 0, count: int = 0) -> None:
    """The arguments every kernel trusts: a positive group (even at 4 bits), a range inside
    [0, MAX_INDEX)."""
    if bits not in (4, 8):
        raise CodecError(f"bits must be 4 or 8, got {bits!r}")
    if type(group) is not int or not 1 <= group < MAX_INDEX or (bits == 4 and group % 2):
        raise CodecError(f"group must be an integer in [1, 2^62){' and even at 4 bits' if bits == 4 else ''}, got "
                         f"{group!r}")
    if type(start) is not int or type(count) is not int or start < 0 or count < 0 or start + count >= MAX_INDEX:
        raise CodecError(f"elements [{start}, {start} + {count}) are outside [0, 2^62)")


def _gathered(codes: torch.Tensor, packed: bool, tables: torch.Tensor, group: int, start: int, count: int
              ) -> torch.Tensor:
    """Elements ``[start, start+count)`` as ``tables[group, code]`` (one row of values per
    group from group ``start // group`` on): codes one byte each, or packed nibbles from the
    byte of element ``start``."""
    out = torch.empty(count, dtype=torch.float32)
    if count:
        nbytes = (start % 2 + count + 1) // 2 if packed else count
        codes = codes.reshape(-1)
        _enough(codes, nbytes, "codes")
        width = 16 if packed else 256
        if tables.dim() != 2 or tables.shape[1] != width or tables.shape[0] < _groups(start, count, group):
            raise CodecError(f"{_groups(start, count, group)} groups' {width} values needed, got {list(tables.shape)}")
        _fk().dec_table(_np(codes[:nbytes].view(torch.uint8)), packed, _np(tables.reshape(-1).float()), width, group,
                        start, out.numpy())
    return out


DITHER_TABLE = 1 << 16
"""Uniforms in the dither table (256 KiB: stays in cache while a chunk is rounded)."""
_TABLE: list[torch.Tensor] = []


def _table() -> torch.Tensor:
    """The dither table, twice over (so any window of ``DITHER_TABLE`` values is one slice):
    Philox4x64 with key 0, 24 random bits per value, the same in every process."""
    if not _TABLE:
        raw = np.random.Philox(key=0, counter=[0, 0, 0, 0]).random_raw(DITHER_TABLE)
        t = torch.from_numpy((raw >> np.uint64(40)).astype(np.float32)).mul_(2.0 ** -24)
        _TABLE.append(torch.cat([t, t]))
    return _TABLE[0]


def _tally(stats: list | None, decoded: torch.Tensor, x: torch.Tensor) -> None:
    """Add the error of ``decoded`` (overwritten) against ``x`` to ``stats``: ``[sum of
    squared errors, sum of squares, max abs error, 0, elements]``. Sums per chunk in fp32
    (a dot product, at cache speed), across chunks in float64: a measurement, whose last
    digits depend on how a writer cut the tensor into chunks."""
    if stats is None or x.numel() == 0:
        return
    d = decoded.sub_(x)
    lo, hi = torch.aminmax(d)
    _merge(stats, [float(torch.dot(d, d)), float(torch.dot(x, x)), max(-float(lo), float(hi)), 0.0, x.numel()])


def _windows(seed: int, start: int, count: int):
    """``(offset, table slice)`` covering elements ``[start, start+count)``: element ``i``
    takes value ``(i + offset(seed)) mod DITHER_TABLE`` of the table."""
    table = _table()
    pos, done = (start + (seed * 0x9E3779B97F4A7C15 >> 16)) % DITHER_TABLE, 0
    while done < count:
        n = min(count - done, DITHER_TABLE)
        yield done, table[pos : pos + n]
        done += n


def dither(seed: int, start: int, count: int) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` for elements ``[start, start+count)`` of a tensor: element ``i``
    takes value ``(i + offset(seed)) mod DITHER_TABLE`` of a fixed random table, so any chunk
    of the tensor gets the values of the whole, and each seed (a tensor at a step) shifts the
    whole sequence: an element's draw changes from save to save. Elements ``DITHER_TABLE``
    apart share a draw within one save (harmless: each is rounded on its own). A window of
    the table, not a generator per element (~8 ns per value); the fused encoders read the table where it lies."""
    out = torch.empty(count, dtype=torch.float32)
    for at, window in _windows(seed, start, count):
        out[at : at + len(window)].copy_(window)
    return out


# -- 4-bit packing ------------------------------------------------------------------------


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15] -> bytes, two per byte (even index in the low nibble)."""
    c = codes.reshape(-1)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    w = c.contiguous().view(torch.int16)  # little-endian pairs: even code in the low byte
    return (w & 0x000F).bitwise_or_((w >> 4) & 0x00F0).to(torch.uint8)


def unpack4(packed: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Codes of elements ``[start, start+count)`` from bytes holding elements from
    ``2 * (start // 2)`` on (the byte containing element ``start`` first)."""
    both = torch.empty(packed.numel() * 2, dtype=torch.uint8)
    both[0::2] = packed & 0x0F
    both[1::2] = packed >> 4
    off = start % 2
    return both[off : off + count]


def _pack_into(out: torch.Tensor, start: int, q: torch.Tensor) -> None:
    """Pack float codes in [0, 15] of elements ``[start, start+len(q))`` (``start`` even)
    into ``out`` bytes, in float arithmetic on the cache-resident chunk."""
    k = q.numel()
    if k % 2:
        q = torch.cat([q, q.new_zeros(1)])
    pairs = q.view(-1, 2)
    out[start // 2 : start // 2 + pairs.shape[0]].copy_(torch.addcmul(pairs[:, 0], pairs[:, 1], q.new_tensor(16.0)))


# -- group-wise helpers -------------------------------------------------------------------------


def _aligned_chunks(start: int, count: int, group: int):
    """Split ``[start, start+count)`` at group boundaries into pieces of about CHUNK elements:
    ``(a, b)`` offsets relative to ``start``."""
    step = max(group, (CHUNK // group) * group)
    first = min(count, (-start) % group or 0)
    pos = 0
    if first:
        yield 0, first
        pos = first
    while pos < count:
        yield pos, min(count, pos + step)
        pos += step


def _per_group(x: torch.Tensor, start: int, group: int, buf: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` (elements from ``start``, not crossing a chunk) laid out in whole groups in
    ``buf``: returns the (n_groups, group) view, the offset of x in it, and the first group."""
    off = start % group
    ng = -(-(off + x.numel()) // group)
    view = buf[: ng * group]
    if off or x.numel() != ng * group:
        view.zero_()
    view[off : off + x.numel()].copy_(x)
    return view.view(ng, group), off, start // group


def _long_group_chunks(start: int, count: int, group: int):
    """Pieces ``(a, b, group index of each element)`` of ``[start, start+count)`` of at most
    CHUNK elements, group indices relative to the group of ``start`` (decoding groups longer
    than a chunk without a group-sized buffer)."""
    g_first = start // group
    for a in range(0, count, CHUNK):
        b = min(count, a + CHUNK)
        yield a, b, torch.arange(start + a, start + b, dtype=torch.int64).div_(group, rounding_mode="floor").sub_(g_first)


def _codes(codes: torch.Tensor, bits: int, base: int, a: int, b: int) -> torch.Tensor:
    """Codes of elements ``[base+a, base+b)`` as float, from the caller's codes starting at
    element ``base`` (8 bits) or at byte ``base // 2`` (4 bits)."""
    if bits == 8:
        return codes[a:b]
    first = (base % 2 + a) // 2
    last = (base % 2 + b + 1) // 2
    return unpack4(codes[first:last], base + a, b - a)


def _decode(codes: torch.Tensor, bits: int, group: int, start: int, count: int, params: tuple, fn) -> torch.Tensor:
    """Elements ``[start, start+count)`` decoded group by group: ``fn(c, *p)`` maps the float
    codes ``c`` of some groups and those groups' ``params`` (per-group tensors from group
    ``start // group`` on, shaped to broadcast) to values. Groups longer than a chunk are
    decoded per chunk with per-element parameters, without a group-sized scratch."""
    out = torch.empty(count, dtype=torch.float32)
    g_first = start // group
    if group > CHUNK:
        for a, b, idx in _long_group_chunks(start, count, group):
            out[a:b] = fn(_codes(codes, bits, start, a, b).float(), *(p[idx] for p in params))
        return out
    buf = torch.empty(max(group, (CHUNK // group) * group) + group)
    for a, b in _aligned_chunks(start, count, group):
        g, off, g0 = _per_group(_codes(codes, bits, start, a, b), start + a, group, buf)
        i = g0 - g_first
        out[a:b] = fn(g, *(p[i : i + g.shape[0], None] for p in params)).view(-1)[off : off + (b - a)]
    return out


# -- first moment: symmetric ----------------------------------------------------------------


def encode_m(m: torch.Tensor, bits: int, group: int, what: str = "exp_avg", base: int = 0,
             stats: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole groups of ``m`` (flat fp32) -> (codes, per-group scale). Codes: int8 for 8 bits
    (one per element), packed uint8 for 4 bits (offset by 8, two per byte). ``what`` and
    ``base`` (the tensor element ``m`` starts at) name a refused element in errors.
    ``stats``: the decoded values' error is added to it (:func:`_tally`), computed on the
    chunk while it is in cache."""
    _check_args(bits, group, base, m.numel())
    m = m.reshape(-1).float()
    qmax = _qmax(bits)
    n = m.numel()
    scale = torch.empty(-(-n // group), dtype=torch.float32)
    if bits == 8:  # O1: the fused kernel (4 bits here is q4_sym, earlier checkpoints' code)
        codes = torch.empty(n, dtype=torch.int8)
        x = _np(m)
        err = _errors(stats)
        bad = _fk().enc_sym8(x, group, codes.numpy(), scale.numpy(), err, _scratch(np.float32))
        _refused(x, bad, what, base, False)
        _record(stats, err, n)
        return codes, scale
    # 8 bits: float -> int8 directly; 4 bits: packed per chunk while it is in cache
    codes = torch.empty(n, dtype=torch.int8) if bits == 8 else torch.empty(-(-n // 2), dtype=torch.uint8)
    buf = torch.empty(max(group, (CHUNK // group) * group) + group)
    for a, b in _aligned_chunks(0, n, group):
        g, off, g0 = _per_group(m[a:b], a, group, buf)
        s = torch.maximum(g.amax(dim=1), g.amin(dim=1).neg_()).abs_().div_(qmax)  # amax/amin keep NaN; abs: +0 for zero groups (max(0, -0) is either)
        if not bool(torch.isfinite(s).all()):
            _check_finite(m[a:b], what, base + a)
        scale[g0 : g0 + len(s)] = s
        inv = torch.where(s > 0, s.reciprocal(), torch.zeros_like(s))
        g.mul_(inv[:, None]).round_().clamp_(-qmax, qmax)
        q = g.view(-1)[off : off + (b - a)]
        if bits == 4:
            _pack_into(codes, a, q.add_(8))
            q.sub_(8)
        else:
            codes[a:b].copy_(q)
        if stats is not None:
            _tally(stats, g.mul_(s[:, None]).view(-1)[off : off + (b - a)], m[a:b])
    return codes, scale


def decode_m(codes: torch.Tensor, scale: torch.Tensor, bits: int, group: int, start: int, count: int) -> torch.Tensor:
    """Elements ``[start, start+count)`` of the full tensor.

    ``codes``: for 8 bits the codes of exactly that range; for 4 bits the packed bytes from
    byte ``start // 2`` on. ``scale``: the scales of groups ``start // group`` onwards.
    """
    _check_args(bits, group, start, count)
    if bits == 8:
        out = torch.empty(count, dtype=torch.float32)
        codes, scale = codes.reshape(-1), scale.reshape(-1)
        _enough(codes, count, "codes", torch.int8)
        _enough(scale, _groups(start, count, group), "scales", torch.float32)
        _fk().dec_sym8(_np(codes[:count]), _np(scale[: _groups(start, count, group)]), group, start, out.numpy())
        return out

    def fn(c, s):
        return c.sub_(8).mul_(s)

    return _decode(codes, bits, group, start, count, (scale,), fn)


# -- first moment, 4 bits: signed geometric levels --------------------------------------------------

M_RATIO = 1.5
"""Ratio of neighbouring magnitudes of the 4-bit first-moment code (``q4_logm``): levels
``absmax * M_RATIO^-k``, k = 0..6, and zero. Chosen by measurement (docs/compression.md):
the Adam update's error after a save/resume was smallest at 1.5-1.6 (0.15-0.16 relative L2
against 0.19-0.21 for 15 linear levels), with no shrinking of its magnitude."""


def encode_mlog(m: torch.Tensor, group: int, ratio: float = M_RATIO, what: str = "exp_avg", base: int = 0,
                stats: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole groups of ``m`` -> (packed uint8 codes, per-group absmax): ``q + 8`` with ``q``
    in [-7, 7], ``|q| = j > 0`` standing for ``absmax * ratio^(j - 7)`` and ``q = 0`` for zero;
    each value takes the level nearest in log space (below the smallest: zero or the smallest,
    whichever is nearer). Relative, not absolute, error: small values in a group with a
    large one are not flushed to zero as 15 linear levels flush everything below absmax/14."""
    _check_args(4, group, base, m.numel())
    _check_ratio(ratio)
    m = m.reshape(-1).float()
    n = m.numel()
    scale = torch.empty(-(-n // group), dtype=torch.float32)
    codes = torch.empty(-(-n // 2), dtype=torch.uint8)
    # position of |m| / absmax on the levels: k = 7 + log_ratio(|m| / absmax). Level j
    # (1..7) is nearest in log space between the geometric midpoints ratio^(j - 7 -+ 1/2);
    # below the smallest level, zero is nearer (in value) under half of it
    thresholds = np.array([ratio ** -6 / 2] + [ratio ** (j - 6.5) for j in range(1, 7)], dtype=np.float32)
    levels = np.array([ratio ** (j - 7) for j in range(1, 8)], dtype=np.float32)
    x = _np(m)
    err = _errors(stats)
    bad = _fk().enc_mlog(x, group, thresholds, levels, codes.numpy(), scale.numpy(), err,
                                       _scratch(np.int32), _scratch(np.float32))
    _refused(x, bad, what, base, False)
    _record(stats, err, n)
    return codes, scale


def _check_ratio(ratio: float) -> None:
    if not (isinstance(ratio, (int, float)) and 1 < ratio <= 16):
        raise CodecError(f"ratio must be a number in (1, 16], got {ratio!r}")


def _mlog_values(q: torch.Tensor, scale: torch.Tensor, inv_lr: float, tmp: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Values of signed level indices ``q`` (float, in [-7, 7], overwritten):
    ``sign(q) * scale * ratio^(abs(q) - 7)``, 0 for ``q = 0`` (``tmp``: scratch like ``q``)."""
    sign = torch.sign(q, out=tmp) if tmp is not None else torch.sign(q)  # (0 for q = 0: the value 0)
    return q.abs_().sub_(7).div_(inv_lr).exp_().mul_(sign).mul_(scale)


def decode_mlog(codes: torch.Tensor, scale: torch.Tensor, group: int, ratio: float, start: int, count: int
                ) -> torch.Tensor:
    """Elements ``[start, start+count)`` from :func:`encode_mlog`'s codes (packed bytes from
    byte ``start // 2`` on) and the scales of groups ``start // group`` onwards."""
    _check_args(4, group, start, count)
    _check_ratio(ratio)
    ng = _groups(start, count, group)
    scale = scale.reshape(-1)
    _enough(scale, ng, "scales", torch.float32)
    # the 16 values per unit scale (code 0, which no encoder writes, reads as -7), then per group
    unit = _mlog_values(torch.arange(16, dtype=torch.float32).sub_(8).clamp_(-7, 7), torch.ones(()), 1 / math.log(ratio))
    tables = scale[:ng, None].mul(unit)
    return _gathered(codes, True, tables, group, start, count)


# -- second moment: w = sqrt(v) + eps on a geometric grid -----------------------------------------


def _v_groups(v: torch.Tensor, a: int, b: int, group: int, buf: torch.Tensor, what: str, base: int):
    """Groups of ``v[a:b]`` (whole groups; the last one padded with a real value, so padding
    never widens its range), checked finite and >= 0: ``(groups, first group, min, max)``."""
    k = b - a
    g, _, g0 = _per_group(v[a:b], a, group, buf)
    flat = g.view(-1)
    if k % group:
        flat[k:] = flat[k - 1]
    vmin, vmax = g.amin(dim=1), g.amax(dim=1)
    if not bool(torch.isfinite(vmax).all()):
        _check_finite(v[a:b], what, base + a)
    if bool((vmin < 0).any()):
        bad = int((v[a:b] < 0).nonzero()[0, 0]) + a + base
        raise CodecError(f"{what}: negative second moment at element {bad}")
    return g, g0, vmin, vmax


def _v_outputs(v: torch.Tensor, bits: int, group: int, eps: float, what: str, of: str, base: int = 0):
    """The second-moment encoders' inputs and outputs: ``v`` flat fp32 (arguments and ``eps``
    checked), levels, length, per-group lo/hi and codes."""
    _check_args(bits, group, base, v.numel())
    v = v.reshape(-1).float()
    if not (isinstance(eps, (int, float)) and FLT_MIN <= eps <= FLT_MAX):  # (float32 normal: the grid's floor)
        raise CodecError(f"{what}: eps must be a float32 normal number > 0 to quantize {of}, got {eps}")
    n = v.numel()
    n_groups = -(-n // group)
    codes = torch.empty(n, dtype=torch.uint8) if bits == 8 else torch.empty(-(-n // 2), dtype=torch.uint8)
    return (v, (1 << bits) - 1, n, torch.empty(n_groups, dtype=torch.float32), torch.empty(n_groups, dtype=torch.float32),
            codes)


def encode_w(v: torch.Tensor, bits: int, group: int, eps: float, what: str = "exp_avg_sq", base: int = 0,
             seed: int | None = None, stats: list | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole groups of ``v`` -> (codes uint8 (packed for 4 bits), per-group min ``w``,
    per-group max ``w``) of ``w = sqrt(v) + eps`` on the geometric grid of the module doc.
    ``seed``: stochastic rounding with ``E[1/w'] = 1/w`` (the update Adam makes is unbiased);
    else to the nearest level in log space."""
    v, levels, n, lo_all, hi_all, codes = _v_outputs(v, bits, group, eps, what, "sqrt(v) + eps", base)
    dpos = -1 if seed is None else (base + (seed * 0x9E3779B97F4A7C15 >> 16)) % DITHER_TABLE
    x = _np(v)
    err = _errors(stats)
    bad = _fk().enc_w(x, group, levels, np.float32(eps), _table().numpy(), dpos, bits == 4, codes.numpy(),
                                    lo_all.numpy(), hi_all.numpy(), _scratch(np.float32), _scratch(np.int32),
                                    _scratch(np.float32), err)
    _refused(x, bad, what, base, True)
    _record(stats, err, n)
    return codes, lo_all, hi_all


def _w_values(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, step: torch.Tensor, eps: float) -> torch.Tensor:
    """v of grid positions ``k`` (float, overwritten): ``w = lo * e^(k step)`` clamped to
    ``[lo, hi]``, ``v = max(w - eps, 0)^2``."""
    w = k.mul_(step).exp_().mul_(lo)
    return torch.minimum(torch.maximum(w, lo), hi).sub_(eps).clamp_(min=0).square_().clamp_(max=FLT_MAX)


def decode_w(codes, lo, hi, bits: int, group: int, eps: float, start: int, count: int) -> torch.Tensor:
    """Elements ``[start, start+count)`` of v from :func:`encode_w`'s codes; arguments as in
    :func:`decode_m`. Decoded ``w`` is clamped to its group's ``[lo, hi]`` (no rounding of
    ``exp`` can leave it)."""
    _check_args(bits, group, start, count)
    levels = (1 << bits) - 1
    ng = _groups(start, count, group)
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    _enough(lo, ng, "groups' lo", torch.float32)
    _enough(hi, ng, "groups' hi", torch.float32)

    def fn(c, gl, gh):
        wide = (gh / gl).log() > 88.0  # exp(k step) past float32 (a range hi/lo > 3.4e38, tiny eps)
        if bool(wide.any()):  # those groups in float64: lo * e^(k step) as e^(k step + log lo)
            l64, h64 = gl.double(), gh.double()
            w = (c.double() * ((h64.log() - l64.log()) / levels) + l64.log()).exp()
            v64 = torch.minimum(torch.maximum(w, l64), h64).sub(eps).clamp(min=0).square().clamp(max=FLT_MAX).float()
            return torch.where(wide, v64, _w_values(c, gl, gh, gh.log().sub_(gl.log()).div_(levels), eps))
        return _w_values(c, gl, gh, gh.log().sub_(gl.log()).div_(levels), eps)

    if group <= levels:  # shorter groups than their level tables: per element
        return _decode(codes, bits, group, start, count, (lo, hi), fn)
    gl, gh = lo[:ng, None], hi[:ng, None]
    tables = fn(torch.arange(levels + 1, dtype=torch.float32).expand(ng, levels + 1).clone(), gl, gh)
    return _gathered(codes, bits == 4, tables, group, start, count)


# -- second moment, formats before logw: asymmetric on r = 1 / (sqrt(v) + eps) ----------------------


def encode_v(v: torch.Tensor, bits: int, group: int, eps: float, what: str = "exp_avg_sq", base: int = 0):
    """Whole groups of ``v`` -> (codes uint8 (packed for 4 bits), per-group min, per-group max) of r
    (``what``, ``base``: as :func:`encode_m`'s)."""
    v, levels, n, lo_all, hi_all, codes = _v_outputs(v, bits, group, eps, what, "1/(sqrt(v)+eps)", base)
    buf = torch.empty(max(group, (CHUNK // group) * group) + group)  # (group-aligned scratch of the torch path)
    for a, b in _aligned_chunks(0, n, group):
        k = b - a
        g, g0, vmin, vmax = _v_groups(v, a, b, group, buf, what, base)
        flat = g.view(-1)
        # r is decreasing in v: its group extremes are the transforms of v's, bit for bit
        lo = vmax.sqrt_().add_(eps).reciprocal_()
        hi = vmin.sqrt_().add_(eps).reciprocal_()
        g.sqrt_().add_(eps).reciprocal_()
        lo_all[g0 : g0 + len(lo)] = lo
        hi_all[g0 : g0 + len(hi)] = hi
        span = hi - lo
        inv = torch.where(span > 0, levels / span, torch.zeros_like(span))
        g.sub_(lo[:, None]).mul_(inv[:, None]).round_().clamp_(0, levels)
        if bits == 4:
            _pack_into(codes, a, flat[:k])
        else:
            codes[a:b].copy_(flat[:k])
    return codes, lo_all, hi_all


def decode_v(codes, lo, hi, bits: int, group: int, eps: float, start: int, count: int) -> torch.Tensor:
    """Elements ``[start, start+count)`` of v; arguments as in :func:`decode_m`."""
    levels = (1 << bits) - 1

    def fn(c, gl, gh):
        return c.mul_((gh - gl) / levels).add_(gl).reciprocal_().sub_(eps).clamp_(min=0).square_()

    return _decode(codes, bits, group, start, count, (lo, hi), fn)


# -- master weights: bf16 model weight + 16-bit residual -------------------------------------------


@dataclass(frozen=True)
class Residual:
    low: torch.Tensor  # uint16-in-int16: low 16 bits of each fp32 master weight
    exc_index: torch.Tensor  # int64 flat indices whose (bf16, low) pair does not give the master
    exc_bits: torch.Tensor  # int32 bit patterns of the master at those indices


def split_master(master: torch.Tensor, model_bf16: torch.Tensor) -> Residual:
    """Residual of fp32 ``master`` against its bf16 model weight (same shape)."""
    mb = master.reshape(-1).contiguous().view(torch.int32)
    hb = model_bf16.reshape(-1).contiguous().view(torch.int16)
    if mb.numel() != hb.numel():
        raise CodecError(f"master has {mb.numel()} elements, the bf16 weight {hb.numel()}")
    low = torch.empty(mb.numel(), dtype=torch.int16)
    k = _fk()
    bad = k.split_master(mb.numpy(), hb.numpy(), low.numpy())
    exc_index = torch.empty(bad, dtype=torch.int64)
    exc_bits = torch.empty(bad, dtype=torch.int32)
    if bad:
        k.exceptions(mb.numpy(), hb.numpy(), low.numpy(), exc_index.numpy(), exc_bits.numpy())
    return Residual(low, exc_index, exc_bits)


def merge_master(model_bf16: torch.Tensor, low: torch.Tensor, exc_index: torch.Tensor, exc_bits: torch.Tensor,
                 start: int = 0) -> torch.Tensor:
    """fp32 master weights of elements ``[start, start+n)`` from the bf16 weights and low
    halves of that range; exceptions are given by full-tensor index (others are ignored)."""
    if model_bf16.dtype != torch.bfloat16:
        raise CodecError(f"model weights: bfloat16 expected, got {model_bf16.dtype}")
    hb = model_bf16.reshape(-1).contiguous().view(torch.int16)
    out = torch.empty(hb.numel(), dtype=torch.int32)
    low = low.reshape(-1)
    _enough(low, hb.numel(), "low halves", torch.int16)
    if exc_index.numel() != exc_bits.numel():
        raise CodecError(f"{exc_index.numel()} exception indices, {exc_bits.numel()} exception values")
    _fk().merge_master(hb.numpy(), _np(low), out.numpy())
    if exc_index.numel():
        sel = (exc_index >= start) & (exc_index < start + hb.numel())
        out[exc_index[sel] - start] = exc_bits[sel]
    return out.view(torch.float32)


def warm() -> None:
    """Compile (or load from numba's cache) every fused kernel the saved codecs use, on a
    few values: a test run or a job can pay the one-time compile (~10 s) up front instead
    of inside its first quantized save."""
    x = torch.linspace(-1, 1, 256)
    v = x.square()
    for bits, group in ((8, 128), (4, 64)):
        c, lo, hi = encode_w(v, bits, group, 1e-8, seed=0, stats=[])
        decode_w(c, lo, hi, bits, group, 1e-8, 1, 200)
        encode_w(v, bits, group, 1e-8)
    c, s = encode_m(x, 8, 128, stats=[])
    decode_m(c, s, 8, 128, 3, 200)
    c, s = encode_mlog(x, 64, stats=[])
    decode_mlog(c, s, 64, M_RATIO, 3, 200)
    r = split_master(x, x.bfloat16())
    merge_master(x.bfloat16(), r.low, r.exc_index, r.exc_bits)
    # the byte planes of lossless frames (unickpt.container): split from a tensor's bytes,
    # joined from decompressed parts (read-only) into a writable window
    f, w = _fk(), np.arange(256, dtype=np.uint32)
    low, b2, b3 = np.empty(256, np.uint16), np.empty(256, np.uint8), np.empty(256, np.uint8)
    f.split2(w.view(np.uint16)[:256], b2, b3)  # (two byte planes of 256 two-byte elements)
    f.split4(w, low, b2, b3)
    ro = [np.frombuffer(a.tobytes(), a.dtype) for a in (low, b2, b3)]
    f.join2(ro[1], ro[2], w.view(np.uint16)[:256])
    f.join4(*ro, w)
