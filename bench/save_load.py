"""Save/load throughput of unickpt against the machine's floors and against DCP, in one run.

    .venv/bin/python bench/save_load.py [--gb 2.0] [--ranks 2] [--repeats 3] [--dir PATH]

A synthetic GPT-like fp32 state (weights + Adam ``exp_avg`` + ``exp_avg_sq``: embeddings
(32000 x h), per layer qkv (3h x h), o (h x h), mlp up (4h x h), down (h x 4h); h = 1280,
the layer count picked to land near ``--gb``; h shrinks only for tiny sizes) is split
over ``--ranks`` gloo processes: every rank holds the Shard(0) row block (torch.chunk
split) of every tensor. Each process uses one thread (``OMP_NUM_THREADS=1``).

Every figure is the median over ``--repeats`` rounds of the *slowest rank's* wall time;
each timed region starts after a barrier. The rounds interleave all operations, so noise
from other work on the machine spreads over all of them; unickpt's and DCP's operations run
in ABBA order (unickpt first in even rounds, DCP first in odd ones). GB/s = bytes / median seconds,
aggregated over ranks (the bytes of the whole state, or of the whole checkpoint for
unickpt save).

Floors (what the machine can do, measured in the same run):
  memcpy        each rank copies its state into already-touched buffers of the same size.
  write direct  each rank writes (state bytes / ranks) to its own file with O_DIRECT from a
                page-aligned buffer in 64 MiB writes, then fsync: the durable-write floor
                that the save target is measured against.
  write buffer  the same through the page cache (+ fsync): for reference, usually noisy.
  read cold     each rank reads its direct-written file back in 64 MiB preads after fsync +
                posix_fadvise(DONTNEED): the floor for the load targets.
  read warm     the same read again, the file now in the page cache (for reference).

Operations:
  unickpt save          unickpt.save(...) to a new step directory (durable, committed).
  unickpt load          cold (every checkpoint file fsynced + DONTNEED by rank 0, then a
                        barrier) into preallocated zeros of the same Shard(0) layout.
  unickpt load reshard  cold, into Shard(1) column blocks (offsets=(0, col0)).
  dcp save / load / load reshard   torch.distributed.checkpoint on the same data as
                        DTensors (Shard(0); Shard(1) for the resharded load) on a 1-D cpu
                        mesh, FileSystemWriter(sync_files=True), default thread count.

Columns: "x floor" = floor GB/s / operation GB/s (1.00 = at the floor; saves against write
direct, loads against read cold); "x DCP" = unickpt seconds / DCP seconds for the same
operation (< 1: unickpt is faster). Targets: unickpt save <= 1.15x write direct; unickpt
load and load reshard <= 1.15x read cold. Loaded data is checked once (round 1, outside the
timing): bit-equal for same-layout loads, per-block xxhash for the resharded ones, for
unickpt and DCP alike.

Also printed: unickpt's own phase timings (SaveResult/LoadResult.phases) and, per
operation, the bytes that went through read/write system calls (socket traffic such as
gloo's included) and the bytes that reached the block layer, from /proc/self/io, so a load
that reads twice what it delivers, or a save that ships data between ranks, shows.
Raw numbers go to bench/out/save_load.json. ``measure()`` is what bench/run_all.py calls.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import xxhash  # noqa: E402

import unickpt  # noqa: E402
from bench._common import (  # noqa: E402
    OUT, abba, clear_dir, cold_barrier, files_floor, floor_buffer, floor_read, floor_write, log, print_table,
    fmt, rm_scratch, run_ranks, scratch, timed, write_json,
)

KINDS = ("model", "exp_avg", "exp_avg_sq")
LOADS = ("unickpt_load", "unickpt_load_reshard", "unickpt_load_noverify", "unickpt_load_reshard_noverify",
         "dcp_load", "dcp_load_reshard")  # each with its floor, "files_<op>": its own files read right before it
OPS = (
    "memcpy", "write_buffered", "write_direct", "read_cold", "read_warm",
    *(f"files_{op}" for op in LOADS),
    "unickpt_save", "unickpt_load", "unickpt_load_reshard",
    "unickpt_load_noverify", "unickpt_load_reshard_noverify",
    "dcp_save", "dcp_load", "dcp_load_reshard",
)
LABELS = {
    "memcpy": "memcpy floor", "write_buffered": "write buffered+fsync",
    "write_direct": "write O_DIRECT+fsync", "read_cold": "read cold", "read_warm": "read warm",
    **{f"files_{op}": "  its files, cold" for op in LOADS},
    "unickpt_save": "unickpt save", "unickpt_load": "unickpt load",
    "unickpt_load_reshard": "unickpt load reshard", "dcp_save": "dcp save",
    "unickpt_load_noverify": "  same, verify=none", "unickpt_load_reshard_noverify": "  same, verify=none",
    "dcp_load": "dcp load", "dcp_load_reshard": "dcp load reshard",
}
# a load's floor: the plain cold read of its checkpoint's own files (each library's), right
# before it. A file written just before (read_cold) reads faster here than a checkpoint's
# files, and a read right after a save or after several loads of the same files is slower
# or faster than the others (docs/performance.md): each load is paired with its own read.
FLOOR_OF = {"unickpt_save": "write_direct", "dcp_save": "write_direct", **{op: f"files_{op}" for op in LOADS}}
VERIFY_OF = {"unickpt_load": "unickpt_load_noverify", "unickpt_load_reshard": "unickpt_load_reshard_noverify"}
VERIFY_TARGET = 0.05  # verification may cost at most 5% of a cold load
DCP_OF = {"unickpt_save": "dcp_save", "unickpt_load": "dcp_load", "unickpt_load_reshard": "dcp_load_reshard"}
TARGETS = {"unickpt_save": 1.15, "unickpt_load": 1.15, "unickpt_load_reshard": 1.15}


# -- the synthetic state ---------------------------------------------------------------

def model_shapes(gb: float) -> tuple[int, int, list[tuple[str, tuple[int, int]]]]:
    """(hidden, layers, [(name, shape)]) of a GPT-like model whose fp32 weights plus two Adam
    moments come to about ``gb`` GB."""
    per_kind = gb * 1e9 / 4 / 3  # fp32 elements per kind (weights, exp_avg, exp_avg_sq)
    vocab, h = 32000, 1280
    while h > 128 and vocab * h + 2 * 12 * h * h > per_kind:
        h -= 128
    layers = max(1, round((per_kind - vocab * h) / (12 * h * h)))
    shapes = [("embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [(p + "attn.qkv.weight", (3 * h, h)), (p + "attn.o.weight", (h, h)),
                   (p + "mlp.up.weight", (4 * h, h)), (p + "mlp.down.weight", (h, 4 * h))]
    return h, layers, shapes


def chunk_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """(start, size) of ``rank``'s block of ``n`` under torch.chunk / DTensor Shard rules."""
    c = -(-n // world)
    start = min(rank * c, n)
    return start, max(0, min(c, n - start))


def nested(flat: dict) -> dict:
    """{(kind, name): v} -> the state dict structure unickpt and DCP get."""
    out = {"model": {}, "optimizer": {"exp_avg": {}, "exp_avg_sq": {}}}
    for (kind, name), v in flat.items():
        (out["model"] if kind == "model" else out["optimizer"][kind])[name] = v
    return out


class RankState:
    """One rank's source blocks (random), same-layout targets and column-block targets."""

    def __init__(self, rank: int, world: int, shapes) -> None:
        self.rank, self.world, self.shapes = rank, world, dict(shapes)
        g = torch.Generator().manual_seed(1234 + rank)
        self.src, self.tgt, self.rtgt = {}, {}, {}
        for kind in KINDS:
            for name, (n, m) in shapes:
                r0, rn = chunk_range(n, world, rank)
                c0, cn = chunk_range(m, world, rank)
                self.src[(kind, name)] = torch.randn((rn, m), generator=g)
                self.tgt[(kind, name)] = torch.zeros((rn, m))
                self.rtgt[(kind, name)] = torch.zeros((n, cn))
        self.local_bytes = sum(t.numel() * 4 for t in self.src.values())
        self.total_bytes = 3 * sum(n * m * 4 for n, m in self.shapes.values())

    def sharded(self, which: str) -> dict:
        """unickpt state dict over the sources / targets / column targets."""
        out = {}
        for (kind, name), t in getattr(self, which).items():
            shape = self.shapes[name]
            if which == "rtgt":
                off = (0, chunk_range(shape[1], self.world, self.rank)[0])
            else:
                off = (chunk_range(shape[0], self.world, self.rank)[0], 0)
            out[(kind, name)] = unickpt.shard(t, shape, offsets=off)
        return nested(out)

    def dtensors(self, which: str, mesh) -> dict:
        from torch.distributed.tensor import DTensor, Shard

        place = [Shard(1) if which == "rtgt" else Shard(0)]
        out = {}
        for (kind, name), t in getattr(self, which).items():
            n, m = self.shapes[name]
            out[(kind, name)] = DTensor.from_local(t, mesh, place, run_check=False, shape=(n, m), stride=(m, 1))
        return nested(out)


# -- verification (outside the timing) ------------------------------------------------

def verify_same(st: RankState) -> int:
    """Number of tensors whose same-layout target differs from the source."""
    return sum(not torch.equal(st.src[k], st.tgt[k]) for k in st.src)


def _h(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.contiguous().numpy())


def verify_reshard(st: RankState) -> int:
    """Number of (tensor, source row block) pieces of this rank's column targets that differ
    from what the owning rank holds: every rank hashes its row block's column slices, the
    hashes are shared, each rank compares the row slices of its column targets."""
    mine = {}
    for (kind, name), t in st.src.items():
        for c in range(st.world):
            c0, cn = chunk_range(st.shapes[name][1], st.world, c)
            mine[(kind, name, st.rank, c)] = _h(t[:, c0 : c0 + cn])
    every = [None] * st.world
    dist.all_gather_object(every, mine)
    expect = {k: v for d in every for k, v in d.items()}
    bad = 0
    for (kind, name), t in st.rtgt.items():
        for s in range(st.world):
            r0, rn = chunk_range(st.shapes[name][0], st.world, s)
            bad += _h(t[r0 : r0 + rn]) != expect[(kind, name, s, st.rank)]
    return bad


def zero(tensors: dict) -> None:
    for t in tensors.values():
        t.zero_()


# -- floors ----------------------------------------------------------------------------

def floor_memcpy(st: RankState):
    def copy():
        for k, t in st.src.items():
            st.tgt[k].copy_(t)
    return timed(copy)


# -- the rank job ----------------------------------------------------------------------

def rank_job(rank: int, world: int, cfg: dict) -> dict:
    """Runs on every rank: builds the state, then ``repeats`` rounds of every operation."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    st = RankState(rank, world, cfg["shapes"])
    log(f"state built in {time.perf_counter() - t0:.1f} s ({st.local_bytes / 1e9:.2f} GB on rank 0)", rank)
    mesh = init_device_mesh("cpu", (world,))
    u_src, u_tgt, u_rtgt = st.sharded("src"), st.sharded("tgt"), st.sharded("rtgt")
    d_src, d_tgt, d_rtgt = st.dtensors("src", mesh), st.dtensors("tgt", mesh), st.dtensors("rtgt", mesh)

    data = cfg["data"]
    u_root, d_root = os.path.join(data, "unickpt"), os.path.join(data, "dcp")
    floor_file = os.path.join(data, f"floor-rank{rank}.bin")
    share = -(-st.total_bytes // world // 4096) * 4096
    buf = floor_buffer(next(iter(st.src.values())))  # page-aligned; real state bytes
    clear_dir(u_root, rank)
    clear_dir(d_root, rank)

    res: dict = {op: {"seconds": [], "io": []} for op in OPS}
    res["unickpt_save"].update(phases=[], bytes=[], local_bytes=[])
    for op in ("unickpt_load", "unickpt_load_reshard", "unickpt_load_noverify", "unickpt_load_reshard_noverify"):
        res[op].update(phases=[], bytes_read=[])
    res["meta"] = {"local_bytes": st.local_bytes, "total_bytes": st.total_bytes, "floor_share": share}
    checks = res["verify"] = {}

    def record(op: str, measured):
        seconds, out, io = measured
        res[op]["seconds"].append(seconds)
        res[op]["io"].append(io)
        log(f"round {i + 1}/{cfg['repeats']} {LABELS[op]:<22} {seconds:7.3f} s (rank 0)", rank)
        return out

    def run_unickpt(i: int) -> None:
        """unickpt: save, then cold loads of that checkpoint."""
        clear_dir(u_root, rank)
        path = os.path.join(u_root, f"step-{i}")
        r = record("unickpt_save", timed(lambda: unickpt.save(u_src, path, step=i)))
        res["unickpt_save"]["phases"].append(r.phases)
        res["unickpt_save"]["bytes"].append(r.bytes)
        res["unickpt_save"]["local_bytes"].append(r.local_bytes)
        # verified (the default) and unverified loads alternate, in both orders over rounds
        loads = [("unickpt_load", u_tgt, st.tgt, "auto"), ("unickpt_load_noverify", u_tgt, st.tgt, "none"),
                 ("unickpt_load_reshard", u_rtgt, st.rtgt, "auto"),
                 ("unickpt_load_reshard_noverify", u_rtgt, st.rtgt, "none")]
        if i % 2:
            loads = [loads[1], loads[0], loads[3], loads[2]]
        for op, tgt, flat, how in loads:
            if i == 0:
                zero(flat)
            record(f"files_{op}", files_floor(path, rank, world, buf))  # its floor, right before it
            cold_barrier(path, rank)
            r = record(op, timed(lambda: unickpt.load(tgt, path, options=unickpt.LoadOptions(verify=how))))
            res[op]["phases"].append(r.phases)
            res[op]["bytes_read"].append(r.bytes_read)
            if i == 0:
                checks[op] = verify_same(st) if op.startswith("unickpt_load_no") or op == "unickpt_load" else verify_reshard(st)
        clear_dir(u_root, rank)

    def run_dcp(i: int) -> None:
        """DCP on the same data."""
        clear_dir(d_root, rank)
        dpath = os.path.join(d_root, f"step-{i}")
        record("dcp_save", timed(lambda: dcp.save(d_src, storage_writer=FileSystemWriter(dpath, sync_files=True))))
        for op, tgt, flat in (("dcp_load", d_tgt, st.tgt), ("dcp_load_reshard", d_rtgt, st.rtgt)):
            if i == 0:
                zero(flat)
            record(f"files_{op}", files_floor(dpath, rank, world, buf))  # its floor: DCP's files
            cold_barrier(dpath, rank)
            record(op, timed(lambda: dcp.load(tgt, storage_reader=FileSystemReader(dpath))))
            if i == 0:
                checks[op] = verify_same(st) if op == "dcp_load" else verify_reshard(st)
        clear_dir(d_root, rank)

    i = 0
    for i in range(cfg["repeats"]):
        record("memcpy", floor_memcpy(st))
        record("write_buffered", floor_write(floor_file, buf, share, direct=False))
        record("write_direct", floor_write(floor_file, buf, share, direct=True))
        record("read_cold", floor_read(floor_file, buf, cold=True))
        record("read_warm", floor_read(floor_file, buf, cold=False))
        os.remove(floor_file)

        for block in abba(i, run_unickpt, run_dcp):
            block(i)
    buf.close()
    dist.barrier()
    return res


# -- report ----------------------------------------------------------------------------

def summarize(results: list[dict], repeats: int) -> dict:
    meta = results[0]["meta"]
    out: dict = {}
    for op in OPS:
        per_round = [max(r[op]["seconds"][i] for r in results) for i in range(repeats)]
        if op == "unickpt_save":
            nbytes = results[0][op]["bytes"][0]
        elif op.startswith(("write", "read")):
            nbytes = meta["floor_share"] * len(results)
        else:
            nbytes = meta["total_bytes"]
        med = statistics.median(per_round)
        out[op] = {"per_round_max": per_round, "by_rank": [r[op]["seconds"] for r in results],
                   "median": med, "bytes": nbytes, "gbps": nbytes / med / 1e9}
        if "phases" in results[0][op]:
            names = list(dict.fromkeys(p for r in results for ph in r[op]["phases"] for p in ph))
            out[op]["phases"] = {
                p: {"median_of_max": statistics.median(max(r[op]["phases"][i].get(p, 0.0) for r in results)
                                                       for i in range(repeats)),
                    "median_by_rank": [statistics.median(ph.get(p, 0.0) for ph in r[op]["phases"]) for r in results]}
                for p in names
            }
        out[op]["io_sum_over_ranks"] = {
            k: statistics.median(sum(r[op]["io"][i][k] for r in results) for i in range(repeats))
            for k in results[0][op]["io"][0]
        }
        for key in ("bytes_read", "local_bytes"):
            if key in results[0][op]:
                out[op][key + "_by_rank"] = [r[op][key][0] for r in results]
    for op, fl in FLOOR_OF.items():
        if fl.startswith("files_"):  # per round: the load over the read of its files just before it
            out[op]["x_floor"] = statistics.median(a / b for a, b in zip(out[op]["per_round_max"], out[fl]["per_round_max"]))
        else:
            out[op]["x_floor"] = out[fl]["gbps"] / out[op]["gbps"]
    for op, d in DCP_OF.items():
        out[op]["x_dcp"] = out[op]["median"] / out[d]["median"]
    for op, nv in VERIFY_OF.items():  # cost of verification, per round (same round: same noise)
        costs = [(a - b) / a for a, b in zip(out[op]["per_round_max"], out[nv]["per_round_max"])]
        out[op]["verify_cost"] = statistics.median(costs)
    return out


def print_report(summary: dict, cfg: dict, verify: dict) -> None:
    m = cfg["model"]
    print(f"\nstate: {m['total_bytes'] / 1e9:.3f} GB fp32 ({m['tensors']} tensors = {m['layers']} layers x 4 + "
          f"embeddings, hidden {m['hidden']}, x3 for weights + exp_avg + exp_avg_sq), "
          f"{cfg['ranks']} ranks, Shard(0) row blocks, {cfg['repeats']} rounds, data dir {cfg['dir']}")
    rows = []
    for op in OPS:
        s = summary[op]
        tgt = ""
        if op in TARGETS:
            ok = s["x_floor"] <= TARGETS[op]
            tgt = f"<= {TARGETS[op]:.2f}x {LABELS[FLOOR_OF[op]]}: {'PASS' if ok else 'MISS'}"
        rows.append([LABELS[op], fmt(s["median"]), fmt(s["gbps"], ".2f"), fmt(s.get("x_floor"), ".2f"),
                     fmt(s.get("x_dcp"), ".2f"), tgt])
    print_table(["operation", "median s", "GB/s", "x floor", "x DCP", "target"], rows)
    print("\nunickpt phases, seconds (median over rounds of the slowest rank; per-rank medians in brackets;\n"
          "save: gather and fsync are parts of write):")
    for op, nv in VERIFY_OF.items():
        c = summary[op]["verify_cost"]
        print(f"verification cost, {LABELS[op]}: {c * 100:+.1f}% of the verified load's time (median over rounds "
              f"of (verified - verify=none) / verified); target < {VERIFY_TARGET * 100:.0f}%: "
              f"{'PASS' if c < VERIFY_TARGET else 'MISS'}; bytes read per rank "
              f"{', '.join(f'{b / 1e9:.3f}' for b in summary[op]['bytes_read_by_rank'])} GB vs "
              f"{', '.join(f'{b / 1e9:.3f}' for b in summary[nv]['bytes_read_by_rank'])} GB unverified")
    for op in ("unickpt_save", "unickpt_load", "unickpt_load_reshard"):
        parts = []
        for p, v in summary[op]["phases"].items():
            ranks = ", ".join(f"{x:.3f}" for x in v["median_by_rank"])
            parts.append(f"{p} {v['median_of_max']:.3f} [{ranks}]")
        print(f"  {LABELS[op]:<21} " + "; ".join(parts))
    s = summary["unickpt_save"]
    print(f"  save bytes written per rank: {', '.join(f'{b / 1e9:.3f} GB' for b in s['local_bytes_by_rank'])}")
    for op in ("unickpt_load", "unickpt_load_reshard"):
        br = summary[op]["bytes_read_by_rank"]
        print(f"  {LABELS[op]} bytes read per rank: {', '.join(f'{b / 1e9:.3f} GB' for b in br)} "
              f"(state share {m['total_bytes'] / cfg['ranks'] / 1e9:.3f} GB)")
    print("\nI/O per operation, GB summed over ranks (median over rounds; /proc/self/io: read/write = through "
          "syscalls, disk = reached the block layer):")
    rows = []
    for op in OPS[1:]:
        io = summary[op]["io_sum_over_ranks"]
        rows.append([LABELS[op]] + [fmt(io[k] / 1e9) for k in ("rchar", "read_bytes", "wchar", "write_bytes")])
    print_table(["operation", "read", "disk rd", "write", "disk wr"], rows)
    bad = {k: v for k, v in verify.items() if v}
    print("\nverification (round 1): " + ("all loaded data matches the source" if not bad
          else f"MISMATCHES: {bad}"))


def measure(gb: float = 2.0, ranks: int = 2, repeats: int = 3, parent: str | None = None,
            timeout: float = 1800) -> dict:
    """Run the whole bench (rank job, summary); returns {"config", "summary", "verify", "raw"}.
    The scratch files go to a new directory under ``parent`` (default bench/out/data), removed
    at the end."""
    hidden, layers, shapes = model_shapes(gb)
    total = 3 * sum(math.prod(s) * 4 for _, s in shapes)
    parent = os.path.abspath(parent or os.path.join(OUT, "data"))
    data = scratch(parent, "run")
    cfg = {"gb": gb, "ranks": ranks, "repeats": repeats, "dir": parent, "data": data, "shapes": shapes,
           "model": {"hidden": hidden, "layers": layers, "tensors": 3 * len(shapes), "total_bytes": total},
           "torch": torch.__version__, "unickpt": unickpt.__version__, "cpus": os.cpu_count()}
    log(f"save_load: {total / 1e9:.3f} GB, {ranks} ranks, {repeats} rounds, data in {data}")
    try:
        results = run_ranks(rank_job, ranks, cfg, timeout=timeout)
    finally:
        rm_scratch(data)
    summary = summarize(results, repeats)
    verify = {k: sum(r["verify"][k] for r in results) for k in results[0]["verify"]}
    return {"config": cfg, "summary": summary, "verify": verify, "targets": TARGETS, "raw": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="total state size in GB (default 2.0)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(OUT, "data"),
                    help="scratch directory for the files (default bench/out/data; keep it on the real disk)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds before the rank job is killed")
    ap.add_argument("--json", default=os.path.join(OUT, "save_load.json"))
    args = ap.parse_args()
    out = measure(args.gb, args.ranks, args.repeats, args.dir, args.timeout)
    print_report(out["summary"], out["config"], out["verify"])
    print(f"raw numbers: {write_json(args.json, out)}")
    return 1 if any(out["verify"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
