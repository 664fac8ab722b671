"""Planning at scale: the save planner alone, on simulated ranks (no processes).

    .venv/bin/python bench/plan_scale.py            # 1,000 and 10,000 ranks
    .venv/bin/python bench/plan_scale.py --quick    # 1,000 ranks only

A Llama-shaped model of ``--layers`` layers (9 tensors each: 2 norms, q/k/v/o, gate/up/down;
plus embedding, final norm and output head; bf16; dimensions scaled down: planning cost
depends on counts, not bytes) under three layouts of ``W`` simulated ranks, 8 per node:

* ``zero3``: FSDP-style units: each layer's tensors flattened into one buffer cut into W
  equal ranges (``unickpt.partition_flat``), one unit for embedding/norm/head;
* ``tp8-zero``: TP blocks over 8 ranks (q/k/v/gate/up/embedding/head by rows, o/down by
  columns, norms replicated with replica = TP rank), then each TP rank's blocks of a layer
  flattened and cut into W/8 equal ranges over its data-parallel group;
* ``dtensor2d``: a (W/8, 8) mesh, ``(Shard(0), Shard(1))`` boxes (1-D tensors:
  ``(Shard(0), Replicate())``), computed as ``_dtensor_layout`` does (torch.chunk sizes);
* ``fsdp2tp``: torchtitan's FSDP2 over TP on the same mesh: column-parallel matrices
  (q/k/v/gate/up, embedding, head) as ``(_StridedShard(0), Shard(0))``, FSDP's cut inside each
  TP block (the grid rule with the mesh dimensions cut in order (1, 0)), row-parallel ones
  (o/down) as ``(Shard(0), Shard(1))``, norms ``(Shard(0), Replicate())``.

Layouts carry their rule hints (``partition_flat(..., names=, boxes=)``, the DTensor grid),
so each rank's summary is a few rule claims (``plan.summarize``); ``--explicit`` plans from
one row per piece instead (the planner before rules, for comparison). Rank summaries are
synthesised from the rules (every rank's real ``summarize`` would be O(pieces) to simulate);
``summarize`` itself is timed on the sampled ranks' real entries.

For each it prints what one rank computes: its summary (bytes), decoding every
rank's summary, ``make_plan`` and its own ``SavePlan.schedule`` (time and peak Python
memory, tracemalloc), summary bytes in total (what the all-gathers move to every rank), the
manifest size (built by the save's ``build_manifest`` from the plan and one checksum range per
1 MiB block), and the load side at a changed world size (W/2: manifest parse plus the runs
and byte ranges of every target of a sampled rank). Ratios are to the issue's targets:
planning time per rank < 1 s, peak planner memory per rank < 256 MiB, manifest size
independent of ranks.

Runs whose summaries would hold more than ``--max-pieces`` pieces in total are measured on
the first layers that fit and extrapolated linearly in the layer count (planning is linear
in pieces); the line says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
import tracemalloc

import numpy as np
import zstandard

import torch

from unickpt.layout import Layout, partition_flat
from unickpt import rules as _rules
from unickpt.manifest import Manifest
from unickpt.plan import LocalSummary, SavePlan, assemble, decode_summary, extents_of, make_plan, summarize
from unickpt.plan.summary import _digest
from unickpt.state import Entry

TARGET_S = 1.0
TARGET_MEM = 256 << 20
PER_NODE = 8
TP = 8


def model(layers: int, h: int = 256, kv: int = 64, ffn: int = 704, vocab: int = 4096) -> list[tuple[str, tuple, str]]:
    """(name, shape, TP split: 'row', 'col' or 'rep') in state-dict order, grouped per unit."""
    out = [("embed.weight", (vocab, h), "row")]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "attn_norm.weight", (h,), "rep"), (p + "q.weight", (h, h), "row"), (p + "k.weight", (kv, h), "row"),
            (p + "v.weight", (kv, h), "row"), (p + "o.weight", (h, h), "col"), (p + "ffn_norm.weight", (h,), "rep"),
            (p + "gate.weight", (ffn, h), "row"), (p + "up.weight", (ffn, h), "row"), (p + "down.weight", (h, ffn), "col"),
        ]
    out += [("norm.weight", (h,), "rep"), ("output.weight", (vocab, h), "row")]
    return out


def units(tensors):
    """FSDP-style wrapping: one unit per layer, one for embedding + norm + head."""
    by: dict[str, list] = {}
    for t in tensors:
        key = t[0].split(".")[1] if t[0].startswith("layers.") else "rest"
        by.setdefault(key, []).append(t)
    return list(by.values())


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    c = -(-n // parts)
    lo = min(i * c, n)
    return lo, min(lo + c, n) - lo


def tp_box(shape, split, tp_rank):
    """(offsets, sizes, replica) of a TP rank's block."""
    if split == "rep":
        return (0,) * len(shape), tuple(shape), tp_rank
    d = 0 if split == "row" else 1
    o, s = _chunk(shape[d], TP, tp_rank)
    offs, sizes = [0] * len(shape), list(shape)
    offs[d], sizes[d] = o, s
    return tuple(offs), tuple(sizes), 0


def grid_box(shape, mesh, pl, coord, order=None) -> tuple[tuple, tuple, int]:
    """``(offsets, sizes, replica)`` of a DTensor's piece: torch.chunk cuts by each mesh
    dimension in ``order`` (default: mesh order), each inside the range the earlier ones left."""
    offs, sizes, replica = [0] * len(shape), list(shape), 0
    for m, d in enumerate(pl):
        if d < 0:
            replica = replica * mesh[m] + coord[m]
    for m in order if order is not None else range(len(mesh)):
        d = pl[m]
        if d >= 0:
            o, z = _chunk(sizes[d], mesh[m], coord[m])
            offs[d], sizes[d] = offs[d] + o, z
    return tuple(offs), tuple(sizes), replica


def rank_layouts(layout: str, tensors, world: int, rank: int) -> list[tuple[str, Layout]]:
    out = []
    if layout == "zero3":
        for unit in units(tensors):
            for i, lay, _, _ in partition_flat([s for _, s, _ in unit], world, rank, names=[n for n, _, _ in unit]):
                out.append((unit[i][0], lay))
    elif layout == "tp8-zero":
        dp, tp = divmod(rank, TP)
        if dp >= world // TP:  # ranks beyond the last whole TP group hold nothing
            return out
        for unit in units(tensors):
            boxes = [tp_box(s, split, tp) for _, s, split in unit]
            for i, lay, _, _ in partition_flat([s for _, s, _ in unit], world // TP, dp, boxes=boxes,
                                               names=[n for n, _, _ in unit]):
                out.append((unit[i][0], lay))
    elif layout in ("dtensor2d", "fsdp2tp"):
        mesh = (world // TP, TP)
        coord = divmod(rank, TP)
        for name, shape, split in tensors:
            order = None
            if len(shape) == 1:
                pl = (0, -1)  # (Shard(0), Replicate())
            elif layout == "fsdp2tp" and split == "row":
                pl, order = (0, 0), (1, 0)  # ColwiseParallel under fully_shard: (_StridedShard(0), Shard(0))
            else:
                pl = (0, 1)  # (Shard(0), Shard(1))
            offs, sizes, replica = grid_box(shape, mesh, pl, coord, order)
            hint = ("grid", mesh, pl, coord[0] * mesh[1] + coord[1], order)  # as _dtensor_layout gives it
            out.append((name, Layout(shape, offs, sizes, None, replica, hint)))
    else:
        raise ValueError(layout)
    return out


def summary_rows(layout, tensors, world, rank):
    return [["model", n, "BF16", list(lay.shape), *lay.to_json(), None] for n, lay in rank_layouts(layout, tensors, world, rank)]


def encode(rows, node: str) -> bytes:  # as plan.encode_summary
    raw = json.dumps({"node": node, "t": rows}, separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=3).compress(raw)


def pieces_per_layer(layout: str, world: int) -> float:
    if layout == "zero3":
        return 9 + world
    if layout == "tp8-zero":
        return TP * (9 + world // TP)
    return 9 * world


def load_side(blob: bytes, layout: str, tensors, world: int, ranks: list[int]) -> tuple[float, int]:
    """Seconds (max over sampled ranks) a rank of a ``world``-rank job spends before reading:
    parse + validate the manifest, then runs and byte ranges of every target."""
    worst, n_runs = 0.0, 0
    for r in ranks:
        t0 = time.perf_counter()
        man = Manifest.from_json(blob, "bench")
        for name, lay in rank_layouts(layout, tensors, world, r):
            st = man.tensors[("model", name)]
            base = man.files[st.file].data_start + st.begin
            runs = lay.runs()
            _ = base + runs.starts * 2  # byte offsets of the reads
            n_runs += len(runs)
        worst = max(worst, time.perf_counter() - t0)
    return worst, n_runs


def plan_one_rank(blobs, rank: int, bucket: int) -> SavePlan:
    """What one rank computes: decode every summary (rules: heads and payloads), plan, its
    own schedule."""
    if isinstance(blobs, tuple):
        heads, payloads = blobs
        summaries, rules = assemble(heads, payloads)
        plan = make_plan(summaries, bucket_bytes=bucket, rules=rules)
    else:
        plan = make_plan([decode_summary(b) for b in blobs], bucket_bytes=bucket)
    plan.schedule(rank)
    return plan


def _entries(layout, tensors, world, rank):
    return [Entry("model", n, torch.empty(0), lay) for n, lay in rank_layouts(layout, tensors, world, rank)]


def rule_inputs(layout: str, tensors, world: int) -> tuple[list[bytes], list[bytes], float]:
    """Every rank's head and payload, synthesised from the rules: the index-0 rank of each
    group (ZeRO / TP group, mesh) is summarised for real; a member ``i`` claims the group's
    units it holds a piece of (ranks past a unit's last element hold only padding of it).
    Returns the heads, the payloads and the seconds of one real ``summarize`` (max)."""
    groups = [(0, list(range(world)))] if layout != "tp8-zero" else [
        (tp, [dp * TP + tp for dp in range(world // TP)]) for tp in range(TP)]
    local: list = [None] * world
    worst = 0.0
    for _, members in groups:
        ents = _entries(layout, tensors, world, members[0])
        t0 = time.perf_counter()
        ls = summarize(ents, ["BF16"] * len(ents), f"n{members[0] // PER_NODE}")
        worst = max(worst, time.perf_counter() - t0)
        assert not ls.rows and len(ls.claims) == 1, "index 0 holds a piece of every unit"
        digests = ls.sets[ls.claims[0][0]]
        last = {}
        for d in digests:
            body = ls.units[d]
            if body["k"] == "grid":
                last[d] = body["n"] - 1
            else:
                used = sum(math.prod(t[3]) for t in body["t"])
                last[d] = (used - 1) // (body["total"] // body["n"])
        cache: dict = {}
        for i, r in enumerate(members):
            key = tuple(d for d in digests if last[d] >= i) if min(last.values()) < i else None
            if key not in cache:
                ds = list(key) if key is not None else digests
                cache[key] = (_digest(ds), ds)
            sid, ds = cache[key]
            if not ds:  # only padding: holds nothing, claims nothing
                local[r] = LocalSummary(f"n{r // PER_NODE}", [], [], {}, {}, {})
                continue
            local[r] = LocalSummary(f"n{r // PER_NODE}", [], [(sid, i)], {sid: ds}, ls.units, {sid: []})
    for r in sorted({0, world // 2 + 3, world - 1}):  # sampled ranks: their real summaries agree
        ents = _entries(layout, tensors, world, r)
        t0 = time.perf_counter()
        real = summarize(ents, ["BF16"] * len(ents), f"n{r // PER_NODE}")
        worst = max(worst, time.perf_counter() - t0)
        assert real.claims == local[r].claims and not real.rows, r
    heads = [x.head() for x in local]
    from unickpt.plan.summary import _claim_owners

    owners = _claim_owners(heads)
    return heads, [x.payload(heads, r, owners) for r, x in enumerate(local)], worst


def run(layout: str, world: int, layers: int, max_pieces: float, bucket: int, mem: bool) -> None:
    per = pieces_per_layer(layout, world)
    fit = max(1, min(layers, int(max_pieces // per)))
    tensors = model(fit)
    scale = layers / fit
    t0 = time.perf_counter()
    blobs = [encode(summary_rows(layout, tensors, world, r), f"n{r // PER_NODE}") for r in range(world)]
    gen = time.perf_counter() - t0
    sizes = np.array([len(b) for b in blobs])
    sample = sorted({0, 1, world // 2 + 3, world - 1})
    gc.collect()
    t0 = time.perf_counter()
    plan = make_plan([decode_summary(b) for b in blobs], bucket_bytes=bucket)
    t_plan = time.perf_counter() - t0
    t_sched = 0.0
    for r in sample:
        t1 = time.perf_counter()
        plan.schedule(r)
        t_sched = max(t_sched, time.perf_counter() - t1)
    n_pieces = sum(len(t.pieces) for t in plan.tensors.values())
    peak = float("nan")
    if mem:
        del plan
        gc.collect()
        tracemalloc.start()
        plan = plan_one_rank(blobs, sample[-1], bucket)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    blob = manifest_blob(plan)
    man = len(blob)
    t_load, _ = load_side(blob, layout, tensors, world // 2, sorted({0, world // 4 + 1, world // 2 - 1}))
    per_rank_s = (t_plan + t_sched) * scale
    note = f"  (measured on {fit} of {layers} layers, x{scale:.1f})" if scale > 1 else ""
    print(f"{layout:<10}{world:>7}  explicit pieces {n_pieces * scale:>11,.0f}  summary/rank {sizes.mean() * scale / 1024:8.1f} KiB"
          f"  all-gathered {sizes.sum() * scale / 2**20:9.1f} MiB{note}")
    print(f"{'':<19}plan/rank {per_rank_s:8.2f} s ({per_rank_s / TARGET_S:6.1f}x target; make_plan {t_plan * scale:.2f} s,"
          f" schedule {t_sched * scale:.3f} s)  peak mem {peak * scale / 2**20:8.1f} MiB ({peak * scale / TARGET_MEM:5.2f}x)")
    print(f"{'':<19}manifest {man * scale / 2**20:7.2f} MiB ({man * scale / len(plan.tensors) / scale:.0f} B/tensor), "
          f"{len(plan.files)} files; load at W/2: {t_load * scale:.3f} s/rank; simulating {gen:.1f} s")


def run_rules(layout: str, world: int, layers: int, bucket: int, mem: bool) -> None:
    tensors = model(layers)
    t0 = time.perf_counter()
    heads, payloads, t_sum = rule_inputs(layout, tensors, world)
    gen = time.perf_counter() - t0
    sent = np.array([len(h) + len(p) for h, p in zip(heads, payloads)])
    sample = sorted({0, 1, world // 2 + 3, world - 1})
    gc.collect()
    t0 = time.perf_counter()
    summaries, rules = assemble(heads, payloads)
    t_dec = time.perf_counter() - t0
    plan = make_plan(summaries, bucket_bytes=bucket, rules=rules)
    t_plan = time.perf_counter() - t0 - t_dec
    t_sched = 0.0
    for r in sample:
        t1 = time.perf_counter()
        plan.schedule(r)
        t_sched = max(t_sched, time.perf_counter() - t1)
    assert all(t.rules for t in plan.tensors.values())
    peak = float("nan")
    if mem:
        del plan
        _rules._FLAT.clear(), _rules._GEO.clear(), _rules._TILES.clear()  # count the geometry caches too
        gc.collect()
        tracemalloc.start()
        plan = plan_one_rank((heads, payloads), sample[-1], bucket)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    blob = manifest_blob(plan)
    t_load, _ = load_side(blob, layout, tensors, world // 2, sorted({0, world // 4 + 1, world // 2 - 1}))
    per_rank_s = t_sum + t_dec + t_plan + t_sched  # all of a rank's planning: its summary too
    print(f"{layout:<10}{world:>7}  rules   summary/rank {sent.mean() / 1024:8.2f} KiB (max {sent.max() / 1024:.1f})"
          f"  all-gathered {sent.sum() / 2**20:7.2f} MiB")
    print(f"{'':<19}plan/rank {per_rank_s:8.2f} s ({per_rank_s / TARGET_S:6.2f}x target; summarize {t_sum:.3f} s, "
          f"decode {t_dec:.2f} s, make_plan {t_plan:.2f} s, schedule {t_sched:.3f} s)  "
          f"peak mem {peak / 2**20:7.1f} MiB ({peak / TARGET_MEM:5.2f}x)")
    print(f"{'':<19}manifest {len(blob) / 2**20:7.2f} MiB ({len(blob) / len(plan.tensors):.0f} B/tensor), "
          f"{len(plan.files)} files; load at W/2: {t_load:.3f} s/rank; simulating {gen:.1f} s")


def manifest_blob(plan: SavePlan) -> bytes:
    """The manifest rank 0 would write for this plan: the save's own ``build_manifest``, fed one
    report with the checksum ranges the writers would produce (1 MiB blocks of each tensor,
    cut again at every in-place run start)."""
    from unickpt.format import CHECK_BLOCK
    from unickpt.saving.to_manifest import build_manifest

    checks = {}
    for t in plan.tensors.values():
        cuts = {0, t.nbytes, *range(0, t.nbytes, CHECK_BLOCK)}
        if t.direct:
            cuts.update(g * t.itemsize for _, _, g, _ in extents_of(t))
        c = sorted(cuts)
        checks[f"{t.role}/{t.name}"] = [[a, b, "0123456789abcdef"] for a, b in zip(c, c[1:])]
    rep = {"checksums": checks, "files": {f.name: f.size for f in plan.files}}
    return build_manifest(plan, [rep], 1, {}, {}, {}).to_json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1,000 ranks only")
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--layouts", default="zero3,tp8-zero,dtensor2d,fsdp2tp")
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default 1000,10000)")
    ap.add_argument("--max-pieces", type=float, default=1.5e6, help="pieces simulated at most (else extrapolated)")
    ap.add_argument("--bucket-mib", type=int, default=256)
    ap.add_argument("--no-mem", action="store_true", help="skip the tracemalloc run (halves the time)")
    ap.add_argument("--explicit", action="store_true", help="one summary row per piece (the planner before rules)")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else ([1000] if args.quick else [1000, 10000])
    n = len(model(args.layers))
    print(f"model: {args.layers} layers, {n} tensors; targets: plan < {TARGET_S:g} s/rank, "
          f"peak < {TARGET_MEM >> 20} MiB/rank, manifest independent of ranks")
    for world in worlds:
        for layout in args.layouts.split(","):
            if args.explicit:
                run(layout, world, args.layers, args.max_pieces, args.bucket_mib << 20, not args.no_mem)
            else:
                run_rules(layout, world, args.layers, args.bucket_mib << 20, not args.no_mem)


if __name__ == "__main__":
    main()
