"""Fused quantizer kernels: one pass over each value, compiled by numba, the GIL released.

What :mod:`unickpt.codecs.kernels` defines (the codes, the grids, the rounding) these kernels
compute without temporaries: each group is read once for its range (and the refusal of
non-finite or negative values), once more while it is still in cache to write its codes,
its packed nibbles and its error record. The torch formulation took ~30 elementwise passes
per chunk (0.8-2.3 GB/s per core); these run at 3-10 GB/s (docs/compression.md).

Decoders are exact where the format is arithmetic (``code * scale``) and read per-group
tables where it is transcendental: the 16 or 256 values a group's codes can take are
computed with the format's own torch expression (:mod:`kernels`), then gathered. A value
decodes to the same bits wherever the read starts (one table per group, not one ``exp``
per element whose vector and scalar paths may differ in the last bit).

:mod:`kernels` imports this module (and numba, 0.3 s) on the first quantizer call; the
kernels compile once per machine (numba's ``cache=True``: next to this file, or numba's own
cache directory where that is read-only; ``UNICKPT_NUMBA_NOCACHE=1`` turns it off).
"""

from __future__ import annotations

import math
import os

import numpy as np
from numba import njit

CACHE = os.environ.get("UNICKPT_NUMBA_NOCACHE") is None
FLT_MAX = np.float32(3.4028234663852886e38)


# codes: IEEE arithmetic, contracted into FMAs but never reassociated (the vectorized body
# and the scalar tail compute the same bits, so codes do not depend on where a chunk
# starts); error records: fast-math sums over values already checked finite
jit = njit(nogil=True, cache=CACHE, boundscheck=False, error_model="numpy", fastmath={"contract"})
fast = njit(nogil=True, cache=CACHE, boundscheck=False, error_model="numpy", fastmath=True)
inl = njit(nogil=True, cache=CACHE, boundscheck=False, error_model="numpy", fastmath={"contract"}, inline="always")

# (inner loops run over slices from 0: an index ``a + i`` carries numba's negative-index
# wraparound, which stops LLVM vectorizing the loop, 4x slower)


@jit
def bad_index(x, nonneg):
    """First element of ``x`` that is not finite (or negative when ``nonneg``), or -1."""
    for i in range(x.size):
        v = x[i]
        if not (v <= FLT_MAX and v >= -FLT_MAX) or (nonneg and v < 0):
            return i
    return -1


@jit
def abs_bits_max(xi):
    """max of ``|x|``'s bit patterns (int32 view): ordered like the values for finite
    ones, above 0x7F7FFFFF for inf and NaN. Integer: vectorizes."""
    m = np.int32(0)
    for i in range(xi.size):
        u = xi[i] & np.int32(0x7FFFFFFF)
        m = u if u > m else m
    return m


@jit
def minmax_bits(xi):
    """(min, max) of ``x``'s bit patterns, -0.0 read as +0.0: for non-negative finite
    values ordered like the values; a negative value gives min < 0, inf or a NaN max >
    0x7F7FFFFF."""
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x80000000)
    for i in range(xi.size):
        u = xi[i]
        u = np.int32(0) if u == np.int32(-0x80000000) else u
        lo = u if u < lo else lo
        hi = u if u > hi else hi
    return lo, hi


@jit
def bits_max(xi):
    m = np.int32(0)
    for i in range(xi.size):
        m = xi[i] if xi[i] > m else m
    return m


@fast
def err_sums(x, dec):
    """Sums of squared errors of ``dec`` against ``x`` and of squares of ``x``, in float64
    (squares of values near float32's largest overflow float32); ``dec`` overwritten with
    ``|error|`` (at most FLT_MAX). Fast-math: values checked finite, a measurement."""
    e2 = 0.0
    x2 = 0.0
    for i in range(x.size):
        xi = np.float64(x[i])
        d = np.float64(dec[i]) - xi
        e2 += d * d
        x2 += xi * xi
        d = abs(d)
        dec[i] = np.float32(d if d < FLT_MAX else FLT_MAX)
    return e2, x2


@jit
def record(stats, x, dec):
    """Add the error of the decoded values ``dec`` (overwritten) of ``x`` to ``stats``:
    ``[sum of squared errors, sum of squares, max |error|, scratch]``, sums in float64
    (a measurement: their last digits depend on how the tensor was cut)."""
    e2, x2 = err_sums(x, dec)
    stats[0] += e2
    stats[1] += x2
    sb = stats[3:4].view(np.int32)
    sb[0] = bits_max(dec.view(np.int32))
    sb[1] = 0
    stats[2] = max(stats[2], np.float64(sb.view(np.float32)[0]))


@jit
def span_of(group, run):
    """Elements handled together: whole groups up to ``run`` elements, or one group."""
    return group * (run // group) if group <= run else group


@jit
def pack_pairs(ks, cs):
    """Codes ``ks`` (from an even element) into nibbles ``cs``: even element low."""
    half = ks.size // 2
    for i in range(half):
        cs[i] = np.uint8(ks[2 * i] | (ks[2 * i + 1] << 4))
    if ks.size % 2:
        cs[half] = np.uint8(ks[ks.size - 1])


# -- q8_sym ------------------------------------------------------------------------------


@jit
def sym_codes(xs, inv, s, cs, dec):
    for i in range(xs.size):
        q = np.rint(xs[i] * inv)
        q = q if q > np.float32(-127.0) else np.float32(-127.0)
        q = q if q < np.float32(127.0) else np.float32(127.0)
        cs[i] = np.int8(q)
        dec[i] = q * s


@jit
def enc_sym8(x, group, codes, scale, stats, dbuf):
    """q8_sym: ``codes = round(x / s)``, ``s = absmax / 127`` per group (``scale``).
    Returns -1, or the first non-finite element (nothing is encoded past its group)."""
    n = x.size
    xi = x.view(np.int32)
    run = dbuf.size
    box = np.empty(1, dtype=np.int32)
    boxf = box.view(np.float32)
    span = span_of(group, run)
    for a in range(0, n, span):
        b = min(n, a + span)
        for r in range(a, b, run):
            e = min(b, r + run)
            g = r // group
            while g * group < e:
                ga = max(r, g * group)
                gb = min(e, (g + 1) * group)
                if ga == g * group or ga == r and r == a:
                    # the group's scale, once (a group longer than a run: at its first run)
                    full = xi[g * group : min(n, (g + 1) * group)]
                    mb = abs_bits_max(full)
                    if mb > np.int32(0x7F7FFFFF):
                        return g * group + bad_index(x[g * group : min(n, (g + 1) * group)], False)
                    box[0] = mb
                    s = boxf[0] / np.float32(127.0)
                    while s * np.float32(127.0) > FLT_MAX:  # (127 s must not round past float32's largest)
                        s = s * np.float32(0.99999994)
                    scale[g] = s
                s = scale[g]
                inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
                sym_codes(x[ga:gb], inv, s, codes[ga:gb], dbuf[ga - r : gb - r])
                g += 1
            if stats.size:
                record(stats, x[r:e], dbuf[: e - r])
    return -1


@jit
def dec_sym8(codes, scale, group, start, out):
    """``out[i] = codes[i] * scale[g]`` for elements from ``start`` (scale from its group)."""
    n = out.size
    g_first = start // group
    i = 0
    while i < n:
        g = (start + i) // group
        end = min(n, (g + 1) * group - start)
        s = scale[g - g_first]
        cs = codes[i:end]
        os = out[i:end]
        for j in range(os.size):
            os[j] = np.float32(cs[j]) * s
        i = end


# -- q4_logm -----------------------------------------------------------------------------


@jit
def mlog_codes(xs, t, lv, ks, dec):
    """q4_logm's codes ``8 +- j`` of ``xs`` into ``ks`` and their values into ``dec``:
    ``t`` the group's 7 thresholds, ``lv`` its 7 magnitudes."""
    t0, t1, t2, t3, t4, t5, t6 = t[0], t[1], t[2], t[3], t[4], t[5], t[6]
    l0, l1, l2, l3, l4, l5, l6 = lv[0], lv[1], lv[2], lv[3], lv[4], lv[5], lv[6]  # (registers: stores may alias)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    for i in range(xs.size):
        v = xs[i]
        r = abs(v)
        # counts and levels by selects, in float32 lanes (numba's integers are int64)
        j = zero
        m = zero
        j = one if r >= t0 else j
        m = l0 if r >= t0 else m
        j = np.float32(2.0) if r >= t1 else j
        m = l1 if r >= t1 else m
        j = np.float32(3.0) if r >= t2 else j
        m = l2 if r >= t2 else m
        j = np.float32(4.0) if r >= t3 else j
        m = l3 if r >= t3 else m
        j = np.float32(5.0) if r >= t4 else j
        m = l4 if r >= t4 else m
        j = np.float32(6.0) if r >= t5 else j
        m = l5 if r >= t5 else m
        j = np.float32(7.0) if r >= t6 else j
        m = l6 if r >= t6 else m
        neg = v < zero
        ks[i] = np.int32(np.float32(8.0) - j if neg else np.float32(8.0) + j)
        dec[i] = -m if neg else m


@jit
def enc_mlog(x, group, thresholds, levels, codes, scale, stats, kbuf, dbuf):
    """q4_logm: ``thresholds`` (7, ascending, times absmax): below the first zero, else
    level j = 1 + how many of the other six are reached; sign in the code (``q + 8``),
    packed two per byte (``group`` even). ``levels``: the 7 magnitudes per unit absmax.
    Scratch ``kbuf`` (int32), ``dbuf`` (float32): one run (even) long."""
    n = x.size
    xi = x.view(np.int32)
    box = np.empty(1, dtype=np.int32)
    boxf = box.view(np.float32)
    t = np.empty(7, dtype=np.float32)
    lv = np.empty(7, dtype=np.float32)
    run = kbuf.size
    span = span_of(group, run)
    for a in range(0, n, span):
        b = min(n, a + span)
        for r in range(a, b, run):
            e = min(b, r + run)
            g = r // group
            while g * group < e:
                ga = max(r, g * group)
                gb = min(e, (g + 1) * group)
                if ga == g * group or ga == r and r == a:
                    mb = abs_bits_max(xi[g * group : min(n, (g + 1) * group)])
                    if mb > np.int32(0x7F7FFFFF):
                        return g * group + bad_index(x[g * group : min(n, (g + 1) * group)], False)
                    box[0] = mb
                    scale[g] = boxf[0]
                amax = scale[g]
                for k in range(7):
                    t[k] = thresholds[k] * amax
                    lv[k] = levels[k] * amax
                if amax == 0:
                    t[0] = np.float32(np.inf)
                mlog_codes(x[ga:gb], t, lv, kbuf[ga - r : gb - r], dbuf[ga - r : gb - r])
                g += 1
            pack_pairs(kbuf[: e - r], codes[r // 2 : (e + 1) // 2])
            if stats.size:
                record(stats, x[r:e], dbuf[: e - r])
    return -1


@jit
def dec_table(codes, packed, tables, width, group, start, out):
    """``out[i] = tables[g, code_i]``: the codes of elements from ``start`` (one byte each,
    or ``packed`` nibbles from the byte holding element ``start``), ``tables`` one row of
    ``width`` values per group from group ``start // group`` on."""
    n = out.size
    g_first = start // group
    i = 0
    odd = start % 2
    while i < n:
        g = (start + i) // group
        end = min(n, (g + 1) * group - start)
        row = tables[(g - g_first) * width : (g - g_first + 1) * width]
        os = out[i:end]
        if packed:
            j0 = 0
            p0 = i + odd  # nibble index of element i
            if p0 & 1:
                os[0] = row[codes[p0 >> 1] >> 4]
                j0 = 1
            pairs = (os.size - j0) // 2
            cs = codes[(p0 + j0) >> 1 : ((p0 + j0) >> 1) + pairs]
            o2 = os[j0 : j0 + 2 * pairs]
            for q in range(pairs):
                c = cs[q]
                o2[2 * q] = row[c & 15]
                o2[2 * q + 1] = row[c >> 4]
            if j0 + 2 * pairs < os.size:
                os[os.size - 1] = row[codes[(p0 + os.size - 1) >> 1] & 15]
        else:
            cs = codes[i:end]
            for j in range(os.size):
                os[j] = row[cs[j]]
        i = end


# -- q8_logw / q4_logw ---------------------------------------------------------------------


@inl
def log2_bits(bits):
    """log2 of a positive normal float32 given its bits, within ~3e-7: the exponent, and
    Cephes' logf polynomial of the mantissa in [sqrt(1/2), sqrt(2)) (no division, no
    libm call: vectorizes, where libm's log does not)."""
    # (numba computes integers in int64: converting from int32 keeps 8 lanes, not 4)
    e = np.float32(np.int32((bits >> 23) - 127))
    m = np.float32(1.0) + np.float32(np.int32(bits & 0x7FFFFF)) * np.float32(1.0 / 8388608.0)
    big = m > np.float32(1.4142135)
    m = m * np.float32(0.5) if big else m
    e = e + np.float32(1.0) if big else e
    x = m - np.float32(1.0)
    z = x * x
    y = np.float32(7.0376836292e-2)
    y = y * x - np.float32(1.1514610310e-1)
    y = y * x + np.float32(1.1676998740e-1)
    y = y * x - np.float32(1.2420140846e-1)
    y = y * x + np.float32(1.4249322787e-1)
    y = y * x - np.float32(1.6668057665e-1)
    y = y * x + np.float32(2.0000714765e-1)
    y = y * x - np.float32(2.4999993993e-1)
    y = y * x + np.float32(3.3333331174e-1)
    ln = x + (x * z * y - np.float32(0.5) * z)
    return e + ln * np.float32(1.4426950408889634)


@inl
def expm1_32(x, wide):
    """e^x - 1, relative error ~1e-7: a degree-7 series for |x| <= 0.36; ``wide``
    (|x| up to ~10): the series at x/32, doubled back five times (``e(2y) = e(y)
    (e(y) + 2)``: no cancellation near 0)."""
    y = x * np.float32(1.0 / 32.0) if wide else x
    e = y * (np.float32(1.0) + y * (np.float32(0.5) + y * (np.float32(1.0 / 6.0) + y * (np.float32(1.0 / 24.0) + y * (
        np.float32(1.0 / 120.0) + y * (np.float32(1.0 / 720.0) + y * np.float32(1.0 / 5040.0)))))))
    if wide:
        e = e * (e + np.float32(2.0))
        e = e * (e + np.float32(2.0))
        e = e * (e + np.float32(2.0))
        e = e * (e + np.float32(2.0))
        e = e * (e + np.float32(2.0))
    return e


@inl
def w_codes(wbits, ws, us, lo2, inv2, step, c, rho, L, lo, hi, eps, seeded, wide, ks, dec):
    """Codes of ``w`` (and its bits) on the grid ``lo * e^(k step)``: position ``p`` from
    log2, ``k0 = floor(p)``, fraction ``f``; up with probability ``(1 - e^(-f step)) / c``
    (``c = 1 - e^-step``: ``E[1/w'] = 1/w``) against the dither ``us``, or to nearest
    (``f >= 1/2``: the geometric midpoint). ``dec``: the decoded v (the error record),
    from ``w' = w e^(-f step)``, times ``rho = e^step`` when rounded up, clamped to
    [lo, hi]. ``seeded`` and ``wide`` hold for the whole loop (LLVM unswitches them)."""
    top = np.float32(L)
    Li = np.int32(L)
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for i in range(ks.size):
        p = (log2_bits(wbits[i]) - lo2) * inv2
        p = p if p > zero else zero
        p = p if p < top else top
        k0 = np.int32(p)
        f = p - np.float32(k0)
        em = expm1_32(-f * step, wide)
        if seeded:
            up = us[i] * c < -em
        else:
            up = f >= np.float32(0.5)
        up = up and k0 < Li
        ks[i] = k0 + np.int32(1) if up else k0
        w = ws[i] * (one + em) * (rho if up else one)
        w = w if w > lo else lo
        w = (w if w < hi else hi) - eps
        w = w if w > zero else zero
        dec[i] = w * w


@jit
def w_narrow(ws, us, lo, hi, eps, L, seeded, vt, ks, dec):
    """Codes of a narrow group (a level narrower than :func:`log2_bits`' error) on the
    decoder's own grid: its float32 step ``(log hi - log lo) / L``, each position
    ``log(w / lo) / step`` in float64 (libm: such groups are rare), rounded as
    :func:`w_codes` rounds; ``dec`` the decoder's value of each code (``vt``, filled here)."""
    step32 = (np.float32(math.log(hi)) - np.float32(math.log(lo))) / np.float32(L)
    step = np.float64(step32)
    for k in range(L + 1):
        w = np.float32(math.exp(np.float32(np.float32(k) * step32))) * lo
        w = w if w > lo else lo
        w = (w if w < hi else hi) - eps
        w = w if w > 0 else np.float32(0.0)
        vt[k] = w * w
    den = -math.expm1(-step)
    llo = math.log(np.float64(lo))
    for i in range(ws.size):
        p = (math.log(np.float64(ws[i])) - llo) / step if step > 0 else 0.0
        p = min(max(p, 0.0), np.float64(L))
        k0 = int(p)
        f = p - k0
        if seeded:
            up = np.float64(us[i]) * den < -math.expm1(-f * step)
        else:
            up = f >= 0.5
        k = k0 + 1 if (up and k0 < L) else k0
        ks[i] = np.int32(k)
        dec[i] = vt[k]


@jit
def w_sqrt(vs, eps, ws):
    for i in range(vs.size):
        ws[i] = np.sqrt(max(vs[i], np.float32(0.0))) + eps


@jit
def enc_w(v, group, levels, eps, dither, dpos, packed, codes, lo_out, hi_out, wbuf, kbuf, dbuf, stats):
    """q8_logw / q4_logw: ``w = sqrt(v) + eps`` per group on ``levels + 1`` geometric
    levels from the group's min (``lo_out``) to its max (``hi_out``). ``dither``: the
    table twice over; ``dpos``: the table position of element 0 (< 0: round to nearest
    in log space). Returns -1 or the first refused element. Scratch ``wbuf``, ``dbuf``
    (float32), ``kbuf`` (int32): one run (even, <= 64 Ki) long."""
    n = v.size
    L = levels
    vi = v.view(np.int32)
    box = np.empty(2, dtype=np.int32)
    boxf = box.view(np.float32)
    vt = np.empty(L + 1, dtype=np.float32)
    TABLE = 65536
    run = wbuf.size
    seeded = dpos >= 0
    span = span_of(group, run)
    wbits = wbuf.view(np.int32)
    ln2 = np.float32(0.6931471805599453)
    for a in range(0, n, span):
        b = min(n, a + span)
        # each group's range, first (refusals before any code of the span)
        for g in range(a // group, (b - 1) // group + 1):
            ga = g * group
            gb = min(n, ga + group)
            lb, hb = minmax_bits(vi[ga:gb])
            if lb < 0 or hb > np.int32(0x7F7FFFFF):
                return ga + bad_index(v[ga:gb], True)
            box[0] = lb
            box[1] = hb
            # sqrt and + eps are monotonic (correctly rounded): the group's min and max w
            lo_out[g] = np.sqrt(boxf[0]) + eps
            hi_out[g] = np.sqrt(boxf[1]) + eps
        for r in range(a, b, run):
            e = min(b, r + run)
            w_sqrt(v[r:e], eps, wbuf[: e - r])
            g = r // group
            while g * group < e:
                ga = max(r, g * group)
                gb = min(e, (g + 1) * group)
                lo = lo_out[g]
                hi = hi_out[g]
                ks = kbuf[ga - r : gb - r]
                dec = dbuf[ga - r : gb - r]
                if hi > lo:
                    # the grid in log2 from the same approximation as each value's (lo
                    # at position 0, hi at L exactly): no libm call per group
                    boxf[0] = lo
                    boxf[1] = hi
                    lo2 = log2_bits(box[0])
                    step2 = (log2_bits(box[1]) - lo2) / np.float32(L)
                    step = step2 * ln2
                    base = (dpos + ga) & (TABLE - 1)
                    us = dither[base : base + (gb - ga)]
                    if step > np.float32(1e-3):
                        inv2 = np.float32(1.0) / step2
                        em = expm1_32(-step, True)
                        w_codes(wbits[ga - r : gb - r], wbuf[ga - r : gb - r], us, lo2, inv2, step, -em,
                                np.float32(1.0) / (np.float32(1.0) + em), L, lo, hi, eps, seeded,
                                step > np.float32(0.36), ks, dec)
                    else:  # a level narrower than log2_bits' error (~3e-7): the decoder's own grid
                        w_narrow(wbuf[ga - r : gb - r], us, lo, hi, eps, L, seeded, vt, ks, dec)
                else:
                    ks[:] = 0
                    d = lo - eps
                    d = d if d > 0 else np.float32(0.0)
                    dec[:] = d * d
                g += 1
            if packed:
                pack_pairs(kbuf[: e - r], codes[r // 2 : (e + 1) // 2])
            else:
                cs = codes[r:e]
                for i in range(cs.size):
                    cs[i] = np.uint8(kbuf[i])
            if stats.size:
                record(stats, v[r:e], dbuf[: e - r])
    return -1


# -- master weights: bf16 model weight + low 16 bits -----------------------------------------


@inl
def merged(h16, l16):
    """fp32 bits from a bf16 weight's bits and a low half (both int16): rounding went up
    (the upper half is the bf16 value minus one) iff ``low - (h & 1) >= 0x8000``."""
    h = np.int32(h16) & np.int32(0xFFFF)
    lo = np.int32(l16) & np.int32(0xFFFF)
    up = np.int32(1) if np.int32(lo - (h & np.int32(1))) >= np.int32(0x8000) else np.int32(0)
    return np.int32(np.int32(np.int32(h - up) << np.int32(16)) | lo)


@jit
def merge_master(hb, low, out):
    for i in range(out.size):
        out[i] = merged(hb[i], low[i])


@jit
def split_master(mb, hb, low):
    """Low halves of the masters ``mb`` (int32 bits) into ``low``; returns how many
    elements the pair (bf16, low) does not reproduce (collected by :func:`exceptions`)."""
    bad = np.int32(0)
    for i in range(mb.size):
        lo = np.int16(mb[i])
        low[i] = lo
        bad += np.int32(1) if merged(hb[i], lo) != mb[i] else np.int32(0)
    return bad


@jit
def exceptions(mb, hb, low, idx, bits):
    j = 0
    for i in range(mb.size):
        if merged(hb[i], low[i]) != mb[i]:
            idx[j] = i
            bits[j] = mb[i]
            j += 1


# -- byte planes of lossless frames (unickpt.container) ----------------------------------------
# One pass over each element, where numpy's shifts and strided copies take two to four
# (4 MiB of fp32: split 1.2 -> 0.4 ms, join 1.2 -> 0.35 ms on one core).


@jit
def split2(x, lo, hi):
    """Two-byte elements ``x`` (uint16) into their low and high byte planes."""
    for i in range(x.size):
        w = x[i]
        lo[i] = np.uint8(w & np.uint16(0xFF))
        hi[i] = np.uint8(w >> np.uint16(8))


@jit
def join2(lo, hi, out):
    """Inverse of :func:`split2`, into ``out`` (uint16)."""
    for i in range(out.size):
        out[i] = np.uint16(lo[i]) | np.uint16(np.uint16(hi[i]) << np.uint16(8))


@jit
def split4(x, low, b2, b3):
    """Four-byte elements ``x`` (uint32) into their low halves (uint16) and the planes of
    byte 2 and byte 3."""
    for i in range(x.size):
        w = x[i]
        low[i] = np.uint16(w & np.uint32(0xFFFF))
        b2[i] = np.uint8((w >> np.uint32(16)) & np.uint32(0xFF))
        b3[i] = np.uint8(w >> np.uint32(24))


@jit
def join4(low, b2, b3, out):
    """Inverse of :func:`split4`, into ``out`` (uint32)."""
    for i in range(out.size):
        out[i] = np.uint32(low[i]) | np.uint32(np.uint32(b2[i]) << np.uint32(16)) | np.uint32(
            np.uint32(b3[i]) << np.uint32(24))
