"""Parser time on hostile inputs: the worst cases tests/test_fuzz.py bounds by counting (calls
made, memory, products), timed here; medians of several runs, one thread.

    .venv/bin/python bench/parse_dos.py [--kib 512] [--repeats 5]

Inputs (the tests' own, not copies):
  manifest / header [LABEL]   tests/crafted.worst_case_inputs: JSON shapes of about --kib KiB
                              that maximize parse memory and work per byte, as a manifest's
                              ``extra`` value (Manifest.from_json) and as a safetensors header
                              entry (format.parse_header); test_parse_memory_worst_case.
  huge_dims attack            tests/attacks/{header,manifest}/huge_dims.*.zst: one shape of
                              10,000 dimensions of 2^62 (refused; a size check that multiplied
                              them out took hours at the header size limit);
                              test_{header,manifest}_huge_dims_refused_without_huge_products.
  decode long group CODEC     codecs.decode_range of 5 elements across a group boundary, the
                              group 2^40 (q8) or MAX_BLOCK (q4) elements long;
                              test_codec_long_groups_bounded.

The tests assert no time (a loaded machine made them fail); the limits they used to assert
are shown for information: 2.0 s per parser call, 0.5 s for the huge-dims attacks. Timed
without tracemalloc (the tests trace memory, which makes JSON parsing several times slower).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import zstandard  # noqa: E402

from unickpt import codecs as _cp  # noqa: E402 (the codec registry)

QUANT_CODECS = tuple(n for n in _cp.names(tags=True) if _cp.get(n).quantized)
from unickpt import format as _fmt  # noqa: E402
from unickpt import manifest as _mf  # noqa: E402
from unickpt.errors import UnickptError  # noqa: E402
from tests.crafted import worst_case_inputs  # noqa: E402

ATTACKS = os.path.join(ROOT, "tests", "attacks")
OLD_LIMIT = 2.0  # seconds: the per-call limit tests/test_fuzz.py used to assert
OLD_DOS_LIMIT = 0.5  # seconds: the same for the huge-dims attacks


def _payload(rel: str) -> bytes:
    with open(os.path.join(ATTACKS, rel), "rb") as f:
        data = f.read()
    return zstandard.ZstdDecompressor().decompress(data) if rel.endswith(".zst") else data


def _refusing(fn):
    """``fn`` with a typed refusal counted as its normal end (hostile inputs are refused)."""
    def call():
        try:
            fn()
        except UnickptError:
            pass
    return call


def timed(fn, repeats: int) -> list[float]:
    fn()  # once untimed: first-call imports and caches
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def cases(size: int):
    """(name, input bytes, callable, old limit in s)."""
    for label, doc, prefix in worst_case_inputs(size):
        yield f"manifest [{label}]", len(doc), _refusing(lambda d=doc: _mf.Manifest.from_json(d, "x")), OLD_LIMIT
        yield (f"header [{label}]", len(prefix),
               _refusing(lambda p=prefix: _fmt.parse_header("x", p, len(p))), OLD_LIMIT)
    d = _payload("header/huge_dims.bin.zst")
    yield "header huge_dims attack", len(d), _refusing(lambda: _fmt.parse_header("x", d, len(d))), OLD_DOS_LIMIT
    m = _payload("manifest/huge_dims.json.zst")
    yield "manifest huge_dims attack", len(m), _refusing(lambda: _mf.Manifest.from_json(m, "x")), OLD_DOS_LIMIT
    for codec in QUANT_CODECS:
        group = 1 << 40 if codec.startswith("q8") else _cp.MAX_BLOCK
        tag = {"codec": codec, "group": group, "eps": 1e-8, "ratio": 1.5}
        lo, hi = group - 3, group + 2
        parts = {p: torch.full((e - b,), 7, dtype=torch.uint8) for p, (b, e) in _cp.byte_ranges(tag, lo, hi).items()}
        parts["scales"] = torch.ones(parts["scales"].numel() // 4).view(torch.uint8)  # scales a load accepts
        n = sum(p.numel() for p in parts.values())
        yield (f"decode long group {codec}", n, lambda t=tag, p=parts, a=lo, b=hi: _cp.decode_range(t, p, a, b),
               OLD_LIMIT)


def measure(repeats: int = 5, size: int = 512 << 10) -> list[dict]:
    """One row per input: median and worst seconds over ``repeats`` runs."""
    torch.set_num_threads(1)
    rows = []
    for name, nbytes, fn, limit in cases(size):
        s = timed(fn, repeats)
        rows.append({"input": name, "bytes": nbytes, "median": statistics.median(s), "max": max(s),
                     "old_limit": limit, "seconds": s})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kib", type=int, default=512, help="size of the worst-case JSON inputs in KiB (tests: 512)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = measure(args.repeats, args.kib << 10)
    print(f"parser time on hostile inputs, 1 thread, median of {args.repeats} (after one untimed run)")
    print(f"{'input':<32}{'bytes':>10}{'median s':>10}{'max s':>9}  old test limit")
    for r in rows:
        mark = "under" if r["max"] < r["old_limit"] else "OVER"
        print(f"{r['input']:<32}{r['bytes']:>10}{r['median']:10.4f}{r['max']:9.4f}  {r['old_limit']:.1f} s: {mark}")


if __name__ == "__main__":
    main()
