"""What compression costs and saves on a multi-rank save and load, in one run.

    .venv/bin/python bench/compressed_save.py [--gb 1.0] [--ranks 2] [--repeats 3]

State: the GPT-like fp32 state of bench/save_load.py (weights, exp_avg ~1e-3 * N(0, 1),
exp_avg_sq ~1e-6 * |N(0, 1)|), Shard(0) row blocks over ``--ranks`` gloo processes, one thread
each. For every setting (O0, O1, O2, O1 + zstd 3) and for DCP's save (the uncompressed
peer), the medians over ``--repeats`` rounds of the slowest rank's time: save (durable and
committed), cold load into the same layout, and the bytes on disk. unickpt's settings and
DCP run in ABBA order (unickpt first in even rounds). Ratios: to the O0 save / load of the
same run, and the O_DIRECT write floor of the O0 bytes (write direct, as in
bench/save_load.py). ``measure()`` is what bench/run_all.py calls.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import unickpt  # noqa: E402
from bench._common import (  # noqa: E402
    OUT, abba, clear_dir, cold_barrier, floor_buffer, floor_write, fmt, log, print_table, rm_scratch, run_ranks,
    scratch, slowest,
)
from bench.save_load import RankState, model_shapes  # noqa: E402

SETTINGS = {name: unickpt.SaveOptions(compression=c) for name, c in (
    ("O0", None), ("O1", unickpt.Compression(quant="O1")), ("O2", unickpt.Compression(quant="O2")),
    ("O1+zstd3", unickpt.Compression(quant="O1", zstd=3)))}


def rank_job(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    st = RankState(rank, world, cfg["shapes"])
    for (kind, _), t in st.src.items():
        if kind == "exp_avg":
            t.mul_(1e-3)
        elif kind == "exp_avg_sq":
            t.abs_().mul_(1e-6)
    src, tgt = st.sharded("src"), st.sharded("tgt")
    mesh = init_device_mesh("cpu", (world,))
    d_src = st.dtensors("src", mesh)
    data = cfg["data"]
    clear_dir(data, rank)
    share = -(-st.total_bytes // world // 4096) * 4096
    buf = floor_buffer(next(iter(st.src.values())))
    out: dict = {k: {"save": [], "load": [], "bytes": 0} for k in [*SETTINGS, "dcp"]}
    out["floor"] = []

    def run_unickpt(i: int) -> None:
        for name, opts in SETTINGS.items():
            path = os.path.join(data, f"{name}-{i}")
            out[name]["save"].append(slowest(lambda: unickpt.save(src, path, options=opts)))
            cold_barrier(path, rank)
            out[name]["load"].append(slowest(lambda: unickpt.load(tgt, path)))
            if rank == 0:
                out[name]["bytes"] = unickpt.read_manifest(path)[1].total_bytes
            log(f"round {i + 1}/{cfg['repeats']} {name:<9} save {out[name]['save'][-1]:.3f} s, "
                f"load {out[name]['load'][-1]:.3f} s", rank)

    def run_dcp(i: int) -> None:
        path = os.path.join(data, f"dcp-{i}")
        out["dcp"]["save"].append(slowest(lambda: dcp.save(d_src, storage_writer=FileSystemWriter(path, sync_files=True))))
        if rank == 0:
            out["dcp"]["bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        log(f"round {i + 1}/{cfg['repeats']} dcp       save {out['dcp']['save'][-1]:.3f} s", rank)

    for i in range(cfg["repeats"]):
        out["floor"].append(slowest(lambda: floor_write(os.path.join(data, f"floor{rank}.bin"), buf, share, True)))
        for block in abba(i, run_unickpt, run_dcp):
            block(i)
        dist.barrier()
        if rank == 0:
            for d in os.listdir(data):
                p = os.path.join(data, d)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        dist.barrier()
    buf.close()
    return out


def measure(gb: float = 1.0, ranks: int = 2, repeats: int = 3, parent: str | None = None,
            timeout: float = 3000) -> dict:
    """Run the bench; returns {"total_bytes", "floor" (s), "settings": {name: {"save", "load"
    (medians, s), "bytes"}}, "raw"} (bench/run_all.py calls this)."""
    _, _, shapes = model_shapes(gb)
    total = 3 * sum(math.prod(s) * 4 for _, s in shapes)
    data = scratch(parent or os.path.join(OUT, "data"), "compressed")
    log(f"compressed_save: {total / 1e9:.3f} GB, {ranks} ranks, {repeats} rounds, data in {data}")
    try:
        res = run_ranks(rank_job, ranks, {"shapes": shapes, "repeats": repeats, "data": data}, timeout=timeout)[0]
    finally:
        rm_scratch(data)
    med = {k: {m: statistics.median(v[m]) for m in ("save", "load") if v[m]} | {"bytes": v["bytes"]}
           for k, v in res.items() if k != "floor"}
    return {"total_bytes": total, "ranks": ranks, "repeats": repeats, "floor": statistics.median(res["floor"]),
            "settings": med, "raw": res}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(OUT, "data"))
    args = ap.parse_args()
    out = measure(args.gb, args.ranks, args.repeats, args.dir)
    med, floor = out["settings"], out["floor"]
    o0 = med["O0"]
    print(f"state {out['total_bytes'] / 1e9:.2f} GB fp32 (weights, exp_avg, exp_avg_sq), {args.ranks} ranks, medians "
          f"of {args.repeats}; O_DIRECT write floor {floor:.2f} s")
    rows = []
    for k, v in med.items():
        rows.append([k, fmt(v["bytes"] / 1e9), fmt(v["bytes"] / o0["bytes"], ".2f"), fmt(v["save"], ".2f"),
                     fmt(v["save"] / o0["save"], ".2f"), fmt(v["save"] / floor, ".2f"),
                     fmt(v["load"], ".2f") if "load" in v else "-",
                     fmt(v["load"] / o0["load"], ".2f") if "load" in v else "-"])
    print_table(["setting", "GB on disk", "x O0", "save s", "x O0", "x floor", "load s", "x O0"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
