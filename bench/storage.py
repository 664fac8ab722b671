"""Save/load of unickpt and DCP on local disk, memory:// and a loopback S3 server, in one run.

    .venv/bin/python bench/storage.py [--gb 2.0] [--repeats 3] [--dir PATH]

The state is the one of bench/save_load.py (imported from it, not copied): a synthetic
GPT-like fp32 state of about ``--gb`` GB (weights + Adam ``exp_avg`` + ``exp_avg_sq``, same
shapes and same random values as rank 0 of a one-rank run there), here held whole by one
process as plain tensors (no process group, ``OMP_NUM_THREADS=1``). One process only:
``memory://`` is per-process, and a single process shows what one client does against each
store.

Targets (backend / client / library), every one saved and loaded in every round:
  local  -       unickpt  unickpt.save/load on a directory under ``--dir`` (default
                          bench/out/storage-tmp; removed at the end). Durable save (fsync);
                          the load is cold (every file fsynced + POSIX_FADV_DONTNEED first,
                          bench/_common.make_cold), as in bench/save_load.py.
  local  -       dcp      torch.distributed.checkpoint with FileSystemWriter(sync_files=True)
                          / FileSystemReader, cold load likewise.
  memory fsspec  unickpt  ``memory://`` (fsspec's in-process MemoryFileSystem).
  memory fsspec  dcp      DCP's FsspecWriter(sync_files=False) / FsspecReader on the same URL.
  s3     obstore unickpt  ``s3://`` on a moto server that the bench starts on 127.0.0.1
                          (tests/s3server.py) and stops at the end; storage_options
                          {"client": "obstore"}.
  s3     s3fs    unickpt  the same with {"client": "s3fs"}.
  s3     s3fs    dcp      DCP's FsspecWriter(sync_files=False) / FsspecReader (fsspec's s3:// is
                          s3fs).
Credentials and endpoint reach every client through the environment of the tests' S3 server
(tests/s3server.offline_env: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION,
AWS_ENDPOINT_URL, cloud credential discovery off, no proxies), applied to this process once
the server is up: nothing leaves the loopback interface. torch 2.13 does not export FsspecWriter/FsspecReader
from torch.distributed.checkpoint; they are imported from
torch.distributed.checkpoint._fsspec_filesystem. DCP runs without a process group (its
single-process mode; the warning it prints about that is silenced). DCP's ``sync_files`` is
off on memory:// and s3://: its streams there have no file descriptor, and with sync_files on
it falls back to os.sync() of the whole machine (the objects are durable once written anyway);
DCP's default thread count (1) is kept.

Method: ``--repeats`` rounds; every round runs every target (the target order rotates by one
per round, so drift over the run spreads over all of them). Per target and round: save to a
new ``step-N`` path under the target's own root, load it into preallocated zeros of the same
shapes, then delete the checkpoint (outside the timing), so at most one checkpoint exists at
any time (the moto server and memory:// hold theirs in this machine's memory). Each figure is
the median of the rounds' wall-clock seconds of the one save() / load() call; GB/s = state
bytes / median seconds (the same bytes for every row, so every ratio is a ratio of times).
Loaded data are checked once (round 1, outside the timing): every tensor bit-equal to the
saved one, for every target.

Columns: "x local" = seconds / seconds of local-disk unickpt for the same operation (> 1:
slower than unickpt on the local disk); "x DCP" = unickpt seconds / DCP seconds on the same
backend (s3: both unickpt clients against DCP over s3fs; < 1: unickpt is faster). "cpu" =
this process's CPU seconds during the operation (all threads), "srv cpu" = the moto server's
(its own process), medians over rounds.

Caveats:
  * moto is a Python server (one process, threads under the GIL): its throughput, not the
    client's, bounds the s3 figures; "srv cpu" close to the wall time shows it. The s3 rows
    compare clients against one slow server; they are not what either client reaches on a
    real object store, where many connections to many servers carry the data.
  * Loopback only: no network latency or bandwidth limit, no throttling, no TLS.
  * moto keeps every object above about 5 MiB in a spooled temporary file (under /tmp: the page
    cache, possibly the disk), so its "memory" is partly the local file system.
  * One process on a machine with few cores: client, server and (for memory://) the "store"
    share the same cores; the client's and the server's CPU time compete.
  * moto answers a ranged GET by reading the whole object out of its buffer and slicing it
    (moto/s3/responses.py _handle_range_header; FakeKey.value), so one ranged GET costs time
    in proportion to the object's size, not the range's: a client that reads an object of N
    bytes in ranges of C bytes makes moto move about N^2 / C bytes. The s3 load times grow
    quadratically with object size and measure this artefact more than the client (real
    S3 serves a range in time proportional to the range). The "requests" printed per s3
    operation (from the server's request log) show how many ranged GETs each client made.
  * A "POST 500" among the requests is moto failing a repeated CompleteMultipartUpload of a
    large object (KeyError on the upload id, which the first, slow, completion already
    removed); the client's retry gets 200 and the object is complete (the data check passes).
  * memory:// loads and s3 loads are warm (the data are in memory or in moto's page cache);
    the local loads are cold, so "x local" for loads compares against a disk read.
Raw numbers (per round, with unickpt's phases, CPU times and the server's RSS) go to
bench/out/storage.json.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import shutil
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import unickpt  # noqa: E402
from bench._common import OUT, fmt, log, make_cold, print_table, write_json  # noqa: E402
from bench.save_load import KINDS, model_shapes, nested  # noqa: E402
from tests.s3server import S3Server, apply_env  # noqa: E402

# (backend, client, library)
TARGETS = (
    ("local", "-", "unickpt"), ("local", "-", "dcp"),
    ("memory", "fsspec", "unickpt"), ("memory", "fsspec", "dcp"),
    ("s3", "obstore", "unickpt"), ("s3", "s3fs", "unickpt"), ("s3", "s3fs", "dcp"),
)
OPS = ("save", "load")
BUCKET = "unickpt-bench"


def key(t: tuple) -> str:
    return "/".join(t)


# -- the state (bench/save_load.py's shapes and values, whole, one process) --------------

def build_state(shapes) -> tuple[dict, dict]:
    """({(kind, name): random source}, {(kind, name): zeros}) in save_load.RankState's order
    and seed for rank 0 of 1, without its resharding targets."""
    g = torch.Generator().manual_seed(1234)
    src, tgt = {}, {}
    for kind in KINDS:
        for name, shape in shapes:
            src[(kind, name)] = torch.randn(shape, generator=g)
            tgt[(kind, name)] = torch.zeros(shape)
    return src, tgt


def mismatches(src: dict, tgt: dict) -> int:
    return sum(not torch.equal(src[k], tgt[k]) for k in src)


# -- measurement helpers ---------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads); 0 if none."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except OSError:
        return 0.0


def proc_rss(pid: int | None) -> int:
    """Resident bytes of process ``pid`` (0 if none)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def timed(fn, server_pid: int | None) -> dict:
    """Wall seconds, this process's CPU seconds and the server's CPU seconds of ``fn()``."""
    s0, c0 = proc_cpu(server_pid), time.process_time()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return {"seconds": dt, "cpu": time.process_time() - c0, "srv_cpu": proc_cpu(server_pid) - s0, "out": out}


class RequestLog:
    """Counts of the requests the moto server logged (werkzeug's access log, which
    tests/s3server.py sends to ``server.log``) since the last ``take()``, by method and status."""

    LINE = re.compile(r'"([A-Z]+) \S+ HTTP/[0-9.]+" (\d{3})')
    ANSI = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self, path: str) -> None:
        self.path = path
        self.pos = os.path.getsize(path) if os.path.exists(path) else 0

    def take(self) -> dict[str, int]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return {}
        end = data.rfind(b"\n") + 1  # a partly written last line waits for the next take
        self.pos += end
        out: dict[str, int] = {}
        for m in self.LINE.finditer(self.ANSI.sub("", data[:end].decode(errors="replace"))):
            k = f"{m.group(1)} {m.group(2)}"
            out[k] = out.get(k, 0) + 1
        return dict(sorted(out.items()))


# -- one target ------------------------------------------------------------------------

class Target:
    """Save / load / delete of one (backend, client, library) under its own root."""

    def __init__(self, t: tuple, roots: dict) -> None:
        self.backend, self.client, self.lib = t
        self.name = key(t)
        self.root = roots[self.backend] + "/" + (self.lib if self.client == "-" else f"{self.lib}-{self.client}")
        self.options = {"client": self.client} if self.backend == "s3" and self.lib == "unickpt" else None

    def path(self, i: int) -> str:
        return f"{self.root}/step-{i}"

    def save(self, state: dict, path: str, step: int):
        if self.lib == "unickpt":
            return unickpt.save(state, path, step=step, options=unickpt.SaveOptions(storage_options=self.options))
        import torch.distributed.checkpoint as dcp

        if self.backend == "local":
            w = dcp.FileSystemWriter(path, sync_files=True)
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            w = FsspecWriter(path, sync_files=False)
        return dcp.save(state, storage_writer=w)

    def load(self, state: dict, path: str):
        if self.lib == "unickpt":
            return unickpt.load(state, path, options=unickpt.LoadOptions(storage_options=self.options))
        import torch.distributed.checkpoint as dcp

        if self.backend == "local":
            r = dcp.FileSystemReader(path)
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            r = FsspecReader(path)
        return dcp.load(state, storage_reader=r)

    def before_load(self, path: str) -> None:
        if self.backend == "local":
            make_cold([path])

    def delete(self, path: str) -> None:
        if self.backend == "local":
            shutil.rmtree(path, ignore_errors=True)
            return
        import fsspec

        fs = fsspec.filesystem(self.backend)
        fs.invalidate_cache()
        if fs.exists(path):
            fs.rm(path, recursive=True)
        fs.invalidate_cache()


# -- the run ---------------------------------------------------------------------------

def run(cfg: dict, src: dict, tgt: dict, server: S3Server) -> dict:
    u_src, u_tgt = nested(src), nested(tgt)
    pid = server.proc.pid if server.proc is not None else None
    reqlog = RequestLog(server.log)
    targets = [Target(t, cfg["roots"]) for t in TARGETS]
    res = {t.name: {op: [] for op in OPS} for t in targets}
    verify, server_rss = {}, []
    n = len(targets)
    for i in range(cfg["repeats"]):
        order = targets[i % n:] + targets[: i % n]
        for t in order:
            path = t.path(i)
            srv = pid if t.backend == "s3" else None
            reqlog.take()
            m = timed(lambda: t.save(u_src, path, i), srv)
            r = m.pop("out")
            if srv:
                time.sleep(0.2)  # the server logs a request after answering it
                m["requests"] = reqlog.take()
            if t.lib == "unickpt":
                m.update(bytes=r.bytes, phases=r.phases)
            res[t.name]["save"].append(m)
            server_rss.append({"round": i, "after": f"{t.name} save", "bytes": proc_rss(pid)})
            if i == 0:
                for v in tgt.values():
                    v.zero_()
            t.before_load(path)
            reqlog.take()
            m = timed(lambda: t.load(u_tgt, path), srv)
            r = m.pop("out")
            if srv:
                time.sleep(0.2)
                m["requests"] = reqlog.take()
            if t.lib == "unickpt":
                m.update(bytes_read=r.bytes_read, phases=r.phases)
            res[t.name]["load"].append(m)
            if i == 0:
                verify[t.name] = mismatches(src, tgt)
            t.delete(path)
            log(f"round {i + 1}/{cfg['repeats']} {t.name:<22} save {res[t.name]['save'][-1]['seconds']:7.3f} s, "
                f"load {res[t.name]['load'][-1]['seconds']:7.3f} s"
                + (f", {verify[t.name]} mismatches" if i == 0 and verify[t.name] else ""))
    return {"rounds": res, "verify": verify, "server_rss": server_rss}


def summarize(raw: dict, total: int) -> dict:
    out: dict = {}
    for name, ops in raw["rounds"].items():
        out[name] = {}
        for op, rounds in ops.items():
            med = statistics.median(r["seconds"] for r in rounds)
            s = {"seconds": [r["seconds"] for r in rounds], "median": med, "gbps": total / med / 1e9,
                 "cpu": statistics.median(r["cpu"] for r in rounds),
                 "srv_cpu": statistics.median(r["srv_cpu"] for r in rounds)}
            if "phases" in rounds[0]:
                names = list(dict.fromkeys(p for r in rounds for p in r["phases"]))
                s["phases"] = {p: statistics.median(r["phases"].get(p, 0.0) for r in rounds) for p in names}
            if "requests" in rounds[0]:
                names = sorted({k for r in rounds for k in r["requests"]})
                s["requests"] = {k: statistics.median(r["requests"].get(k, 0) for r in rounds) for k in names}
            out[name][op] = s
    base = out[key(("local", "-", "unickpt"))]
    for name, ops in out.items():
        backend, client, lib = name.split("/")
        dcp = out.get(key((backend, "s3fs" if backend == "s3" else client, "dcp")))
        for op, s in ops.items():
            s["x_local"] = s["median"] / base[op]["median"]
            if lib == "unickpt" and dcp is not None:
                s["x_dcp"] = s["median"] / dcp[op]["median"]
    return out


def print_report(summary: dict, cfg: dict, raw: dict) -> None:
    m = cfg["model"]
    print(f"\nstate: {m['total_bytes'] / 1e9:.3f} GB fp32 ({m['tensors']} tensors = {m['layers']} layers x 4 + "
          f"embeddings, hidden {m['hidden']}, x3 for weights + exp_avg + exp_avg_sq; bench/save_load.py's state), "
          f"1 process, {cfg['repeats']} rounds; s3 = moto on 127.0.0.1")
    rows = []
    for op in OPS:
        for t in TARGETS:
            s = summary[key(t)][op]
            rows.append([t[0], t[1], t[2], op, fmt(s["median"]), fmt(s["gbps"]), fmt(s["x_local"], ".2f"),
                         fmt(s.get("x_dcp"), ".2f"), fmt(s["cpu"], ".2f"),
                         fmt(s["srv_cpu"], ".2f") if t[0] == "s3" else ""])
    print_table(["backend", "client", "library", "op", "median s", "GB/s", "x local", "x DCP", "cpu s", "srv cpu s"],
                rows, left=4)
    print("\nunickpt phases, seconds (median over rounds):")
    for t in TARGETS:
        if t[2] != "unickpt":
            continue
        for op in OPS:
            ph = summary[key(t)][op].get("phases", {})
            print(f"  {key(t):<22}{op:<5} " + "; ".join(f"{p} {v:.3f}" for p, v in ph.items()))
    print("\ns3 requests per operation as the moto server logged them (method status: count, median over rounds):")
    for t in TARGETS:
        if t[0] != "s3":
            continue
        for op in OPS:
            rq = summary[key(t)][op].get("requests", {})
            print(f"  {key(t):<22}{op:<5} " + ", ".join(f"{k}: {v:g}" for k, v in rq.items()))
    ob, fs = summary["s3/obstore/unickpt"], summary["s3/s3fs/unickpt"]
    for op in OPS:
        a, b = ob[op]["median"], fs[op]["median"]
        faster, ratio = ("obstore", b / a) if a < b else ("s3fs", a / b)
        verdict = f"{faster} is faster" if ratio >= 1.05 else "no clear winner (within 5%)"
        print(f"s3 {op}: {verdict} ({ratio:.2f}x; obstore {a:.3f} s, s3fs {b:.3f} s)")
    rss = max((r["bytes"] for r in raw["server_rss"]), default=0)
    print(f"moto server RSS: at most {rss / 1e9:.2f} GB after a save; objects left in the bucket at the end: "
          f"{cfg['leftover_objects']}, multipart uploads left: {cfg['leftover_uploads']}")
    bad = {k: v for k, v in raw["verify"].items() if v}
    print("verification (round 1): " + ("every target's loaded data match the source" if not bad
          else f"MISMATCHES (tensors per target): {bad}"))


def bucket_leftovers(server: S3Server) -> tuple[int, int]:
    c = server.client()
    objs = c.list_objects_v2(Bucket=BUCKET).get("KeyCount", 0)
    ups = len(c.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []))
    return objs, ups


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="total state size in GB (default 2.0)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(OUT, "storage-tmp"),
                    help="parent of the local-disk checkpoints (default bench/out/storage-tmp; a temporary "
                         "directory is made in it and removed at the end)")
    ap.add_argument("--json", default=os.path.join(OUT, "storage.json"))
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up (server, files) on kill
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*process group.*")
    hidden, layers, shapes = model_shapes(args.gb)
    total = 3 * sum(n * m * 4 for _, (n, m) in shapes)
    parent = os.path.abspath(args.dir)
    made_parent = not os.path.isdir(parent)
    os.makedirs(parent, exist_ok=True)
    local = tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=parent)
    cfg = {"gb": args.gb, "repeats": args.repeats, "dir": local, "targets": [key(t) for t in TARGETS],
           "model": {"hidden": hidden, "layers": layers, "tensors": 3 * len(shapes), "total_bytes": total},
           "torch": torch.__version__, "unickpt": unickpt.__version__, "cpus": os.cpu_count()}
    log(f"{total / 1e9:.3f} GB, {args.repeats} rounds, local data in {local}")
    server = S3Server()
    try:
        t0 = time.perf_counter()
        src, tgt = build_state(shapes)
        log(f"state built in {time.perf_counter() - t0:.1f} s")
        server.start()
        apply_env(server.env)  # the tests' offline environment: every client talks to the server only
        log(f"moto S3 server on {server.endpoint} (pid {server.proc.pid})")
        bucket = server.bucket(BUCKET)
        cfg["roots"] = {"local": local, "memory": f"memory://unickpt-bench-{os.getpid()}", "s3": f"{bucket}/run-{os.getpid()}"}
        cfg["server"] = {"endpoint": server.endpoint, "moto_key_buffer": os.environ.get("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE")}
        raw = run(cfg, src, tgt, server)
        cfg["leftover_objects"], cfg["leftover_uploads"] = bucket_leftovers(server)
    finally:
        server.stop()
        if server.log and os.path.exists(server.log):
            os.remove(server.log)
        shutil.rmtree(local, ignore_errors=True)
        if made_parent and os.path.isdir(parent) and not os.listdir(parent):
            os.rmdir(parent)
    summary = summarize(raw, total)
    print_report(summary, cfg, raw)
    print(f"raw numbers: {write_json(args.json, {'config': cfg, 'summary': summary, 'raw': raw})}")
    return 1 if any(raw["verify"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
