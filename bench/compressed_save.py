"""What compression costs and saves on a multi-rank save and load, at local-disk speed and on
storage throttled to 200 MB/s per rank, in one run.

    .venv/bin/python bench/compressed_save.py [--gb 1.0] [--ranks 2] [--repeats 3] [--table-gb 0.5]

Two states, Shard(0) row blocks over ``--ranks`` gloo processes, one thread each:

* **targets** (``--gb``): the fp32 state of bench/save_load.py that issue #40 measured
  (weights, exp_avg ~1e-4 * N(0, 1), exp_avg_sq ~(1e-4 * N(0, 1))^2), saved with O0, O1, O2,
  O1 + zstd 3, lossless and O1 + lossless, and with DCP (the uncompressed peer). Medians over
  ``--repeats`` rounds of the slowest rank: durable save, cold load into the same layout,
  bytes on disk; unickpt's settings and DCP in ABBA order. Then the same settings on storage
  throttled to ``--throttle`` MB/s per rank (a token bucket around every file write and
  read of the rank: a bench-only wrapper of the local store; saves are synchronous here, so
  the limiter sees every write), one round. Targets (issue #40): O1 and O2 saves no slower
  than O0 on the local disk; throttled, O1 <= 0.55x O0's save and O2 <= 0.5x.
* **table** (``--table-gb``): a mixed-precision AdamW state as trainers hold it (bf16 model
  weights, fp32 masters, exp_avg, exp_avg_sq: 14 bytes per parameter), saved with every
  setting and stack docs/compression.md lists, at both speeds, one round each: bytes per
  parameter, save and load seconds.

``measure()`` is what bench/run_all.py calls.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import threading
import time

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

C = unickpt.Compression
TARGET_SETTINGS = {"O0": C(), "O1": C(quant="O1"), "O2": C(quant="O2"), "O1+zstd3": C(quant="O1", zstd=3),
                   "lossless": C(lossless=True), "O1+lossless": C(quant="O1", lossless=True)}
TABLE_SETTINGS = {"O0": C(), "lossless": C(lossless=True), "residual": C(master="residual"),
                  "residual+lossless": C(master="residual", lossless=True), "O1": C(quant="O1"),
                  "O1+residual": C(quant="O1", master="residual"),
                  "O1+residual+lossless": C(quant="O1", master="residual", lossless=True),
                  "O2+residual": C(quant="O2", master="residual"), "O2+drop": C(quant="O2", master="drop"),
                  "O2+drop+lossless": C(quant="O2", master="drop", lossless=True)}
THROTTLE_MBPS = 200.0


# -- the bench-only rate limiter ------------------------------------------------------------------

class _Bucket:
    """One rank's storage bandwidth: every byte written or read waits for its turn at ``rate``
    bytes per second (shared by the rank's threads)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.t, self.lock = rate, 0.0, threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.t = max(self.t, now) + n / self.rate
            wait = self.t - now
        if wait > 0:
            time.sleep(wait)


class _Slow:
    """A writer or reader of the local store whose data moves through the bucket."""

    def __init__(self, inner, bucket: _Bucket) -> None:
        self._inner, self._bucket = inner, bucket

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def write_at(self, offset, data, *a, **kw):
        self._bucket.take(len(memoryview(data).cast("B")))
        return self._inner.write_at(offset, data, *a, **kw)

    def readinto(self, offset, out):
        self._bucket.take(len(memoryview(out).cast("B")))
        return self._inner.readinto(offset, out)

    def resident(self, offset, n):  # never "in memory": the load plans for a slow device
        return None

    def mapped(self, offset, n):
        raise OSError("throttled storage: not mapped")


def throttle(rate_mbps: float | None):
    """Route this process's local-store file writes and reads through a token bucket of
    ``rate_mbps`` MB/s (None: undo). Returns the previous functions."""
    from unickpt.io import local

    if not hasattr(local.LocalStorage, "_bench_real"):
        local.LocalStorage._bench_real = (local.LocalStorage.open_writer, local.LocalStorage.open_reader)
    real_w, real_r = local.LocalStorage._bench_real
    if rate_mbps is None:
        local.LocalStorage.open_writer, local.LocalStorage.open_reader = real_w, real_r
        return
    bucket = _Bucket(rate_mbps * 1e6)
    local.LocalStorage.open_writer = lambda self, path, **kw: _Slow(real_w(self, path, **kw), bucket)
    local.LocalStorage.open_reader = lambda self, path: _Slow(real_r(self, path), bucket)


# -- the states -----------------------------------------------------------------------------------

def _fp32_state(rank, world, shapes):
    st = RankState(rank, world, shapes)
    for (kind, _), t in st.src.items():
        if kind == "exp_avg":
            t.mul_(1e-4)
        elif kind == "exp_avg_sq":
            t.mul_(1e-4).square_()
    return st, st.sharded("src"), st.sharded("tgt")


def _mixed_state(rank, world, shapes):
    """bf16 model, fp32 master, exp_avg, exp_avg_sq (row blocks): 14 bytes per parameter."""
    from bench.save_load import chunk_range

    g = torch.Generator().manual_seed(99 + rank)
    src = {"model": {}, "master": {}, "optimizer": {"exp_avg": {}, "exp_avg_sq": {}}}
    tgt = {"model": {}, "master": {}, "optimizer": {"exp_avg": {}, "exp_avg_sq": {}}}
    for name, (n, m) in shapes:
        r0, rn = chunk_range(n, world, rank)
        w = torch.randn((rn, m), generator=g) * 0.02

        def sh(t):
            return unickpt.shard(t, (n, m), offsets=(r0, 0))
        src["model"][name], src["master"][name] = sh(w.bfloat16()), sh(w)
        src["optimizer"]["exp_avg"][name] = sh(torch.randn((rn, m), generator=g) * 1e-4)
        src["optimizer"]["exp_avg_sq"][name] = sh((torch.randn((rn, m), generator=g) * 1e-4).square_())
        tgt["model"][name] = sh(torch.zeros((rn, m), dtype=torch.bfloat16))
        for r in ("master",):
            tgt[r][name] = sh(torch.zeros((rn, m)))
        for k in ("exp_avg", "exp_avg_sq"):
            tgt["optimizer"][k][name] = sh(torch.zeros((rn, m)))
    return src, tgt


# -- the ranks ------------------------------------------------------------------------------------

def rank_job(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    data = cfg["data"]
    clear_dir(data, rank)
    out: dict = {"targets": {}, "throttled": {}, "table": {}, "table_throttled": {}, "floor": []}

    def one(res: dict, name: str, comp, src, tgt, i: int, cold: bool = True) -> None:
        r = res.setdefault(name, {"save": [], "load": [], "bytes": 0})
        path = os.path.join(data, f"{name}-{i}")
        opts = unickpt.SaveOptions(compression=comp)
        r["save"].append(slowest(lambda: unickpt.save(src, path, options=opts)))
        if cold:
            cold_barrier(path, rank)
        r["load"].append(slowest(lambda: unickpt.load(tgt, path)))
        if rank == 0:
            r["bytes"] = unickpt.read_manifest(path)[1].total_bytes
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    # targets: the fp32 state, local disk (ABBA with DCP), then throttled
    st, src, tgt = _fp32_state(rank, world, cfg["shapes"])
    mesh = init_device_mesh("cpu", (world,))
    d_src = st.dtensors("src", mesh)
    share = -(-st.total_bytes // world // 4096) * 4096
    buf = floor_buffer(next(iter(st.src.values())))

    def run_unickpt(i: int) -> None:
        for name, comp in TARGET_SETTINGS.items():
            one(out["targets"], name, comp, src, tgt, i)
            log(f"round {i + 1}/{cfg['repeats']} {name:<12} save {out['targets'][name]['save'][-1]:.3f} s, "
                f"load {out['targets'][name]['load'][-1]:.3f} s", rank)

    def run_dcp(i: int) -> None:
        r = out["targets"].setdefault("dcp", {"save": [], "load": [], "bytes": 0})
        path = os.path.join(data, f"dcp-{i}")
        r["save"].append(slowest(lambda: dcp.save(d_src, storage_writer=FileSystemWriter(path, sync_files=True))))
        if rank == 0:
            r["bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        log(f"round {i + 1}/{cfg['repeats']} dcp          save {r['save'][-1]:.3f} s", rank)

    for i in range(cfg["repeats"]):
        out["floor"].append(slowest(lambda: floor_write(os.path.join(data, f"floor{rank}.bin"), buf, share, True)))
        for block in abba(i, run_unickpt, run_dcp):
            block(i)
    buf.close()
    throttle(cfg["throttle"])
    try:
        for name, comp in TARGET_SETTINGS.items():
            one(out["throttled"], name, comp, src, tgt, 0, cold=False)
            log(f"throttled {name:<12} save {out['throttled'][name]['save'][-1]:.3f} s, "
                f"load {out['throttled'][name]['load'][-1]:.3f} s", rank)
    finally:
        throttle(None)
    del st, src, tgt

    # the table: the mixed-precision state, every setting, both speeds
    if cfg["table_shapes"]:
        src, tgt = _mixed_state(rank, world, cfg["table_shapes"])
        for name, comp in TABLE_SETTINGS.items():
            one(out["table"], name, comp, src, tgt, 0)
        throttle(cfg["throttle"])
        try:
            for name, comp in TABLE_SETTINGS.items():
                one(out["table_throttled"], name, comp, src, tgt, 0, cold=False)
        finally:
            throttle(None)
        log("table done", rank)
    return out


def measure(gb: float = 1.0, ranks: int = 2, repeats: int = 3, parent: str | None = None,
            timeout: float = 3000, table_gb: float = 0.5, throttle_mbps: float = THROTTLE_MBPS) -> dict:
    """Run the bench; returns {"total_bytes", "floor" (s), "settings": {name: {"save", "load"
    (medians, s), "bytes"}}, "throttled": {...}, "table": {...}, "table_throttled": {...},
    "table_params", "raw"} (bench/run_all.py calls this)."""
    _, _, shapes = model_shapes(gb)
    total = 3 * sum(math.prod(s) * 4 for _, s in shapes)
    table_shapes = model_shapes(table_gb * 12 / 14)[2] if table_gb else []  # (model_shapes counts 12 B/param)
    params = sum(math.prod(s) for _, s in table_shapes)
    data = scratch(parent or os.path.join(OUT, "data"), "compressed")
    log(f"compressed_save: {total / 1e9:.3f} GB fp32, table {params * 14 / 1e9:.3f} GB mixed precision, {ranks} ranks, "
        f"{repeats} rounds, throttle {throttle_mbps:.0f} MB/s per rank, data in {data}")
    try:
        res = run_ranks(rank_job, ranks, {"shapes": shapes, "table_shapes": table_shapes, "repeats": repeats,
                                          "data": data, "throttle": throttle_mbps}, timeout=timeout)[0]
    finally:
        rm_scratch(data)

    def med(d):
        return {k: {m: statistics.median(v[m]) for m in ("save", "load") if v[m]} | {"bytes": v["bytes"]}
                for k, v in d.items()}
    return {"total_bytes": total, "ranks": ranks, "repeats": repeats, "floor": statistics.median(res["floor"]),
            "settings": med(res["targets"]), "throttled": med(res["throttled"]), "table": med(res["table"]),
            "table_throttled": med(res["table_throttled"]), "table_params": params, "throttle_mbps": throttle_mbps,
            "raw": res}


def target_lines(out: dict) -> list[str]:
    """The issue's targets, met or missed, from a :func:`measure` result."""
    med, thr = out["settings"], out["throttled"]
    o0, t0 = med["O0"]["save"], thr["O0"]["save"]
    lines = []
    for q in ("O1", "O2"):
        lines.append(f"{q} save on the local disk {med[q]['save'] / o0:.2f}x O0 (target <= 1.00: "
                     f"{'met' if med[q]['save'] <= o0 else 'MISSED'})")
    for q, lim in (("O1", 0.55), ("O2", 0.5)):
        x = thr[q]["save"] / t0
        lines.append(f"{q} save throttled to {out['throttle_mbps']:.0f} MB/s per rank {x:.2f}x O0 (target <= {lim}: "
                     f"{'met' if x <= lim else 'MISSED'})")
    return lines


def table_rows(out: dict) -> list[list]:
    """docs/compression.md's table: bytes per parameter, save and load at both speeds."""
    t, s, n = out["table"], out["table_throttled"], out["table_params"]
    o0 = t["O0"]
    rows = []
    for k, v in t.items():
        rows.append([k, fmt(v["bytes"] / n, ".2f"), fmt(v["bytes"] / o0["bytes"], ".2f"), fmt(v["save"], ".2f"),
                     fmt(v["load"], ".2f"), fmt(s[k]["save"], ".2f"), fmt(s[k]["load"], ".2f")])
    return rows


TABLE_HEADERS = ["setting", "bytes/param", "x O0", "save s (disk)", "load s (disk, cold)", "save s (throttled)",
                 "load s (throttled)"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--table-gb", type=float, default=0.5, help="size of the mixed-precision table state (0: skip)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--throttle", type=float, default=THROTTLE_MBPS, help="MB/s per rank of the throttled storage")
    ap.add_argument("--dir", default=os.path.join(OUT, "data"))
    args = ap.parse_args()
    out = measure(args.gb, args.ranks, args.repeats, args.dir, table_gb=args.table_gb, throttle_mbps=args.throttle)
    med, floor, thr = out["settings"], out["floor"], out["throttled"]
    o0 = med["O0"]
    print(f"\nstate {out['total_bytes'] / 1e9:.2f} GB fp32 (weights, exp_avg, exp_avg_sq), {args.ranks} ranks, medians "
          f"of {args.repeats}; O_DIRECT write floor {floor:.2f} s; throttled: {args.throttle:.0f} MB/s per rank, 1 round")
    rows = []
    for k, v in med.items():
        t = thr.get(k)
        rows.append([k, fmt(v["bytes"] / 1e9), fmt(v["bytes"] / o0["bytes"], ".2f"), fmt(v["save"], ".2f"),
                     fmt(v["save"] / o0["save"], ".2f"), fmt(v["save"] / floor, ".2f"),
                     fmt(v["load"], ".2f") if "load" in v else "-",
                     fmt(v["load"] / o0["load"], ".2f") if "load" in v else "-",
                     fmt(t["save"], ".2f") if t else "-", fmt(t["save"] / thr["O0"]["save"], ".2f") if t else "-",
                     fmt(t["load"], ".2f") if t else "-"])
    print_table(["setting", "GB on disk", "x O0", "save s", "x O0", "x floor", "load s", "x O0", "throttled save s",
                 "x O0", "throttled load s"], rows)
    for line in target_lines(out):
        print(line)
    if out["table"]:
        print(f"\nmixed-precision state: {out['table_params'] / 1e6:.0f} M parameters (bf16 model, fp32 master, exp_avg, "
              "exp_avg_sq), one round")
        print_table(TABLE_HEADERS, table_rows(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
