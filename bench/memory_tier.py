"""The in-memory tier against asynchronous saves to disk and cold loads from disk, in one run.

    .venv/bin/python bench/memory_tier.py [--gb 2.0] [--repeats 3] [--dir PATH]

State: the GPT-like fp32 state of bench/save_load.py (weights + two Adam moments), Shard(0)
row blocks over 4 gloo ranks on 2 simulated nodes (``UNICKPT_NODE_ID`` n0, n0, n1, n1), one
thread per rank. Snapshots go to ``/dev/shm/unickpt-bench-*/{node}`` with ``replicas=1``
(every node holds the other's files), as ``UnifiedCheckpoint(memory_dir=...)`` takes them;
disk checkpoints to ``--dir``.

Per round (medians over ``--repeats`` of the slowest rank; after one warm-up of each kind):
  async save (disk)     blocking time of ``unickpt.save_async(...)`` to disk, and
                        its time to durable + committed: the tier's reference;
  snapshot              blocking time of a memory snapshot (``replicas=1``), its time to
                        committed on both nodes, and the bytes replicated between nodes (the
                        ``replicate`` phase's share of it);
  compute slowdown      a loop of steps (256x256 matmuls on one thread, ~``--step-seconds``
                        each) with a snapshot due after every step, taken as the trainer does
                        by default (``memory_skip_busy``: skipped while the previous one is
                        still being written), minus the same loop without snapshots; the
                        number of snapshots taken is reported;
  recovery              cold load from disk (fsync + DONTNEED), same layout and resharded
                        into Shard(1) column blocks, against loads of the newest snapshot from
                        memory, same layout and resharded.
``reference``: the fused reference pass (bench/reference.py) over the bytes each rank must
read of its node's copy of the snapshot, right after the load from memory.
Targets (issues #14, #39): snapshot blocking <= the async save's blocking; recovery from
memory <= 0.25x the cold load from disk and <= 1.3x the reference (same layout, and
resharded); with a snapshot due every step, compute slowdown <= 15% and at least half of
the due snapshots taken. ``snapshot CPU``: every rank's CPU and its writer process's
(``/proc``) from the snapshot call to its commit, per GB of state.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import unickpt  # noqa: E402
from bench import reference  # noqa: E402
from bench._common import (OUT, agree_max, barrier, cold_barrier, cpu_seconds, fmt, tree_cpu, log, median, print_table, run_ranks, scratch,  # noqa: E402
                           rm_scratch, timed, write_json)
from bench.save_load import RankState, model_shapes  # noqa: E402

NODES = ["n0", "n0", "n1", "n1"]


def _work(n: int, a: torch.Tensor) -> None:
    for _ in range(n):
        a = (a @ a).clamp_(-1, 1)


def rank_job(rank: int, world: int, cfg: dict) -> dict:
    os.environ["UNICKPT_NODE_ID"] = NODES[rank]
    torch.set_num_threads(1)
    st = RankState(rank, world, cfg["shapes"])
    src, tgt, rtgt = st.sharded("src"), st.sharded("tgt"), st.sharded("rtgt")
    mem, disk = cfg["mem"], cfg["disk"]
    res: dict = {k: [] for k in ("async_block", "async_durable", "snap_block", "snap_commit", "replicated",
                                 "replicate_s", "loop_alone", "loop_snap", "disk_load", "disk_reshard",
                                 "mem_load", "mem_reshard", "snapshots_taken", "mem_load_ref", "mem_reshard_ref",
                                 "mem_load_cpu", "mem_reshard_cpu", "mem_load_ref_cpu", "mem_reshard_ref_cpu",
                                 "mem_load_read", "mem_reshard_read", "snap_cpu")}
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    _work(20, a)
    per = (time.perf_counter() - t0) / 20
    iters = max(1, int(cfg["step_seconds"] / per))
    step = 0

    def snapshot(i: int):
        return unickpt.save_async(src, os.path.join(mem, "{node}", f"step-{i:08d}"), step=i,
                                  options=unickpt.SaveOptions(replicas=1, overwrite=True))

    # warm-ups: writer processes and staging (excluded)
    unickpt.save_async(src, os.path.join(disk, "warm")).wait()
    step += 1
    snapshot(step).wait()
    for i in range(cfg["repeats"]):
        path = os.path.join(disk, f"step-{i:08d}")
        h = None

        def call():
            nonlocal h
            h = unickpt.save_async(src, path, step=i)
        dt, _, _ = timed(call)
        res["async_block"].append(dt)
        res["async_durable"].append(timed(lambda: h.wait())[0] + dt)

        step += 1
        c0 = tree_cpu()
        dt, h2, _ = timed(lambda: snapshot(step))
        res["snap_block"].append(dt)
        res["snap_commit"].append(timed(lambda: h2.wait())[0] + dt)
        res["snap_cpu"].append(tree_cpu() - c0)  # this rank and its writer: staging, hashing, writing, replicating
        r = h2.results[0]
        res["replicated"].append(r.bytes)  # replicas=1: every stored byte travels once more
        res["replicate_s"].append(r.phases.get("replicate", 0.0))
        if rank % 2 == 0:  # each node's first rank rotates its snapshots (keep 1)
            unickpt.retain(os.path.join(mem, "{node}"), 1)
        barrier()

        # compute loop: alone, then with a snapshot after every step
        steps = cfg["loop_steps"]
        res["loop_alone"].append(timed(lambda: [_work(iters, a) for _ in range(steps)])[0])

        def loop():
            """Snapshots as the trainer takes them by default (memory_skip_busy): one due while
            the previous is still being written is skipped; the last is waited for after."""
            nonlocal step
            h, taken = None, 0
            for _ in range(steps):
                _work(iters, a)
                step += 1
                if h is not None and agree_max(0.0 if h.done() else 1.0):  # every rank skips, or none
                    continue
                if h is not None:
                    h.wait()
                    if rank % 2 == 0:  # bounded host memory: the newest snapshot only
                        unickpt.retain(os.path.join(mem, "{node}"), 1)
                h = snapshot(step)
                taken += 1
            return h, taken
        dt, (last, taken), _ = timed(loop)
        res["loop_snap"].append(dt)
        res["snapshots_taken"].append(taken)
        last.wait()
        if rank % 2 == 0:
            unickpt.retain(os.path.join(mem, "{node}"), 1)
        barrier()

        # recovery: cold loads from disk against loads from memory (same layout, resharded)
        for key, target, where in (("disk_load", tgt, path), ("disk_reshard", rtgt, path),
                                   ("mem_load", tgt, os.path.join(mem, "{node}")),
                                   ("mem_reshard", rtgt, os.path.join(mem, "{node}"))):
            if key.startswith("disk"):
                cold_barrier(path, rank)
            c0 = cpu_seconds()
            dt, r, _ = timed(lambda: unickpt.load(target, where))
            res[key].append(dt)
            if key.startswith("mem"):
                res[f"{key}_cpu"].append(cpu_seconds() - c0)
                res[f"{key}_read"].append(r.bytes_read)
                # the fused reference pass over the bytes this rank must read of its node's copy
                got = reference.run_checked(reference.plan(os.path.join(mem, NODES[rank]), target))
                res[f"{key}_ref"].append(got["s"])
                res[f"{key}_ref_cpu"].append(got["cpu_s"])
        if i == 0:
            res["bad"] = sum(not torch.equal(st.src[k], st.tgt[k]) for k in st.src)
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        log(f"round {i + 1}: snapshot blocking {res['snap_block'][-1]:.3f} s, async {res['async_block'][-1]:.3f} s; "
            f"recovery memory {res['mem_load'][-1]:.3f} s vs disk {res['disk_load'][-1]:.3f} s", rank)
    unickpt.async_save.shutdown()
    barrier()
    return res


def measure(gb: float = 2.0, repeats: int = 3, parent: str | None = None, step_seconds: float = 0.5,
            loop_steps: int = 4) -> dict:
    hidden, layers, shapes = model_shapes(gb)
    total = 3 * sum(n * m * 4 for _, (n, m) in shapes)
    parent = os.path.abspath(parent or os.path.join(OUT, "data"))
    os.makedirs(parent, exist_ok=True)
    disk = scratch(parent, "memtier")
    mem = tempfile.mkdtemp(prefix="unickpt-bench-", dir="/dev/shm")
    cfg = {"shapes": shapes, "disk": disk, "mem": mem, "repeats": repeats, "step_seconds": step_seconds,
           "loop_steps": loop_steps}
    log(f"memory_tier: {total / 1e9:.3f} GB, 4 ranks on 2 simulated nodes, {repeats} rounds")
    try:
        out = run_ranks(rank_job, 4, cfg)
    finally:
        rm_scratch(disk)
        shutil.rmtree(mem, ignore_errors=True)

    def med(k):
        return median(max(r[k][i] for r in out) for i in range(repeats))

    s = {k: med(k) for k in out[0] if k != "bad"}
    for key in ("mem_load", "mem_reshard"):  # against the fused reference pass, CPU per GB read
        s[f"{key}_x_ref"] = median(max(r[key][i] for r in out) / max(r[f"{key}_ref"][i] for r in out) for i in range(repeats))
        s[f"{key}_cpu_per_gb"] = median(sum(r[f"{key}_cpu"][i] for r in out) / (sum(r[f"{key}_read"][i] for r in out) / 1e9)
                                        for i in range(repeats))
    # every rank's CPU (and its writer's) per snapshot, per GB of state
    s["snap_cpu_per_gb"] = median(sum(r["snap_cpu"][i] for r in out) for i in range(repeats)) / (total / 1e9)
    s["snapshots_taken"] = median(out[0]["snapshots_taken"])
    s["replicated"] = median(out[0]["replicated"])  # stored bytes (rank 0's result: every rank's is the total)
    s["slowdown"] = s["loop_snap"] - s["loop_alone"]
    s["total_bytes"] = total
    s["loop_steps"] = loop_steps
    s["bad"] = sum(r["bad"] for r in out)
    return s


def print_report(s: dict) -> None:
    rows = [
        ["async save to disk: blocking", fmt(s["async_block"]), "", "reference"],
        ["async save to disk: durable + committed", fmt(s["async_durable"]), "", ""],
        ["memory snapshot: blocking", fmt(s["snap_block"]), fmt(s["snap_block"] / s["async_block"], ".2f"),
         f"x async blocking; target <= 1.00: {'met' if s['snap_block'] <= s['async_block'] else 'MISSED'}"],
        ["memory snapshot: committed on both nodes", fmt(s["snap_commit"]), "", ""],
        ["replication: bytes to the peer node / s", f"{s['replicated'] / 1e9:.2f} GB", fmt(s["replicate_s"]),
         "s in the writers' replicate phase"],
        ["compute loop alone / with a snapshot due every step", f"{s['loop_alone']:.3f} / {s['loop_snap']:.3f}",
         fmt(s["slowdown"] / s["loop_alone"], ".2f"),
         f"slowdown, fraction of the loop; {s['snapshots_taken']:.0f} of {s['loop_steps']} steps snapshotted "
         "(the others skipped: the previous snapshot was still being written); targets <= 0.15, at least half taken: "
         + ("met" if s["slowdown"] <= 0.15 * s["loop_alone"] and 2 * s["snapshots_taken"] >= s["loop_steps"] else "MISSED")],
        ["snapshot CPU (every rank and its writer)", f"{s['snap_cpu_per_gb']:.2f}", "",
         "CPU seconds per snapshot per GB of state"],
    ]
    for key, disk, what in (("mem_load", "disk_load", "same layout"), ("mem_reshard", "disk_reshard", "resharded (Shard(1))")):
        ok = s[key] <= 0.25 * s[disk] and s[f"{key}_x_ref"] <= 1.3
        rows.append([f"recovery, {what}: disk cold / memory / reference", f"{s[disk]:.3f} / {s[key]:.3f} / {s[key + '_ref']:.3f}",
                     f"{s[key] / s[disk]:.2f} / {s[key + '_x_ref']:.2f}",
                     f"x disk / x reference; {s[key + '_cpu_per_gb']:.2f} CPU s per GB read; targets <= 0.25 / <= 1.3: "
                     f"{'met' if ok else 'MISSED'}"])
    print(f"\nmemory tier: {s['total_bytes'] / 1e9:.3f} GB fp32 state, 4 ranks on 2 simulated nodes, medians of the slowest rank")
    print_table(["operation", "s", "ratio", "note"], rows, left=1, left_last=True)
    if s["bad"]:
        print(f"FAIL: {s['bad']} tensors differ after the load")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-seconds", type=float, default=0.5)
    ap.add_argument("--dir", default=os.path.join(OUT, "data"))
    ap.add_argument("--json", default=os.path.join(OUT, "memory_tier.json"))
    a = ap.parse_args()
    s = measure(a.gb, max(1, a.repeats), a.dir, a.step_seconds)
    print_report(s)
    write_json(a.json, s)
    return 1 if s["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
