"""Codec throughput, GB/s of fp32 input per core (1 thread), medians of several runs.

    .venv/bin/python bench/codecs.py [--mb 256] [--repeats 5]

Measures what saves write: O1 (8-bit) and O2 (4-bit) encode/decode of Adam's m (O1: q8_sym;
O2: q4_logm, geometric levels) and v (q8_logw/q4_logw: sqrt(v)+eps on a geometric grid,
stochastic rounding), the codes of checkpoints before issue #36 for comparison ("legacy"),
and the master-weight residual split/merge, against a memcpy of the same bytes in the same
run. Target (issue #20): quantize and dequantize >= 1 GB/s per core.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from unickpt.codecs.kernels import (decode_m, decode_mlog, decode_v, decode_w, encode_m, encode_mlog, encode_v, encode_w, group_size,
                            merge_master, split_master)


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256, help="fp32 input size in MiB")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = (args.mb << 20) // 4
    cols = 4096
    shape = (n // cols, cols)
    n = shape[0] * cols
    m = torch.randn(n) * 1e-3
    v = torch.randn(n).square() * 1e-6
    master = torch.randn(n)
    model = master.to(torch.bfloat16)
    nbytes = n * 4
    dst = torch.empty_like(m)
    dst.copy_(m)
    rows = [("memcpy (reference)", timed(lambda: dst.copy_(m), args.repeats))]
    for bits, name in ((8, "O1"), (4, "O2")):
        g = group_size(shape, bits)
        if bits == 8:
            mc, ms = encode_m(m, bits, g)
            enc_m, dec_m = (lambda: encode_m(m, bits, g)), (lambda: decode_m(mc, ms, bits, g, 0, n))
        else:
            mc, ms = encode_mlog(m, g)
            enc_m, dec_m = (lambda: encode_mlog(m, g)), (lambda: decode_mlog(mc, ms, g, 1.5, 0, n))
        wc, wl, wh = encode_w(v, bits, g, 1e-8, seed=1)
        vc, vl, vh = encode_v(v, bits, g, 1e-8)
        rows += [
            (f"{name} encode m", timed(enc_m, args.repeats)),
            (f"{name} decode m", timed(dec_m, args.repeats)),
            (f"{name} encode v", timed(lambda: encode_w(v, bits, g, 1e-8, seed=1), args.repeats)),
            (f"{name} decode v", timed(lambda: decode_w(wc, wl, wh, bits, g, 1e-8, 0, n), args.repeats)),
            (f"{name} encode v (legacy)", timed(lambda: encode_v(v, bits, g, 1e-8), args.repeats)),
            (f"{name} decode v (legacy)", timed(lambda: decode_v(vc, vl, vh, bits, g, 1e-8, 0, n), args.repeats)),
        ]
    res = split_master(master, model)
    rows += [
        ("residual split", timed(lambda: split_master(master, model), args.repeats)),
        ("residual merge", timed(lambda: merge_master(model, res.low, res.exc_index, res.exc_bits), args.repeats)),
    ]
    print(f"codec throughput, {nbytes / 2**20:.0f} MiB fp32 input, 1 thread, median of {args.repeats}")
    print(f"{'operation':<26}{'s':>8}{'GB/s':>8}  target >= 1 GB/s")
    for name, s in rows:
        gbps = nbytes / s / 1e9
        mark = "" if name.startswith("memcpy") or "legacy" in name else ("PASS" if gbps >= 1 else "MISS")
        print(f"{name:<26}{s:8.3f}{gbps:8.2f}  {mark}")


if __name__ == "__main__":
    main()
