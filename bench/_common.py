"""What the benches share: rank jobs, timing of the slowest rank, medians, cold caches, the
machine's disk floors, I/O counters, peak-memory sampling, the table printer and JSON writer.

Bench code only: nothing under ``unickpt/`` imports it. The scripts put the repository root
on ``sys.path`` and import it as ``bench._common``.
"""

from __future__ import annotations

import glob
import json
import mmap
import multiprocessing as mp
import os
import queue
import resource
import shutil
import socket
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "out")           # scratch data (git-ignored)
RESULTS = os.path.join(ROOT, "bench", "results")   # JSON of bench/run_all.py (git-ignored)
IO_CHUNK = 64 << 20
MiB = 1 << 20


# -- rank jobs -------------------------------------------------------------------------

_CTX = None


def _ctx():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "unickpt"])
        # the ranks import unickpt from this checkout (a worktree of an older commit, for an
        # A/B), not from the directory the bench was started in: the fork server's sys.path
        # starts with its working directory, so it is started from this checkout's root
        # (_worker refuses any other unickpt: an A/B that compares a tree with itself)
        from multiprocessing import forkserver

        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            forkserver.ensure_running()
        finally:
            os.chdir(cwd)
    return _CTX


def _serve():
    """The job's rendezvous, a TCP store served by this (the parent) process on a port the
    kernel gives it at bind time; the ranks are its clients."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)


def free_port() -> int:
    """A port free now (for a launcher such as torchrun that binds it itself, later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, q, env):
    import unickpt

    if not os.path.abspath(unickpt.__file__).startswith(ROOT + os.sep):
        raise RuntimeError(f"rank imported unickpt from {unickpt.__file__}, not from this checkout {ROOT}")
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, None, is_master=False)  # served by run_ranks(), the parent
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        q.put((rank, True, fn(rank, world, *args)))
    except BaseException as e:  # every failure goes to the parent with its traceback
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 1800, env: dict | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes (forkserver, torch preloaded) joined by
    a gloo group on 127.0.0.1 at a free port, one thread each; the results by rank. ``fn`` must
    be importable by name (a module-level function). A rank's exception fails the job with its
    traceback; the job is killed after ``timeout`` seconds."""
    ctx = _ctx()
    q = ctx.Queue()
    store = _serve()  # held until the job ends: no port is picked, let go and bound again by a rank
    port = store.port
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, q, env)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                if errors:
                    break
                raise TimeoutError(f"rank job timed out after {timeout:.0f} s; finished ranks {sorted(results)}")
            try:
                rank, ok, out = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and q.empty():
                    raise RuntimeError(f"a rank process died: exit codes {[p.exitcode for p in procs]}")
                continue
            if ok:
                results[rank] = out
            else:
                errors.append(f"rank {rank}: {out}")
                deadline = min(deadline, time.monotonic() + 20)  # the others may wait for it
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]


def log(msg: str, rank: int = 0) -> None:
    """A progress line on stderr (rank 0 only)."""
    if rank == 0:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- timing ----------------------------------------------------------------------------

def io_counters(pid: int | str = "self") -> dict:
    """/proc/PID/io: rchar/wchar (bytes through read/write calls, page-cache hits and sockets
    included) and read_bytes/write_bytes (bytes that reached the block layer)."""
    with open(f"/proc/{pid}/io") as f:
        kv = dict(line.split(": ") for line in f.read().splitlines())
    return {k: int(kv[k]) for k in ("rchar", "wchar", "read_bytes", "write_bytes")}


def descendants(pid: int | None = None) -> list[int]:
    """PIDs of the processes below ``pid`` (default: this one), from /proc."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid or os.getpid()]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def tree_io() -> dict:
    """io_counters summed over this process and its descendants (e.g. async writers)."""
    tot = io_counters()
    for pid in descendants():
        try:
            for k, v in io_counters(pid).items():
                tot[k] += v
        except (OSError, KeyError, ValueError):
            pass
    return tot


def tree_cpu() -> float:
    """User + system CPU seconds of this process and its live descendants (async writers),
    from /proc (threads included)."""
    tick = os.sysconf("SC_CLK_TCK")
    tot = cpu_seconds()
    for pid in descendants():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            tot += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return tot


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def agree_max(x: float) -> float:
    """The largest ``x`` over the ranks (``x`` itself without a process group)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn, io: Callable[[], dict] = io_counters):
    """(seconds, result, I/O counter deltas) of ``fn()`` on this rank, started after a barrier."""
    barrier()
    c0 = io()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    c1 = io()
    return dt, out, {k: c1[k] - c0[k] for k in c0}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (its threads included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def slowest(fn) -> float:
    """Seconds of ``fn()`` on the slowest rank (started together after a barrier)."""
    return agree_max(timed(fn)[0])


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def median_of_max(by_rank: list[list[float]]) -> float:
    """Median over rounds of the slowest rank's value: ``by_rank[rank][round]``."""
    return statistics.median(max(col) for col in zip(*by_rank))


def abba(i: int, a, b) -> tuple:
    """Round ``i``'s order of two competitors: A B, B A, A B, ... (drift spreads over both)."""
    return (a, b) if i % 2 == 0 else (b, a)


# -- files: cold caches, scratch directories ------------------------------------------

def make_cold(paths: Iterable[str]) -> None:
    """fsync + posix_fadvise(DONTNEED) every file under ``paths`` (files or directories)."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += [os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs]
        elif os.path.exists(p):
            files.append(p)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_barrier(path: str, rank: int) -> None:
    """Rank 0 makes every file of a checkpoint cold, then everyone proceeds together."""
    if rank == 0:
        make_cold([path])
    barrier()


def clear_dir(path: str, rank: int) -> None:
    """Rank 0 empties (creates) ``path``; then a barrier."""
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
    barrier()


def scratch(parent: str, prefix: str) -> str:
    """A new directory ``parent/prefix-PID`` for one run's files (remove it with rm_scratch)."""
    d = os.path.join(os.path.abspath(parent), f"{prefix}-{os.getpid()}")
    os.makedirs(d)
    return d


def rm_scratch(path: str) -> None:
    """Remove a run's directory, and its parent if that is left empty."""
    shutil.rmtree(path, ignore_errors=True)
    parent = os.path.dirname(path)
    if os.path.isdir(parent) and not os.listdir(parent):
        os.rmdir(parent)


def my_segments() -> list[str]:
    """Shared-memory staging segments of unickpt owned by this process (for clean-up checks)."""
    return glob.glob(f"/dev/shm/unickpt-*-{os.getpid()}-*")  # (unickpt.shm.new_name: unickpt-KIND-PID-TOKEN)


# -- floors: what the machine does without a checkpoint library ------------------------

def floor_buffer(src) -> mmap.mmap:
    """A page-aligned IO_CHUNK buffer (O_DIRECT needs one) filled with real bytes of tensor ``src``."""
    import torch

    buf = mmap.mmap(-1, IO_CHUNK)
    flat = src.reshape(-1).view(torch.uint8)
    n = min(IO_CHUNK, flat.numel())
    buf[:n] = flat[:n].numpy().tobytes()
    return buf


def floor_write(path: str, buf: mmap.mmap, share: int, direct: bool):
    """timed(): write ``share`` bytes to a new ``path`` in 64 MiB writes (O_DIRECT or through
    the page cache), then fsync."""
    if os.path.exists(path):
        os.remove(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    view = memoryview(buf)

    def write():
        fd = os.open(path, flags, 0o644)
        try:
            off = 0
            while off < share:
                off += os.pwrite(fd, view[: min(IO_CHUNK, share - off)], off)
            os.fsync(fd)
        finally:
            os.close(fd)
    return timed(write)


def floor_read(path: str, buf: mmap.mmap, cold: bool = True):
    """timed(): read ``path`` in 64 MiB preads into ``buf`` (reused); cold = after fsync +
    DONTNEED, warm = whatever the page cache holds (read it once before for a warm figure)."""
    if cold:
        make_cold([path])
    view = memoryview(buf)
    size = os.path.getsize(path)
    return timed(lambda: _read_range(path, 0, size, view))


def _read_range(path: str, a: int, b: int, view: memoryview) -> None:
    """Bytes ``[a, b)`` of ``path``, front to back, in IO_CHUNK preads into ``view`` (reused)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        while a < b:
            k = os.preadv(fd, [view[: min(IO_CHUNK, b - a)]], a)
            if k <= 0:
                raise OSError(f"{path}: short read at {a}")
            a += k
    finally:
        os.close(fd)


def files_floor(root: str, rank: int, world: int, buf: mmap.mmap):
    """timed(): the plain cold read of a checkpoint's own files, the floor of loading it: every
    file under ``root`` (sorted by path) in one sequence, cut into ``world`` equal contiguous
    shares; this rank reads share ``rank`` front to back in IO_CHUNK preads into ``buf``
    (reused). Rank 0 makes the files cold first (fsync + DONTNEED), then a barrier.

    Why not only the floor file (:func:`floor_read`): here a file written just before reads
    cold in 0.55-0.85x the time of the checkpoint's files read the same way in the same minute
    (docs/performance.md): this is the reference a load of those files is compared with."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    sizes = [os.path.getsize(f) for f in files]
    cold_barrier(root, rank)
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    view = memoryview(buf)

    def read():
        pos = 0
        for f, n in zip(files, sizes):
            a, b = max(lo, pos) - pos, min(hi, pos + n) - pos
            pos += n
            if a < b:
                _read_range(f, a, b, view)
    return timed(read)


# -- memory ------------------------------------------------------------------------------

def _status(pid: int | str) -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of a process, in bytes (missing: 0)."""
    out = dict.fromkeys(("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"), 0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in out:
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _reset_hwm(pid: int | str) -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/PID/clear_refs``) where allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident memory of this process and of its descendants while a block runs.

    Two ways, the larger wins: a thread samples /proc/PID/status every ``interval`` s, and
    VmHWM, reset with clear_refs at the start where the kernel allows it (catches peaks between
    samples). ``self.peak`` = this process's peak RSS; ``self.children`` = {pid: peak RSS}
    (sampled processes only: those alive at the start or appearing while it runs); ``before``
    / ``child_before`` the RSS at the start (``child_before_private``: RssAnon + RssFile, i.e.
    without shared memory already mapped)."""

    def __init__(self, interval: float = 0.005, children: bool = True) -> None:
        self.interval, self.watch_children = interval, children
        self.children: dict[int, int] = {}
        self.child_before: dict[int, int] = {}
        self.child_before_private: dict[int, int] = {}
        self.child_shm: dict[int, int] = {}

    def _kids(self) -> list[int]:
        return descendants() if self.watch_children else []

    def __enter__(self) -> "PeakRSS":
        kids = self._kids()
        for pid in kids:
            s = _status(pid)
            self.child_before[pid] = s["VmRSS"]
            self.child_before_private[pid] = s["RssAnon"] + s["RssFile"]
        self.hwm_self = _reset_hwm("self")
        self.hwm_kids = {pid: _reset_hwm(pid) for pid in kids}
        self.before = _status("self")["VmRSS"]
        self.peak = self.before
        self._stop = threading.Event()
        self._n = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self, kids: list[int]) -> None:
        self.peak = max(self.peak, _status("self")["VmRSS"])
        for pid in kids:
            s = _status(pid)
            self.children[pid] = max(self.children.get(pid, 0), s["VmRSS"])
            self.child_shm[pid] = max(self.child_shm.get(pid, 0), s["RssShmem"])
        self._n += 1

    def _run(self) -> None:
        kids, t = self._kids(), time.monotonic()
        while not self._stop.wait(self.interval):
            if time.monotonic() - t > 0.5:  # pick up processes started meanwhile
                kids, t = self._kids(), time.monotonic()
            self._sample(kids)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        kids = list(self.children) or self._kids()
        self._sample(kids)
        if self.hwm_self:
            self.peak = max(self.peak, _status("self")["VmHWM"])
        for pid in kids:
            if self.hwm_kids.get(pid):
                self.children[pid] = max(self.children.get(pid, 0), _status(pid)["VmHWM"])
        self.samples = self._n

    @property
    def extra(self) -> int:
        """Peak RSS of this process above its RSS at the start."""
        return self.peak - self.before


# -- reports -----------------------------------------------------------------------------

def fmt(x, spec: str = ".3f") -> str:
    """A number for a table cell ('' for None)."""
    if x is None or x == "":
        return ""
    if isinstance(x, str):
        return x
    return format(x, spec)


def print_table(headers: list[str], rows: list[list], file=None, left: int = 1, left_last: bool = False) -> None:
    """A plain-text table, the first ``left`` columns (and the last one with ``left_last``)
    left-aligned, the others right-aligned; cells are printed as given (format numbers with
    fmt() first). A row of one cell is a section title."""
    rows = [[str(c) for c in r] for r in rows]
    full = [r for r in rows if len(r) > 1]
    widths = [max([len(h)] + [len(r[i]) for r in full if i < len(r)]) for i, h in enumerate(headers)]

    def line(cells):
        last = len(widths) - 1 if left_last else -1
        parts = [(c.ljust(w) if i < left or i == last else c.rjust(w)) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    out = file or sys.stdout
    print(line(headers), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print(r[0] if len(r) == 1 else line(r + [""] * (len(headers) - len(r))), file=out)


def write_json(path: str, obj: Any) -> str:
    """Write ``obj`` as JSON to ``path`` (directories created); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    return path


def machine() -> dict:
    """What the figures were measured on."""
    import torch

    import unickpt

    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "loadavg_at_start": load, "torch": torch.__version__,
            "unickpt": unickpt.__version__, "python": sys.version.split()[0], "host": os.uname().nodename,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
