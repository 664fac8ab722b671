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

Work is done in chunks of whole groups (``CHUNK`` elements), which keeps temporaries in cache
and memory bounded.
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


def _chunks(n: int, group: int):
    step = max(group, (CHUNK // group) * group)
    for a in range(0, n, step):
        yield a, min(n, a + step)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """(n_groups, group) view, the last group padded with zeros if needed."""
    n = x.numel()
    pad = (-n) % group
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, group)


def _check_finite(x: torch.Tensor, what: str, base: int = 0) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).nonzero()[0, 0])
        raise CodecError(
            f"{what}: non-finite value {float(x.reshape(-1)[bad])} at element {bad + base}; refusing to quantize"
        )


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
    new = [float(torch.dot(d, d)), float(torch.dot(x, x)), max(-float(lo), float(hi)), 0.0, x.numel()]
    if not stats:
        stats.extend(new)
    else:
        stats[0] += new[0]
        stats[1] += new[1]
        stats[2] = max(stats[2], new[2])
        stats[4] += new[4]


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
    the table, not a generator per element (~8 ns per value): see :func:`_draw`."""
    out = torch.empty(count, dtype=torch.float32)
    for at, window in _windows(seed, start, count):
        out[at : at + len(window)].copy_(window)
    return out


def _draw(p: torch.Tensor, seed: int, start: int) -> torch.Tensor:
    """``p`` (flat, probabilities) replaced in place by 1.0 where the element's dither value
    is below it, else 0.0: one Bernoulli draw per element, compared against the table's
    windows where they lie (no copy of the dither)."""
    for at, window in _windows(seed, start, p.numel()):
        p[at : at + len(window)].gt_(window)
    return p


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
    m = m.reshape(-1).float()
    qmax = _qmax(bits)
    n = m.numel()
    scale = torch.empty(-(-n // group), dtype=torch.float32)
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
    def fn(c, s):
        return (c.sub_(8) if bits == 4 else c).mul_(s)

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
    m = m.reshape(-1).float()
    n = m.numel()
    scale = torch.empty(-(-n // group), dtype=torch.float32)
    codes = torch.empty(-(-n // 2), dtype=torch.uint8)
    buf = torch.empty(max(group, (CHUNK // group) * group) + group)
    inv_lr = 1 / math.log(ratio)
    # position k = 7 + log_ratio(|m| / absmax); the smallest level is k = 1, zero is nearer
    # below half of it, k < 1 + log_ratio(1/2): kept iff floor(k + 1 - log_ratio(1/2)) >= 1
    keep_shift = 1 - math.log(0.5) * inv_lr
    mag, kept = torch.empty_like(buf), torch.empty_like(buf)
    for a, b in _aligned_chunks(0, n, group):
        g, off, g0 = _per_group(m[a:b], a, group, buf)
        r = torch.abs(g, out=mag[: g.numel()].view_as(g))
        amax = r.amax(dim=1)
        if not bool(torch.isfinite(amax).all()):
            _check_finite(m[a:b], what, base + a)
        scale[g0 : g0 + len(amax)] = amax
        r.mul_(torch.where(amax > 0, amax.reciprocal(), torch.zeros_like(amax))[:, None])  # |m| / absmax in [0, 1]
        k = r.log_().mul_(inv_lr).add_(7)  # (-inf for 0)
        keep = torch.add(k, keep_shift, out=kept[: k.numel()].view_as(k)).floor_().clamp_(0, 1)  # 1.0 or 0.0, no mask
        # the level nearest in log space, 1..7, or 0 (float arithmetic only: masks are slow)
        j = k.round_().clamp_(1, 7).mul_(keep)
        q = torch.copysign(j, g, out=j).view(-1)[off : off + (b - a)]
        _pack_into(codes, a, q.add_(8))
        if stats is not None:
            _tally(stats, _mlog_values(j.sub_(8), amax[:, None], inv_lr, kept[: j.numel()].view_as(j))
                   .view(-1)[off : off + (b - a)], m[a:b])
    return codes, scale


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
    inv_lr = 1 / math.log(ratio)

    def fn(c, s):
        return _mlog_values(c.sub_(8).clamp_(-7, 7), s, inv_lr)  # (code 0, which no encoder writes, reads as -7)

    return _decode(codes, 4, group, start, count, (scale,), fn)


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


def _w_groups(v: torch.Tensor, a: int, b: int, group: int, eps: float, buf: torch.Tensor, what: str, base: int):
    """Groups of ``w = sqrt(v) + eps`` for ``v[a:b]`` (:func:`_v_groups`): ``(groups, first group)``."""
    g, g0, _, _ = _v_groups(v, a, b, group, buf, what, base)
    return g.sqrt_().add_(eps), g0


def _v_outputs(v: torch.Tensor, bits: int, group: int, eps: float, what: str, of: str):
    """The second-moment encoders' inputs and outputs: ``v`` flat fp32 (``eps`` > 0 checked),
    levels, length, per-group lo/hi, codes and a group-aligned scratch buffer."""
    v = v.reshape(-1).float()
    if not eps > 0:
        raise CodecError(f"{what}: eps must be > 0 to quantize {of}, got {eps}")
    n = v.numel()
    n_groups = -(-n // group)
    codes = torch.empty(n, dtype=torch.uint8) if bits == 8 else torch.empty(-(-n // 2), dtype=torch.uint8)
    return (v, (1 << bits) - 1, n, torch.empty(n_groups, dtype=torch.float32), torch.empty(n_groups, dtype=torch.float32),
            codes, torch.empty(max(group, (CHUNK // group) * group) + group))


def encode_w(v: torch.Tensor, bits: int, group: int, eps: float, what: str = "exp_avg_sq", base: int = 0,
             seed: int | None = None, stats: list | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole groups of ``v`` -> (codes uint8 (packed for 4 bits), per-group min ``w``,
    per-group max ``w``) of ``w = sqrt(v) + eps`` on the geometric grid of the module doc.
    ``seed``: stochastic rounding with ``E[1/w'] = 1/w`` (the update Adam makes is unbiased);
    else to the nearest level in log space."""
    v, levels, n, lo_all, hi_all, codes, buf = _v_outputs(v, bits, group, eps, what, "sqrt(v) + eps")
    low = torch.empty_like(buf) if seed is not None else None  # the lower level of each value
    for a, b in _aligned_chunks(0, n, group):
        k = b - a
        w, g0 = _w_groups(v, a, b, group, eps, buf, what, base)
        lo, hi = w.amin(dim=1), w.amax(dim=1)
        lo_all[g0 : g0 + len(lo)] = lo
        hi_all[g0 : g0 + len(hi)] = hi
        step = hi.log().sub_(lo.log()).div_(levels)  # log of one level's ratio (0: one value)
        inv = torch.where(step > 0, step.reciprocal(), torch.zeros_like(step))
        p = w.div_(lo[:, None]).log_().mul_(inv[:, None]).clamp_(0, levels)  # position on the grid, in levels
        if seed is None:
            p.round_()
        else:
            # between levels k0 and k0+1 (ratio rho = e^step): up with probability P such
            # that E[1/w'] = 1/w: P = (1 - rho^-f) / (1 - rho^-1) = expm1(-f step) / expm1(-step)
            k0 = torch.floor(p, out=low[: p.numel()].view_as(p))
            den = torch.where(step > 0, torch.expm1(step.neg()).neg_().reciprocal_(), torch.zeros_like(step))
            # (1 - e^(-f step)) by exp, not expm1 (4x slower here): where f step is tiny the
            # cancellation errs by ~1e-7 absolute, a level ~1e-7 apart: nothing to decide
            up = p.sub_(k0).mul_(-step[:, None]).exp_().neg_().add_(1).mul_(den[:, None])
            p = k0.add_(_draw(up.view(-1), seed, base + a).view_as(up)).clamp_(max=levels)
        flat = p.view(-1)[:k]
        if bits == 4:
            _pack_into(codes, a, flat)
        else:
            codes[a:b].copy_(flat)
        if stats is not None:
            _tally(stats, _w_values(p, lo[:, None], hi[:, None], step[:, None], eps).view(-1)[:k], v[a:b])
    return codes, lo_all, hi_all


def _w_values(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, step: torch.Tensor, eps: float) -> torch.Tensor:
    """v of grid positions ``k`` (float, overwritten): ``w = lo * e^(k step)`` clamped to
    ``[lo, hi]``, ``v = max(w - eps, 0)^2``."""
    w = k.mul_(step).exp_().mul_(lo)
    return torch.minimum(torch.maximum(w, lo), hi).sub_(eps).clamp_(min=0).square_()


def decode_w(codes, lo, hi, bits: int, group: int, eps: float, start: int, count: int) -> torch.Tensor:
    """Elements ``[start, start+count)`` of v from :func:`encode_w`'s codes; arguments as in
    :func:`decode_m`. Decoded ``w`` is clamped to its group's ``[lo, hi]`` (no rounding of
    ``exp`` can leave it)."""
    levels = (1 << bits) - 1

    def fn(c, gl, gh):
        return _w_values(c, gl, gh, gh.log().sub_(gl.log()).div_(levels), eps)

    return _decode(codes, bits, group, start, count, (lo, hi), fn)


# -- second moment, formats before logw: asymmetric on r = 1 / (sqrt(v) + eps) ----------------------


def encode_v(v: torch.Tensor, bits: int, group: int, eps: float, what: str = "exp_avg_sq", base: int = 0):
    """Whole groups of ``v`` -> (codes uint8 (packed for 4 bits), per-group min, per-group max) of r
    (``what``, ``base``: as :func:`encode_m`'s)."""
    v, levels, n, lo_all, hi_all, codes, buf = _v_outputs(v, bits, group, eps, what, "1/(sqrt(v)+eps)")
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


def _merge_bits(hi16: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns (int32) from bf16 bits (int16) and low halves (int16).

    Rounding went up (so the upper half is the bf16 value minus one) iff the low half is
    above 0x8000, or exactly 0x8000 with an even bf16 value: iff ``low - (h & 1) >= 0x8000``.
    """
    h = hi16.to(torch.int32).bitwise_and_(0xFFFF)
    lo = low.to(torch.int32).bitwise_and_(0xFFFF)
    up = torch.bitwise_and(h, 1).neg_().add_(lo).ge_(0x8000)
    return h.sub_(up.to(torch.int32)).bitwise_left_shift_(16).bitwise_or_(lo)


def split_master(master: torch.Tensor, model_bf16: torch.Tensor) -> Residual:
    """Residual of fp32 ``master`` against its bf16 model weight (same shape)."""
    mb = master.reshape(-1).contiguous().view(torch.int32)
    hb = model_bf16.reshape(-1).contiguous().view(torch.int16)
    if mb.numel() != hb.numel():
        raise CodecError(f"master has {mb.numel()} elements, the bf16 weight {hb.numel()}")
    low = mb.to(torch.int16)  # keeps the low 16 bits
    idx, bits = [], []
    for a, b in _chunks(mb.numel(), 1):
        diff = _merge_bits(hb[a:b], low[a:b]).ne_(mb[a:b])
        if bool(diff.any()):
            bad = diff.nonzero().reshape(-1)
            idx.append(bad + a)
            bits.append(mb[a:b][bad])
    exc_index = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)
    exc_bits = torch.cat(bits) if bits else torch.zeros(0, dtype=torch.int32)
    return Residual(low, exc_index, exc_bits)


def merge_master(model_bf16: torch.Tensor, low: torch.Tensor, exc_index: torch.Tensor, exc_bits: torch.Tensor,
                 start: int = 0) -> torch.Tensor:
    """fp32 master weights of elements ``[start, start+n)`` from the bf16 weights and low
    halves of that range; exceptions are given by full-tensor index (others are ignored)."""
    hb = model_bf16.reshape(-1).contiguous().view(torch.int16)
    out = torch.empty(hb.numel(), dtype=torch.int32)
    for a, b in _chunks(hb.numel(), 1):
        out[a:b] = _merge_bits(hb[a:b], low.reshape(-1)[a:b])
    if exc_index.numel():
        sel = (exc_index >= start) & (exc_index < start + hb.numel())
        out[exc_index[sel] - start] = exc_bits[sel]
    return out.view(torch.float32)
