"""Asynchronous save of unickpt against the machine's floors and DCP's async_save, in one run.

    .venv/bin/python bench/async_save.py [--gb 2.0] [--ranks 2] [--repeats 3] [--dir PATH]

State: the synthetic GPT-like fp32 state of bench/save_load.py (weights + Adam ``exp_avg`` +
``exp_avg_sq``), split over ``--ranks`` gloo processes as Shard(0) row blocks; one thread per
rank (``torch.set_num_threads(1)``). unickpt gets ``unickpt.shard`` pieces, DCP the same
tensors as DTensors on a 1-D cpu mesh.

Every figure is the median over ``--repeats`` rounds of the *slowest rank's* time; each timed
region starts after a barrier; the rounds interleave all operations so that noise from other
work on the machine spreads over all of them, unickpt's and DCP's in ABBA order (unickpt first in
even rounds). Warm-ups, excluded from every figure: the first unickpt async save (spawns one
writer process per rank, allocates the shared-memory staging buffer; reported once, then
again with a new writer and staging made by ``unickpt.start_async_writer(state)`` before
``n_loop`` matmuls of set-up) and the first DCP async_save (spawns DCP's checkpoint process,
~11 s, and fills the stager's cache of shared-memory storages); later saves reuse both.

Floors (measured in the same run):
  memcpy        each rank copies its state into an already-touched, reused buffer of the
                same size: the least a save that copies the state can block.
  write direct  each rank writes its share (state bytes / ranks) to its own file with O_DIRECT
                in 64 MiB writes + fsync (as in bench/save_load.py): the durable-write floor.

(a) Blocking: how long the training loop cannot touch its tensors.
  unickpt async       ``unickpt.save_async(...)``: the call (flatten, back-pressure
                      check, copy into the shared-memory staging buffer, command to the writer).
  unickpt background  ``background_staging=True``: the call returns at once, the copy runs in a
                      thread; the loop runs a compute phase (matmuls calibrated to ``--phase-x``
                      times the memcpy floor, default 3: the copy shares the cores with the
                      compute, and on 2 cores runs at about half its speed beside it; a phase
                      of one memcpy ended before the copy in some runs, which then measured the
                      copy, not the overlap) and calls ``h.wait_staged()`` right before the
                      simulated optimizer step. Blocking = call + wait_staged; the call alone
                      is shown too.
  dcp async           ``dcp.async_save`` with the process checkpointer and
                      ``DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=
                      True, use_async_staging=True, use_non_blocking_copy=False))`` (pinned memory
                      needs CUDA; non-blocking copy raises on CPU in torch 2.13): blocking = call +
                      ``staging_completion.result()`` right after it: DCP's best configuration.
                      If the process checkpointer fails, the thread checkpointer with the default
                      stager is used instead (the report says which).
  dcp background      the same with the compute phase between the call and the staging wait
                      (for reference: DCP's own overlapped figure).
  Ratios: "x memcpy" = blocking / memcpy floor; "x DCP" = blocking / dcp async blocking.

(b) Durable + committed: from the call until ``h.wait()`` returns (unickpt: the checkpoint is
  fsynced and renamed into place by all ranks' writers) or ``upload_completion.result()``
  (DCP, FileSystemWriter(sync_files=True), .metadata written), slowest rank; "x floor" =
  seconds / write direct seconds.

(c) Compute slowdown: a fixed loop of 256x256 matmuls on one thread per rank, calibrated to
  ~``--loop-seconds`` alone, timed alone and right after an async save call returned (the
  save then runs in the background; it is waited for after the loop). Slowdown = median loop
  time during the save - median loop time alone (slowest rank). unickpt stages in the call
  (not counted in the loop); DCP stages in its thread during the loop (its best blocking
  configuration), which is part of what it costs the loop.

Targets: unickpt async blocking <= dcp async blocking; unickpt background blocking <= 0.5x
dcp async blocking; unickpt async durable <= 1.15x write direct; unickpt slowdown <= 0.7x
DCP's. Also printed: unickpt's writer phases and, per operation, the bytes that went through
read/write calls and reached the block layer, summed over each rank and its child processes
(the writers) from /proc/PID/io. Raw numbers go to bench/out/async_save.json.
"""

from __future__ import annotations

import argparse
import contextlib
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

import unickpt  # noqa: E402
import unickpt.async_save as u_async  # noqa: E402
from bench._common import (  # noqa: E402
    OUT, abba, agree_max, clear_dir, floor_buffer, floor_write, log, rm_scratch, run_ranks, scratch,
    tree_io, write_json,
)
from bench.save_load import KINDS, chunk_range, model_shapes, nested  # noqa: E402

MATMUL = 256
# op -> the metrics it records per round (seconds)
OPS = {
    "memcpy": ("seconds",),
    "write_direct": ("seconds",),
    "unickpt_async": ("call", "staged_wait", "blocking", "durable", "copy"),
    "dcp_async": ("call", "staged_wait", "blocking", "durable"),
    "unickpt_bg": ("call", "work", "staged_wait", "blocking", "durable", "copy"),
    "dcp_bg": ("call", "work", "staged_wait", "blocking", "durable"),
    "loop_unickpt": ("call", "work", "staged_wait", "blocking", "durable"),
    "loop_alone": ("work",),
    "loop_dcp": ("call", "work", "staged_wait", "blocking", "durable"),
}
TARGETS = {"blocking": 1.0, "blocking_bg": 0.5, "durable": 1.15, "slowdown": 0.7}
# (durable_bg, the durable time with staging behind the compute phase, is printed for
# information: it runs from the call, through a compute phase sized to outlast the copy, with
# the writer sharing the cores with that compute; #13's durable target is the in-call row)


# -- helpers ---------------------------------------------------------------------------

@contextlib.contextmanager
def stderr_to(path: str):
    """Point fd 2 at ``path`` meanwhile: processes spawned inside inherit it. (DCP's checkpoint
    process logs every request at INFO on its stderr, whatever the parent's logging says.)"""
    sys.stderr.flush()
    saved, fd = os.dup(2), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


class RankState:
    """This rank's Shard(0) source blocks (random) and one touched buffer of the same size."""

    def __init__(self, rank: int, world: int, shapes) -> None:
        self.rank, self.world, self.shapes = rank, world, dict(shapes)
        g = torch.Generator().manual_seed(1234 + rank)
        self.src = {}
        for kind in KINDS:
            for name, (n, m) in shapes:
                self.src[(kind, name)] = torch.randn((chunk_range(n, world, rank)[1], m), generator=g)
        self.local_bytes = sum(t.numel() * 4 for t in self.src.values())
        self.total_bytes = 3 * sum(n * m * 4 for n, m in self.shapes.values())
        flat, self.dst, pos = torch.zeros(self.local_bytes // 4), {}, 0
        for k, t in self.src.items():
            self.dst[k] = flat[pos : pos + t.numel()].view(t.shape)
            pos += t.numel()

    def memcpy(self) -> None:
        for k, t in self.src.items():
            self.dst[k].copy_(t)

    def sharded(self) -> dict:
        """unickpt state dict: every source block at its row offset."""
        out = {}
        for (kind, name), t in self.src.items():
            shape = self.shapes[name]
            out[(kind, name)] = unickpt.shard(t, shape, offsets=(chunk_range(shape[0], self.world, self.rank)[0], 0))
        return nested(out)

    def dtensors(self, mesh) -> dict:
        """The same blocks as Shard(0) DTensors (no copy)."""
        from torch.distributed.tensor import DTensor, Shard

        out = {}
        for (kind, name), t in self.src.items():
            n, m = self.shapes[name]
            out[(kind, name)] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=(n, m), stride=(m, 1))
        return nested(out)


class Compute:
    """The simulated training compute: ``n`` single-threaded 256x256 matmuls."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.a, self.b = torch.randn(MATMUL, MATMUL, generator=g), torch.randn(MATMUL, MATMUL, generator=g)
        self.c = torch.empty(MATMUL, MATMUL)

    def run(self, n: int) -> None:
        for _ in range(n):
            torch.mm(self.a, self.b, out=self.c)


# -- the rank job ----------------------------------------------------------------------

def rank_job(rank: int, world: int, cfg: dict) -> dict:
    """Runs on every rank: state, warm-ups and calibration, then ``repeats`` rounds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    st = RankState(rank, world, cfg["shapes"])
    log(f"state built in {time.perf_counter() - t0:.1f} s ({st.local_bytes / 1e9:.2f} GB on rank 0)", rank)
    mesh = init_device_mesh("cpu", (world,))
    u_state, d_state = st.sharded(), st.dtensors(mesh)
    compute = Compute()
    data = cfg["data"]
    u_root, d_root = os.path.join(data, "unickpt"), os.path.join(data, "dcp")
    floor_file = os.path.join(data, f"floor-rank{rank}.bin")
    share = -(-st.total_bytes // world // 4096) * 4096
    buf = floor_buffer(next(iter(st.src.values())))  # page-aligned source of the O_DIRECT floor
    clear_dir(u_root, rank)
    clear_dir(d_root, rank)

    # DCP's best configuration; the thread checkpointer with the default stager if it fails
    dcp_mode = {"type": AsyncCheckpointerType.PROCESS,
                "name": "process checkpointer + DefaultStager(shm, async staging)",
                "stager": DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                       use_async_staging=True, use_non_blocking_copy=False))}

    def start(lib: str, path: str, bg: bool):
        """Start an async save; (wait_staged, wait_done) callables."""
        if lib == "unickpt":
            h = unickpt.save_async(u_state, path, step=0, background_staging=bg)
            return h.wait_staged, h.wait, h
        resp = dcp.async_save(d_state, storage_writer=FileSystemWriter(path, sync_files=True),
                              async_checkpointer_type=dcp_mode["type"], async_stager=dcp_mode["stager"])
        if isinstance(resp, AsyncSaveResponse):
            return resp.staging_completion.result, resp.upload_completion.result, None
        return (lambda: None), resp.result, None

    def async_op(lib: str, path: str, bg: bool = False, work: int = 0) -> dict:
        """Timed: call, ``work`` matmuls, wait for staging, wait until durable + committed."""
        dist.barrier()
        io0 = tree_io()
        t0 = time.perf_counter()
        staged, done, h = start(lib, path, bg)
        t1 = time.perf_counter()
        compute.run(work)
        t2 = time.perf_counter()
        staged()
        t3 = time.perf_counter()
        r = done()
        t4 = time.perf_counter()
        io1 = tree_io()
        out = {"call": t1 - t0, "work": t2 - t1, "staged_wait": t3 - t2, "blocking": (t1 - t0) + (t3 - t2),
               "durable": t4 - t0, "io": {k: io1[k] - io0[k] for k in io0}}
        if h is not None:
            out.update(copy=h.staging_seconds, handle_blocking=h.blocking_seconds, handle_total=h.total_seconds,
                       phases=r.phases, bytes=r.bytes, local_bytes=r.local_bytes)
        clear_dir(u_root if lib == "unickpt" else d_root, rank)
        return out

    # -- warm-ups (excluded) and calibration ----------------------------------------------
    for _ in range(2):
        st.memcpy()
    t = time.perf_counter()
    st.memcpy()
    copy_s = agree_max(time.perf_counter() - t)
    compute.run(20)
    t = time.perf_counter()
    compute.run(100)
    unit = agree_max((time.perf_counter() - t) / 100)
    n_phase, n_loop = max(1, round(cfg["phase_x"] * copy_s / unit)), max(1, round(cfg["loop_seconds"] / unit))
    log(f"calibrated: matmul {unit * 1e3:.2f} ms; compute phase {n_phase} matmuls (~{cfg['phase_x']:g}x memcpy "
        f"{copy_s:.3f} s), "
        f"loop {n_loop} matmuls", rank)
    # the first save, twice (each with a new writer and staging): its writer and staging made
    # by the save itself, then by start_async_writer(state) before a set-up of n_loop matmuls
    first = {"lazy": async_op("unickpt", os.path.join(u_root, "warmup"))}
    u_async.shutdown()
    t = time.perf_counter()
    unickpt.start_async_writer(u_state)
    first["start_call"] = time.perf_counter() - t
    compute.run(n_loop)
    first["early"] = async_op("unickpt", os.path.join(u_root, "warmup"))
    log(f"unickpt first saves: durable {first['lazy']['durable']:.2f} s (writer and staging made by the save), "
        f"{first['early']['durable']:.2f} s (start_async_writer(state) at set-up)", rank)
    t = time.perf_counter()
    err = None
    try:
        with stderr_to(os.path.join(data, f"dcp-process-rank{rank}.log")):  # spawns DCP's process
            async_op("dcp", os.path.join(d_root, "warmup"))
    except Exception as e:  # noqa: BLE001 -- fall back to the thread checkpointer
        err = f"{type(e).__name__}: {e}"
    if agree_max(err is not None):
        log(f"DCP process checkpointer failed ({err}); using the thread checkpointer + default stager", rank)
        dcp_mode.update(type=AsyncCheckpointerType.THREAD, name="thread checkpointer + default stager",
                        stager=DefaultStager(StagingOptions(False, False, False, False)))
        clear_dir(d_root, rank)
        async_op("dcp", os.path.join(d_root, "warmup"))
    log(f"DCP warm-up save {time.perf_counter() - t:.1f} s ({dcp_mode['name']})", rank)

    # -- rounds ---------------------------------------------------------------------------
    res: dict = {op: [] for op in OPS}
    res["meta"] = {"local_bytes": st.local_bytes, "total_bytes": st.total_bytes, "floor_share": share,
                   "matmul_s": unit, "n_phase": n_phase, "n_loop": n_loop, "calib_memcpy_s": copy_s,
                   "dcp_mode": dcp_mode["name"],
                   "first_save": {"start_call": first["start_call"],
                                  **{k: {m: first[k][m] for m in ("blocking", "durable")} for k in ("lazy", "early")}}}

    def record(op: str, out: dict) -> None:
        res[op].append(out)
        shown = " ".join(f"{k} {out[k]:.3f}" for k in OPS[op] if k in out)
        log(f"round {i + 1}/{cfg['repeats']} {op:<14} {shown} (rank 0)", rank)

    def timed(fn) -> dict:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return {"seconds": time.perf_counter() - t0}

    def run_unickpt(i: int) -> None:
        record("unickpt_async", async_op("unickpt", os.path.join(u_root, f"a-{i}")))
        record("unickpt_bg", async_op("unickpt", os.path.join(u_root, f"bg-{i}"), bg=True, work=n_phase))
        record("loop_unickpt", async_op("unickpt", os.path.join(u_root, f"loop-{i}"), work=n_loop))

    def run_dcp(i: int) -> None:
        record("dcp_async", async_op("dcp", os.path.join(d_root, f"a-{i}")))
        record("dcp_bg", async_op("dcp", os.path.join(d_root, f"bg-{i}"), work=n_phase))
        record("loop_dcp", async_op("dcp", os.path.join(d_root, f"loop-{i}"), work=n_loop))

    i = 0
    for i in range(cfg["repeats"]):
        record("memcpy", timed(st.memcpy))
        record("write_direct", {"seconds": floor_write(floor_file, buf, share, direct=True)[0]})
        os.remove(floor_file)
        dist.barrier()
        t = time.perf_counter()
        compute.run(n_loop)
        record("loop_alone", {"work": time.perf_counter() - t})
        for block in abba(i, run_unickpt, run_dcp):  # unickpt first in even rounds, DCP in odd ones
            block(i)
    dcp_mode["stager"].close()
    buf.close()
    u_async.shutdown()  # stop the writer processes before the harness ends the group
    dist.barrier()
    return res


# -- report ----------------------------------------------------------------------------

def summarize(results: list[dict], repeats: int) -> dict:
    out: dict = {}
    for op, metrics in OPS.items():
        out[op] = {}
        for m in metrics:
            if m not in results[0][op][0]:
                continue
            per_round = [max(r[op][i][m] for r in results) for i in range(repeats)]
            out[op][m] = {"median": statistics.median(per_round), "per_round_max": per_round,
                          "by_rank": [[x[m] for x in r[op]] for r in results]}
        if "io" in results[0][op][0]:
            out[op]["io_sum_over_ranks"] = {k: statistics.median(sum(r[op][i]["io"][k] for r in results)
                                                                 for i in range(repeats))
                                            for k in results[0][op][0]["io"]}
        if "phases" in results[0][op][0]:
            names = list(dict.fromkeys(p for r in results for x in r[op] for p in x["phases"]))
            out[op]["phases"] = {p: statistics.median(max(r[op][i]["phases"].get(p, 0.0) for r in results)
                                                      for i in range(repeats)) for p in names}
            out[op]["handle_blocking"] = statistics.median(max(r[op][i]["handle_blocking"] for r in results)
                                                           for i in range(repeats))
    med = lambda op, m: out[op][m]["median"]  # noqa: E731
    copy_floor, disk_floor = med("memcpy", "seconds"), med("write_direct", "seconds")
    dcp_best = med("dcp_async", "blocking")
    alone = med("loop_alone", "work")
    out["derived"] = d = {
        "memcpy_floor": copy_floor, "disk_floor": disk_floor, "dcp_best_blocking": dcp_best,
        "slowdown_unickpt": med("loop_unickpt", "work") - alone, "slowdown_dcp": med("loop_dcp", "work") - alone,
        "slowdown_per_round": {op: [a - b for a, b in zip(out[op]["work"]["per_round_max"],
                                                          out["loop_alone"]["work"]["per_round_max"])]
                               for op in ("loop_unickpt", "loop_dcp")},
    }
    d["slowdown_ratio"] = d["slowdown_unickpt"] / d["slowdown_dcp"] if d["slowdown_dcp"] > 0 else math.inf
    firsts = [r["meta"]["first_save"] for r in results]
    out["first_save"] = {"start_call": max(f["start_call"] for f in firsts),
                         **{k: {m: max(f[k][m] for f in firsts) for m in ("blocking", "durable")}
                            for k in ("lazy", "early")}}
    d["checks"] = {
        "blocking": med("unickpt_async", "blocking") / dcp_best,
        "blocking_bg": med("unickpt_bg", "blocking") / dcp_best,
        "durable": med("unickpt_async", "durable") / disk_floor,
        "durable_bg": med("unickpt_bg", "durable") / disk_floor,  # streamed staging (docs/async.md)
        "slowdown": d["slowdown_ratio"],
    }
    return out


def print_report(s: dict, cfg: dict) -> None:
    m, d, meta = cfg["model"], s["derived"], cfg["meta"]
    print(f"\nstate: {m['total_bytes'] / 1e9:.3f} GB fp32 ({m['tensors']} tensors, {m['layers']} layers, hidden "
          f"{m['hidden']}), {cfg['ranks']} ranks x {meta['local_bytes'] / 1e9:.3f} GB, Shard(0), {cfg['repeats']} "
          f"rounds, median of the slowest rank; DCP: {meta['dcp_mode']}")
    verdict = lambda key, v: f"<= {TARGETS[key]:.2f}x {'PASS' if v <= TARGETS[key] else 'MISS'}"  # noqa: E731
    med = lambda op, k: s[op][k]["median"]  # noqa: E731

    print(f"\n{'(a) blocking, s':<46}{'median':>8}{'x memcpy':>10}{'x DCP':>8}  target (vs DCP)")
    print(f"  {'memcpy floor (' + format(meta['local_bytes'] / 1e9, '.2f') + ' GB/rank, reused buffer)':<44}"
          f"{d['memcpy_floor']:>8.3f}{1:>10.2f}")
    rows = [("unickpt async: call (staging in it)", "unickpt_async", "blocking", "blocking"),
            ("  of which copy + send (staging_seconds)", "unickpt_async", "copy", None),
            ("unickpt background staging: call", "unickpt_bg", "call", None),
            ("  wait_staged after the compute phase", "unickpt_bg", "staged_wait", None),
            ("  blocking = call + wait_staged", "unickpt_bg", "blocking", "blocking_bg"),
            ("  (copy in the thread, staging_seconds)", "unickpt_bg", "copy", None),
            ("dcp async: call", "dcp_async", "call", None),
            ("  staging wait right after", "dcp_async", "staged_wait", None),
            ("  blocking = call + staging wait (DCP best)", "dcp_async", "blocking", None),
            ("dcp background: call + staging wait (info)", "dcp_bg", "blocking", None)]
    for label, op, k, key in rows:
        v = med(op, k)
        tgt = verdict(key, d["checks"][key]) if key else ""
        print(f"  {label:<44}{v:>8.3f}{v / d['memcpy_floor']:>10.2f}{v / d['dcp_best_blocking']:>8.2f}  {tgt}")
    print(f"  compute phase: {meta['n_phase']} matmuls, median {med('unickpt_bg', 'work'):.3f} s (unickpt) / "
          f"{med('dcp_bg', 'work'):.3f} s (DCP); handle.blocking_seconds: async "
          f"{s['unickpt_async']['handle_blocking']:.3f}, background {s['unickpt_bg']['handle_blocking']:.3f}")

    print(f"\n{'(b) durable + committed, s':<46}{'median':>8}{'x floor':>10}{'x DCP':>8}  target (vs floor)")
    print(f"  {'write O_DIRECT + fsync floor':<44}{d['disk_floor']:>8.3f}{1:>10.2f}")
    for label, op, key in (("unickpt async", "unickpt_async", "durable"),
                           ("unickpt background staging (info)", "unickpt_bg", None),
                           ("dcp async", "dcp_async", None), ("dcp background", "dcp_bg", None)):
        v, ref = med(op, "durable"), med("dcp_bg" if op.endswith("bg") else "dcp_async", "durable")
        tgt = verdict(key, d["checks"][key]) if key else ""
        print(f"  {label:<44}{v:>8.3f}{v / d['disk_floor']:>10.2f}{v / ref:>8.2f}  {tgt}")
    print("  unickpt writer phases (async, median of slowest rank): "
          + "; ".join(f"{p} {v:.3f}" for p, v in s["unickpt_async"]["phases"].items()))
    f = s["first_save"]
    print(f"  first save (one sample, slowest rank): writer and staging made by the save: "
          f"blocking {f['lazy']['blocking']:.3f}, durable {f['lazy']['durable']:.3f}; by start_async_writer(state) "
          f"({f['start_call']:.3f} s) before {meta['n_loop']} matmuls of set-up: blocking "
          f"{f['early']['blocking']:.3f}, durable {f['early']['durable']:.3f}")

    print(f"\n{'(c) compute loop, s':<46}{'loop':>8}{'slowdown':>10}{'durable':>9}")
    print(f"  {'alone (' + str(meta['n_loop']) + f' matmuls {MATMUL}x{MATMUL}, 1 thread/rank)':<44}"
          f"{med('loop_alone', 'work'):>8.3f}")
    for label, op, key in (("during a unickpt async save", "loop_unickpt", "slowdown_unickpt"),
                           ("during a dcp async save", "loop_dcp", "slowdown_dcp")):
        print(f"  {label:<44}{med(op, 'work'):>8.3f}{d[key]:>10.3f}{med(op, 'durable'):>9.3f}")
    print(f"  slowdown unickpt / DCP = {d['slowdown_ratio']:.2f}  {verdict('slowdown', d['checks']['slowdown'])}"
          f"   (per round: unickpt {', '.join(f'{x:.2f}' for x in d['slowdown_per_round']['loop_unickpt'])}; "
          f"DCP {', '.join(f'{x:.2f}' for x in d['slowdown_per_round']['loop_dcp'])})")

    print("\nI/O per operation, GB summed over ranks and their child processes (median over rounds; "
          "read/write = through syscalls, disk = reached the block layer):")
    print(f"  {'operation':<16}{'read':>8}{'disk rd':>9}{'write':>8}{'disk wr':>9}")
    for op in OPS:
        io = s[op].get("io_sum_over_ranks")
        if io:
            print(f"  {op:<16}{io['rchar'] / 1e9:>8.3f}{io['read_bytes'] / 1e9:>9.3f}"
                  f"{io['wchar'] / 1e9:>8.3f}{io['write_bytes'] / 1e9:>9.3f}")


def measure(gb: float = 2.0, ranks: int = 2, repeats: int = 3, loop_seconds: float = 3.0, parent: str | None = None,
            timeout: float = 1800, phase_x: float = 3.0) -> dict:
    """Run the whole bench; returns {"config", "summary", "targets", "raw"} (bench/run_all.py
    calls this). Scratch files in a new directory under ``parent`` (default bench/out/data)."""
    hidden, layers, shapes = model_shapes(gb)
    total = 3 * sum(math.prod(s) * 4 for _, s in shapes)
    parent = os.path.abspath(parent or os.path.join(OUT, "data"))
    data = scratch(parent, "async")
    cfg = {"gb": gb, "ranks": ranks, "repeats": repeats, "loop_seconds": loop_seconds, "phase_x": phase_x,
           "dir": parent, "data": data, "shapes": shapes,
           "model": {"hidden": hidden, "layers": layers, "tensors": 3 * len(shapes), "total_bytes": total},
           "torch": torch.__version__, "unickpt": unickpt.__version__, "cpus": os.cpu_count()}
    log(f"async_save: {total / 1e9:.3f} GB, {ranks} ranks, {repeats} rounds, data in {data}")
    try:
        results = run_ranks(rank_job, ranks, cfg, timeout=timeout)
    finally:
        rm_scratch(data)
    cfg["meta"] = results[0]["meta"]
    return {"config": cfg, "summary": summarize(results, repeats), "targets": TARGETS, "raw": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="total state size in GB (default 2.0)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loop-seconds", type=float, default=3.0, help="compute loop length alone (default 3)")
    ap.add_argument("--phase-x", type=float, default=3.0,
                    help="compute phase of the background-staging rounds, in memcpy floors (default 3)")
    ap.add_argument("--dir", default=os.path.join(OUT, "data"),
                    help="scratch directory for the files (default bench/out/data; keep it on the real disk)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before the rank job is killed")
    ap.add_argument("--json", default=os.path.join(OUT, "async_save.json"))
    args = ap.parse_args()
    out = measure(args.gb, args.ranks, args.repeats, args.loop_seconds, args.dir, args.timeout, args.phase_x)
    print_report(out["summary"], out["config"])
    print(f"raw numbers: {write_json(args.json, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
