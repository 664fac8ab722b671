"""Bounded memory, measured: peak extra resident memory per rank during save, async save, load,
export and offline reshard, against the bounds of issue #13; non-zero exit when one is exceeded.

    .venv/bin/python bench/memory.py [--gb 0.5] [--ranks 2] [--repeats 2] [--dir PATH]

State: bench/save_load.py's GPT-like fp32 state, Shard(0) row blocks over ``--ranks`` gloo
processes (one thread each). Peaks: bench/_common.PeakRSS: a thread samples /proc/PID/status
every 5 ms (this rank and its descendants, i.e. its async writer), and VmHWM, reset at the start
with ``echo 5 > /proc/PID/clear_refs`` where the kernel allows it, catches what falls between
samples; the larger counts. "extra" = peak RSS - RSS right before the call; each figure is the
largest over ``--repeats`` calls and over the ranks.

  sync save     unickpt.save(state, path), the state already resident.
                bound: extra <= 256 MiB.
  async save    unickpt.save_async(...) until h.wait(): the trainer (rank process)
                and its writer process. The trainer's first async save (it creates the
                shared-memory staging segment and starts the writer) and a later one are
                measured. Writer: extra = its peak RSS - its RSS before the save without shared
                memory (RssAnon + RssFile: interpreter, torch, libraries), so the staging pages it
                maps count as extra; measured on the saves after the first (the writer starts
                inside the first). bound: extra <= staging segment size + 256 MiB, each process.
  load          cold, into targets allocated with torch.empty right before (untouched): the
                load touches them. RSS is taken before they are allocated.
                bound: extra <= target bytes + 256 MiB.
  export        unickpt.export.export_hf (bf16) of a checkpoint of the state, one process
                (a 1-rank job), cold. bound: extra <= largest tensor + 256 MiB.
  reshard       unickpt.offline.reshard_offline(quant="O1") of the same checkpoint, one process,
                cold. bound: extra <= largest tensor + 256 MiB.

RSS counts resident pages of the process: its private memory, file pages it maps, shared
memory it touched; not the page cache of files it reads or writes with read/write calls.
``measure()`` is what bench/run_all.py calls.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import shutil
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import unickpt  # noqa: E402
from bench._common import (  # noqa: E402
    MiB, OUT, PeakRSS, _status, clear_dir, cold_barrier, log, make_cold, print_table, rm_scratch, run_ranks,
    scratch, write_json,
)
from bench.save_load import KINDS, chunk_range, model_shapes, nested  # noqa: E402

SLACK = 256 * MiB


def _state(rank: int, world: int, shapes) -> dict:
    """This rank's row blocks; moments shaped like Adam's (exp_avg_sq >= 0, so O1 can encode it)."""
    g = torch.Generator().manual_seed(1234 + rank)
    out = {(kind, name): torch.randn((chunk_range(n, world, rank)[1], m), generator=g)
           for kind in KINDS for name, (n, m) in shapes}
    for (kind, _), t in out.items():
        if kind == "exp_avg":
            t.mul_(1e-3)
        elif kind == "exp_avg_sq":
            t.abs_().mul_(1e-6)
    return out


def _sharded(flat: dict, world: int, rank: int, shapes: dict) -> dict:
    return nested({k: unickpt.shard(t, shapes[k[1]], offsets=(chunk_range(shapes[k[1]][0], world, rank)[0], 0))
                   for k, t in flat.items()})


def rank_job(rank: int, world: int, cfg: dict) -> dict:
    """Every rank: sync saves, cold loads, async saves; peaks per call."""
    import unickpt.async_save as u_async

    torch.set_num_threads(1)
    shapes = dict(cfg["shapes"])
    src = _state(rank, world, cfg["shapes"])
    state = _sharded(src, world, rank, shapes)
    local = sum(t.numel() * 4 for t in src.values())
    data = cfg["data"]
    clear_dir(data, rank)
    out: dict = {"local_bytes": local, "sync_save": [], "load": [], "async_trainer": [], "async_writer": [],
                 "staging": 0, "hwm_reset": None, "samples": []}

    for i in range(cfg["repeats"]):
        path = os.path.join(data, f"sync-{i}")
        dist.barrier()
        with PeakRSS(children=False) as m:
            unickpt.save(state, path, step=i)
        out["sync_save"].append(m.extra)
        out["hwm_reset"] = m.hwm_self
        out["samples"].append(m.samples)
        # load into fresh, untouched targets
        cold_barrier(path, rank)
        before = _status("self")["VmRSS"]
        with PeakRSS(children=False) as m:
            tflat = {k: torch.empty_like(t) for k, t in src.items()}
            unickpt.load(_sharded(tflat, world, rank, shapes), path)
        out["load"].append(m.peak - before)
        bad = sum(not torch.equal(tflat[k], src[k]) for k in src)
        out["load_mismatches"] = bad
        del tflat
        log(f"memory round {i + 1}: sync save +{out['sync_save'][-1] / MiB:.0f} MiB, load "
            f"+{out['load'][-1] / MiB:.0f} MiB (rank 0)", rank)
        last = i == cfg["repeats"] - 1  # the last checkpoint is kept for export / reshard
        dist.barrier()
        if rank == 0 and not last:
            shutil.rmtree(path)
        out["kept"] = path
        dist.barrier()

    for i in range(cfg["repeats"] + 1):
        path = os.path.join(data, f"async-{i}")
        dist.barrier()
        with PeakRSS(children=True) as m:
            h = unickpt.save_async(state, path, step=i)
            h.wait()
        segs = glob.glob(f"/dev/shm/unickpt-stage-{os.getpid()}-*")
        out["staging"] = max([out["staging"]] + [os.path.getsize(s) for s in segs])
        out["async_trainer"].append(m.extra)
        if i > 0:  # the writer existed before this save: extra over its private RSS at the start
            w = [m.children[p] - m.child_before_private[p] for p in m.children if p in m.child_before_private]
            out["async_writer"].append(max(w) if w else None)
            out["writer_peak_rss"] = max(m.children.values()) if m.children else None
            out["writer_shm"] = max(m.child_shm.values()) if m.child_shm else None
        wr = "(started in it)" if i == 0 else f"+{(out['async_writer'][-1] or 0) / MiB:.0f} MiB"
        log(f"memory async save {i + 1}: trainer +{m.extra / MiB:.0f} MiB, writer {wr}, "
            f"staging {out['staging'] / MiB:.0f} MiB (rank 0)", rank)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    u_async.shutdown()
    out["segments_left"] = glob.glob(f"/dev/shm/unickpt-stage-{os.getpid()}-*")
    dist.barrier()
    return out


def offline_job(rank: int, world: int, cfg: dict) -> dict:
    """One process: export and offline reshard of ``cfg["ckpt"]``, each cold."""
    from unickpt.export import export_hf
    from unickpt.offline import reshard_offline

    torch.set_num_threads(1)
    out: dict = {}
    src = cfg["ckpt"]
    for name, fn in (("export", lambda dst: export_hf(src, dst, dtype=torch.bfloat16, config={"model_type": "gpt2"})),
                     ("reshard", lambda dst: reshard_offline(src, dst, quant="O1"))):
        dst = os.path.join(cfg["data"], name)
        make_cold([src])
        with PeakRSS(children=True) as m:
            fn(dst)
        out[name] = m.extra
        log(f"memory {name}: +{m.extra / MiB:.0f} MiB")
        shutil.rmtree(dst, ignore_errors=True)
    return out


def measure(gb: float = 0.5, ranks: int = 2, repeats: int = 2, parent: str | None = None,
            timeout: float = 1800) -> dict:
    """Run both jobs; returns {"rows": [{what, extra, bound, ok, note}], "ok", "raw", ...}."""
    _, _, shapes = model_shapes(gb)
    total = 3 * sum(math.prod(s) * 4 for _, s in shapes)
    largest = max(math.prod(s) * 4 for _, s in shapes)
    data = scratch(parent or os.path.join(OUT, "data"), "memory")
    log(f"memory: {total / 1e9:.3f} GB, {ranks} ranks, {repeats} rounds, data in {data}")
    try:
        res = run_ranks(rank_job, ranks, {"shapes": shapes, "repeats": repeats, "data": data, "keep": True},
                        timeout=timeout)
        off = run_ranks(offline_job, 1, {"ckpt": res[0]["kept"], "data": data}, timeout=timeout)[0]
    finally:
        rm_scratch(data)
    local = max(r["local_bytes"] for r in res)
    staging = max(r["staging"] for r in res)

    def worst(key):
        vals = [v for r in res for v in r[key] if v is not None]
        return max(vals) if vals else None

    rows = [
        {"what": "sync save, per rank", "extra": worst("sync_save"), "bound": SLACK, "note": "256 MiB"},
        {"what": "async save, trainer", "extra": worst("async_trainer"), "bound": staging + SLACK,
         "note": f"staging {staging / MiB:.0f} MiB + 256 MiB"},
        {"what": "async save, writer", "extra": worst("async_writer"), "bound": staging + SLACK,
         "note": f"staging {staging / MiB:.0f} MiB + 256 MiB"},
        {"what": "load (cold, fresh targets), per rank", "extra": worst("load"), "bound": local + SLACK,
         "note": f"target {local / MiB:.0f} MiB + 256 MiB"},
        {"what": "export_hf bf16, 1 process", "extra": off["export"], "bound": largest + SLACK,
         "note": f"largest tensor {largest / MiB:.0f} MiB + 256 MiB"},
        {"what": "reshard_offline O1, 1 process", "extra": off["reshard"], "bound": largest + SLACK,
         "note": f"largest tensor {largest / MiB:.0f} MiB + 256 MiB"},
    ]
    for r in rows:
        r["ok"] = r["extra"] is not None and r["extra"] <= r["bound"]
    problems = []
    if any(r.get("load_mismatches") for r in res):
        problems.append("loaded data differ from the saved state")
    left = [s for r in res for s in r["segments_left"]]
    if left:
        problems.append(f"staging segments left after shutdown: {left}")
    return {"total_bytes": total, "local_bytes": local, "staging": staging, "largest_tensor": largest,
            "rows": rows, "ok": all(r["ok"] for r in rows) and not problems, "problems": problems,
            "hwm_reset": res[0]["hwm_reset"], "raw": {"ranks": res, "offline": off}}


def fail_lines(out: dict) -> list[str]:
    """One clear line per exceeded bound or problem (empty when all is well)."""
    def shown(x):
        return "unmeasured" if x is None else f"{x / MiB:.0f} MiB"

    return ([f"MEMORY BOUND EXCEEDED: {r['what']}: peak extra {shown(r['extra'])} > bound {r['bound'] / MiB:.0f} MiB "
             f"({r['note']})" for r in out["rows"] if not r["ok"]]
            + [f"MEMORY BENCH PROBLEM: {p}" for p in out["problems"]])


def report(out: dict) -> list[str]:
    """Print the table; return the FAIL lines (empty when every bound holds)."""
    print(f"peak extra RSS (largest over calls and ranks; VmHWM reset {'on' if out['hwm_reset'] else 'unavailable'}"
          f" + 5 ms sampling), state {out['total_bytes'] / 1e9:.3f} GB")
    print_table(["operation", "peak extra MiB", "bound MiB", "", "bound is"],
                [[r["what"], "-" if r["extra"] is None else f"{r['extra'] / MiB:.0f}", f"{r['bound'] / MiB:.0f}",
                  "ok" if r["ok"] else "EXCEEDED", r["note"]] for r in out["rows"]], left_last=True)
    fails = fail_lines(out)
    for f in fails:
        print(f, file=sys.stderr)
    return fails


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=0.5, help="total state size in GB (default 0.5)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=os.path.join(OUT, "data"))
    ap.add_argument("--json", default=os.path.join(OUT, "memory.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = measure(args.gb, args.ranks, args.repeats, args.dir)
    fails = report(out)
    print(f"raw numbers: {write_json(args.json, out)} ({time.perf_counter() - t0:.0f} s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
