"""Codec throughput, GB/s of fp32 input per core (1 thread), medians of several runs.

    .venv/bin/python bench/codecs.py [--mb 256] [--repeats 5]

Measures what saves write, cut as saves and loads cut it (encode: the writer's 16 MiB pieces
with the error record every save keeps; decode: a load's 4 Mi-element windows): O1 (8-bit) and O2 (4-bit) encode/decode of Adam's m (O1: q8_sym;
O2: q4_logm, geometric levels) and v (q8_logw/q4_logw: sqrt(v)+eps on a geometric grid,
stochastic rounding), the codes of checkpoints before issue #36 for comparison ("legacy"),
and the master-weight residual split/merge, against a memcpy of the same bytes in the same
run. Targets (issue #40): O1 and O2 encode >= 3 GB/s and decode >= 4 GB/s per core (issue
#20's 1 GB/s before it).

Lossless (``Compression(lossless=True)``, unickpt.container): byte-grouped frames of bf16
weights (N(0, 0.02)), fp32 masters, m and v as above, compressed and decompressed through
the framed file writer and reader on one thread (frame coders off), the ratio of logical to
stored bytes. Targets (issue #40): >= 1.40x on bf16 weights, >= 1.16x on fp32 moments,
compress >= 1 GB/s and decompress >= 1.5 GB/s per core.

``--llama``: the lossless part again on real tensors, a ``transformers`` Llama (6 layers,
512 wide) after 30 AdamW steps on random tokens: its bf16 weights, fp32 masters and AdamW
moments, embeddings left out (random tokens leave most of their rows untouched), as
docs/compression.md's choice of coder was measured.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from unickpt.loading.coded import CODED_WINDOW
from unickpt.saving.writer import SUB_CHUNK
from unickpt.codecs.kernels import (decode_m, decode_mlog, decode_v, decode_w, encode_m, encode_mlog, encode_v, encode_w, group_size,
                            merge_master, split_master)


def pieces(n: int, g: int, size: int) -> list[tuple[int, int]]:
    """``[a, b)`` pieces of about ``size`` elements, on ``g``-element group boundaries."""
    step = max(g, size // g * g)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def coded(enc, x, ps, keep=True):
    """Encode ``x`` piece by piece (with the error record a save keeps): the parts of each
    piece concatenated (``keep``), or dropped as a writer drops them once written."""
    if not keep:
        for a, b in ps:
            enc(x[a:b], a)
        return None
    parts = [enc(x[a:b], a) for a, b in ps]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))


def windows(ps, bits, g, dec, codes):
    """Decode window by window, as a load does (the codes and scales of each window)."""
    for a, b in ps:
        c = codes[a:b] if bits == 8 else codes[a // 2 : (b + 1) // 2]
        dec(c, a, b - a, lambda t: t[a // g : (b - 1) // g + 1])


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
    ap.add_argument("--llama", action="store_true", help="also the lossless part on a trained transformers Llama")
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
    master_w = master * 0.02  # weights as trained models hold them (lossless rows)
    model_w = master_w.to(torch.bfloat16)
    nbytes = n * 4
    dst = torch.empty_like(m)
    dst.copy_(m)
    rows = [("memcpy (reference)", timed(lambda: dst.copy_(m), args.repeats))]
    for bits, name in ((8, "O1"), (4, "O2")):
        g = group_size(shape, bits)
        enc_p = pieces(n, g, SUB_CHUNK // 4)  # as the writer cuts a segment
        dec_p = pieces(n, 1, CODED_WINDOW)  # as a load decodes a tensor
        if bits == 8:
            enc_m1, dec_m1 = (lambda x, a: encode_m(x, bits, g, base=a, stats=[])), decode_m
        else:
            enc_m1 = lambda x, a: encode_mlog(x, g, base=a, stats=[])  # noqa: E731
            dec_m1 = lambda c, s, bits_, g_, a, k: decode_mlog(c, s, g_, 1.5, a, k)  # noqa: E731
        mc, ms = coded(enc_m1, m, enc_p)
        wc, wl, wh = coded(lambda x, a: encode_w(x, bits, g, 1e-8, base=a, seed=1, stats=[]), v, enc_p)
        vc, vl, vh = encode_v(v, bits, g, 1e-8)
        rows += [
            (f"{name} encode m", timed(lambda: coded(enc_m1, m, enc_p, False), args.repeats)),
            (f"{name} decode m", timed(lambda: windows(dec_p, bits, g, lambda c, a, k, s: dec_m1(c, s(ms), bits, g, a, k),
                                                      mc), args.repeats)),
            (f"{name} encode v", timed(lambda: coded(lambda x, a: encode_w(x, bits, g, 1e-8, base=a, seed=1, stats=[]),
                                                     v, enc_p, False), args.repeats)),
            (f"{name} decode v", timed(lambda: windows(dec_p, bits, g, lambda c, a, k, s: decode_w(
                c, s(wl), s(wh), bits, g, 1e-8, a, k), wc), args.repeats)),
            (f"{name} encode v (legacy)", timed(lambda: encode_v(v, bits, g, 1e-8), args.repeats)),
            (f"{name} decode v (legacy)", timed(lambda: decode_v(vc, vl, vh, bits, g, 1e-8, 0, n), args.repeats)),
        ]
    res = split_master(master, model)
    rows += [
        ("residual split", timed(lambda: split_master(master, model), args.repeats)),
        ("residual merge", timed(lambda: merge_master(model, res.low, res.exc_index, res.exc_bits), args.repeats)),
    ]
    print(f"codec throughput, {nbytes / 2**20:.0f} MiB fp32 input, 1 thread, median of {args.repeats}")
    print(f"{'operation':<26}{'s':>8}{'GB/s':>8}  target (GB/s per core)")
    for name, s in rows:
        gbps = nbytes / s / 1e9
        want = 3.0 if " encode " in f" {name} " else 4.0 if " decode " in f" {name} " else 1.0
        mark = "" if name.startswith("memcpy") or "legacy" in name else (
            f">= {want:.0f}: {'met' if gbps >= want else 'MISSED'}")
        print(f"{name:<26}{s:8.3f}{gbps:8.2f}  {mark}")
    print()
    lossless(args, {"bf16 weights": model_w, "fp32 master": master_w, "fp32 exp_avg": m, "fp32 exp_avg_sq": v})
    if args.llama:
        print()
        print("on a trained transformers Llama (6 layers, 512 wide, 30 AdamW steps; embeddings left out)")
        lossless(args, trained_llama())


def trained_llama(steps: int = 30) -> dict:
    """A small ``transformers`` Llama trained ``steps`` AdamW steps on random tokens: its
    weights (bf16), masters (fp32) and AdamW moments, each kind as one flat tensor."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (8, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    kept = [(n, p) for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n]
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    return {"bf16 weights": flat(p for _, p in kept).bfloat16(), "fp32 master": flat(p for _, p in kept),
            "fp32 exp_avg": flat(opt.state[p]["exp_avg"] for _, p in kept),
            "fp32 exp_avg_sq": flat(opt.state[p]["exp_avg_sq"] for _, p in kept)}


def lossless(args, tensors: dict) -> list[dict]:
    """Byte-grouped frames on one thread: ratio, compress and decompress GB/s per tensor kind."""
    from unickpt import _coders, container

    _coders.CODERS, _coders._POOL = 1, {}  # one thread: figures per core

    class Mem:
        def __init__(self, n):
            self.buf, self.n, self.path, self.bytes_read = bytearray(n + (16 << 20)), 0, "mem", 0

        def write_at(self, pos, mv):
            self.buf[pos:pos + len(mv)] = mv
            self.n = max(self.n, pos + len(mv))

        def readinto(self, off, out):
            out[:] = memoryview(self.buf)[off:off + len(out)]

        @property
        def size(self):
            return self.n

    out = []
    print(f"lossless (byte-grouped frames), 1 thread, median of {args.repeats}")
    print(f"{'tensor':<18}{'MiB':>6}{'ratio':>8}{'comp GB/s':>11}{'dec GB/s':>10}  targets")
    for name, t in tensors.items():
        raw = memoryview(t.contiguous().view(torch.uint8).numpy())
        isz = t.element_size()
        box: dict = {}
        mem = Mem(len(raw))  # (allocated once: a file's pages are not part of the codec)

        def comp():
            mem.n = 0
            w = box["w"] = container.ZstdWriter(mem, elements=[(0, len(raw), isz)])
            w.write_at(0, raw)
        tc = timed(comp, args.repeats)
        w = box["w"]
        back = bytearray(len(raw))

        def dec():
            container.ZstdReader(w.inner, w.frames, len(raw), w.inner.size).readinto(0, memoryview(back))
        td = timed(dec, args.repeats)
        assert back == raw.tobytes()
        ratio = len(raw) / w.inner.size
        want = 1.40 if "bf16" in name else 1.16 if "exp_avg" in name else None
        ok = (want is None or ratio >= want) and len(raw) / tc / 1e9 >= 1.0 and len(raw) / td / 1e9 >= 1.5
        note = (f"ratio >= {want}, " if want else "") + f"comp >= 1, dec >= 1.5: {'met' if ok else 'MISSED'}"
        print(f"{name:<18}{len(raw) / 2**20:6.0f}{ratio:8.3f}{len(raw) / tc / 1e9:11.2f}{len(raw) / td / 1e9:10.2f}  {note}")
        out.append({"tensor": name, "ratio": ratio, "compress_gbps": len(raw) / tc / 1e9,
                    "decompress_gbps": len(raw) / td / 1e9})
    return out


if __name__ == "__main__":
    main()
