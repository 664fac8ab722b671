"""What compression costs and saves on a multi-rank save and load, in one run.

    .venv/bin/python bench/compressed_save.py [--gb 1.0] [--ranks 2] [--repeats 3]

State: the GPT-like fp32 state of bench/save_load.py (weights, exp_avg ~1e-3 * N(0, 1),
exp_avg_sq ~1e-6 * |N(0, 1)|), Shard(0) row blocks over ``--ranks`` gloo processes, one thread
each. For every setting (O0, O1, O2, O1 + zstd 3) and for DCP's save (the uncompressed
peer), the medians over ``--repeats`` rounds of the slowest rank's time: save (durable and
committed), cold load into the same layout, and the bytes on disk. Ratios: to the O0 save /
load of the same run, and the O_DIRECT write floor of the O0 bytes (write direct, as in
bench/save_load.py).
"""

from __future__ import annotations

import argparse
import math
import mmap
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import unickpt  # noqa: E402
from save_load import IO_CHUNK, RankState, clear_dir, cold_barrier, floor_write, model_shapes  # noqa: E402
from tests import dist as harness  # noqa: E402

SETTINGS = {"O0": {}, "O1": {"quant": "O1"}, "O2": {"quant": "O2"}, "O1+zstd3": {"quant": "O1", "zstd": 3}}


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
    buf = mmap.mmap(-1, IO_CHUNK)
    out: dict = {k: {"save": [], "load": [], "bytes": 0} for k in [*SETTINGS, "dcp"]}
    out["floor"] = []

    def slowest(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt.item())

    for i in range(cfg["repeats"]):
        out["floor"].append(slowest(lambda: floor_write(os.path.join(data, f"floor{rank}.bin"), buf, share, True)))
        for name, kw in SETTINGS.items():
            path = os.path.join(data, f"{name}-{i}")
            out[name]["save"].append(slowest(lambda: unickpt.save(src, path, **kw)))
            cold_barrier(path, rank)
            out[name]["load"].append(slowest(lambda: unickpt.load(tgt, path)))
            if rank == 0:
                out[name]["bytes"] = unickpt.read_manifest(path)[1].total_bytes
        path = os.path.join(data, f"dcp-{i}")
        out["dcp"]["save"].append(slowest(lambda: dcp.save(d_src, storage_writer=FileSystemWriter(path, sync_files=True))))
        if rank == 0:
            out["dcp"]["bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        dist.barrier()
        if rank == 0:
            for d in os.listdir(data):
                p = os.path.join(data, d)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        dist.barrier()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(HERE), "bench", "out", "data"))
    args = ap.parse_args()
    _, _, shapes = model_shapes(args.gb)
    total = 3 * sum(math.prod(s) * 4 for _, s in shapes)
    data = os.path.join(os.path.abspath(args.dir), f"compressed-{os.getpid()}")
    os.makedirs(data)
    cfg = {"shapes": shapes, "repeats": args.repeats, "data": data}
    try:
        res = harness.run(rank_job, args.ranks, cfg, timeout=3000, env={"OMP_NUM_THREADS": "1"})[0]
    finally:
        shutil.rmtree(data, ignore_errors=True)
    med = {k: {m: statistics.median(v[m]) for m in ("save", "load") if v[m]} | {"bytes": v["bytes"]}
           for k, v in res.items() if k != "floor"}
    floor = statistics.median(res["floor"])
    o0 = med["O0"]
    print(f"state {total / 1e9:.2f} GB fp32 (weights, exp_avg, exp_avg_sq), {args.ranks} ranks, medians of {args.repeats}; "
          f"O_DIRECT write floor {floor:.2f} s")
    print(f"{'setting':<10}{'GB on disk':>11}{'x O0':>7}{'save s':>8}{'x O0':>7}{'x floor':>8}{'load s':>8}{'x O0':>7}")
    for k, v in med.items():
        load = f"{v['load']:>8.2f}{v['load'] / o0['load']:>7.2f}" if "load" in v else f"{'-':>8}{'-':>7}"
        print(f"{k:<10}{v['bytes'] / 1e9:>11.3f}{v['bytes'] / o0['bytes']:>7.2f}{v['save']:>8.2f}{v['save'] / o0['save']:>7.2f}"
              f"{v['save'] / floor:>8.2f}{load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
