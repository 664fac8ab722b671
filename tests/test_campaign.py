"""Crash/fault campaign for the trust rules: a committed checkpoint is complete and loads
bit-identically; an interrupted or failed save never becomes visible, never damages the
previous checkpoint, and leaves only temporaries that a sweep removes once their owners
are dead; every rank of a failed save raises a typed error within a bounded time.

1. kill -9 of the whole job (2 real gloo ranks; sync, and async with writer processes) while
   it is parked at each fault point (``tests/faulty.py``: a storage wrapper behind the
   storage seam parks the process at the storage call that follows the point);
2. one rank dies (SIGKILL) or hangs during a 2-rank save: the others raise
   ``DistributedError`` at once, or after ``timeout_s``. No test measures how long that took:
   each shows which cause the error names (a dead peer, the timeout, a peer's own error) and,
   where a rank hangs, that the others raised while it was still held (it is released only
   after they raised); the jobs' own time limits only stop a hung test;
3. a sick disk behind the storage seam (``tests/faulty.py``): ENOSPC, EIO on write, read,
   fsync, manifest, rename; short writes; slow fsync.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import queue
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

import unickpt
from tests import dist, faulty
from unickpt.errors import AsyncSaveError, InvalidArgumentError, UnickptError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, COLS, N = 64, 48, 4


# -- states whose every byte the test can recompute -------------------------------------------


def _full(step: int, i: int, world: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + i)
    return torch.randn(ROWS * world, COLS, generator=g)


def _bias(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(33, generator=g).to(torch.bfloat16)


def _state(rank: int, world: int, step: int) -> dict:
    return {
        "model": {
            **{f"t{i}": unickpt.shard(_full(step, i, world)[ROWS * rank: ROWS * (rank + 1)].clone(), (ROWS * world, COLS),
                                      offsets=(ROWS * rank, 0)) for i in range(N)},
            "bias": _bias(step),  # replicated
        },
        "step": step,
    }


def _whole(step: int, world: int = 2) -> dict:
    """The same checkpoint content, saved by a single process."""
    return {"model": {**{f"t{i}": _full(step, i, world) for i in range(N)}, "bias": _bias(step)}, "step": step}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (dtype, shape and every byte)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8))


def _check_loads(path: str, step: int, world: int = 2) -> None:
    """Single process: the checkpoint at ``path`` holds exactly what step ``step`` saved."""
    t = {"model": {**{f"t{i}": torch.zeros(ROWS * world, COLS) for i in range(N)},
                   "bias": torch.zeros(33, dtype=torch.bfloat16)}, "step": -1}
    res = unickpt.load(t, path, verify="full")
    assert res.step == step and t["step"] == step
    for i in range(N):
        assert _same(t["model"][f"t{i}"], _full(step, i, world)), (path, i)
    assert _same(t["model"]["bias"], _bias(step))


def _load_rank(rank: int, world: int, path: str, step: int) -> bool:
    """Collective: every rank loads its shard and compares it bit for bit."""
    t = _state(rank, world, 0)
    for v in t["model"].values():
        (v.local if hasattr(v, "local") else v).zero_()
    unickpt.load(t, path, verify="full")
    want = _state(rank, world, step)
    return all(_same(getattr(t["model"][k], "local", t["model"][k]), getattr(want["model"][k], "local", want["model"][k]))
               for k in want["model"]) and t["step"] == step


def _leftovers(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".") and (".tmp-" in n or ".del-" in n or ".old-" in n))


def _committed(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-") and os.path.exists(os.path.join(root, n, "unickpt.json")))


# -- a job whose ranks may die or be killed ------------------------------------------------------


class _Job:
    """``fn(rank, world, *args)`` on ``world`` gloo processes (as tests/dist.py), which the
    test may kill; per-rank environment in ``envs``."""

    def __init__(self, fn, world: int, *args, env: dict | None = None, envs: dict | None = None) -> None:
        ctx = dist._ctx()
        self.q = ctx.Queue()
        self.store = dist.serve_store()  # the ranks' rendezvous, held while the job lives
        port = self.store.port
        self.procs = []
        for r in range(world):
            e = {k: str(v) for k, v in (env or {}).items()}
            e.update({k: str(v) for k, v in (envs or {}).get(r, {}).items()})
            self.procs.append(ctx.Process(target=dist._worker, args=(fn, r, world, port, args, self.q, e)))
        for p in self.procs:
            p.start()
        self.out: dict[int, tuple[bool, object]] = {}

    def poll(self, timeout: float = 0.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                r, ok, out = self.q.get(timeout=max(0.01, min(0.2, deadline - time.monotonic())))
                self.out[r] = (ok, out)
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return

    def results(self, timeout: float) -> dict[int, tuple[bool, object]]:
        """Reports of the ranks that reported, waiting until all did or the others are dead."""
        deadline = time.monotonic() + timeout
        while len(self.out) < len(self.procs) and time.monotonic() < deadline:
            self.poll(0.3)
            if all(p.exitcode is not None for p in self.procs):
                self.poll(0.5)
                break
        return self.out

    def failure(self) -> str | None:
        self.poll()
        bad = [f"rank {r}: {o}" for r, (ok, o) in self.out.items() if not ok]
        dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
        if bad or dead:
            return f"job failed: {bad} exit codes {[p.exitcode for p in self.procs]}"
        return None

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(timeout=10)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(cond, timeout: float, what: str, job: _Job | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if job is not None and job.failure():
            raise AssertionError(f"waiting for {what}: {job.failure()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _arm(rank: int, marks: str) -> None:
    """Every rank is past its clean save: from now on the fault point parks (collective)."""
    import torch.distributed as tdist

    tdist.barrier()
    if rank == 0:
        open(os.path.join(marks, "armed"), "w").close()
    tdist.barrier()


def _write_pids(marks: str, rank: int, writer: int | None) -> None:
    with open(os.path.join(marks, f"pids-{rank}.json"), "w") as f:
        json.dump({"rank": os.getpid(), "writer": writer}, f)


def _read_pids(marks: str, world: int = 2) -> list[dict]:
    out = []
    for r in range(world):
        with open(os.path.join(marks, f"pids-{r}.json")) as f:
            out.append(json.load(f))
    return out


def _kill_parked(job: _Job, marks: str, phase: str, parked: int) -> list[dict]:
    """Wait until ``parked`` processes sit at ``phase``, then SIGKILL every rank; for async
    saves check that the writer processes die with them (and free their staging memory)."""
    try:
        _wait_for(lambda: len(glob.glob(os.path.join(marks, f"at-{phase}-*"))) >= parked, 90, f"{phase} reached", job)
        pids = _read_pids(marks)
    finally:
        job.kill()
    writers = [p["writer"] for p in pids if p["writer"]]
    # 60 s: hang guards only (the writers die and unlink their segments within a second or so)
    _wait_for(lambda: all(_gone(w) for w in writers), 60, "the writer processes to die with their parents")
    _wait_for(lambda: not [s for p in pids for s in glob.glob(f"/dev/shm/unickpt-*-{p['rank']}-*")], 60,
              "staging segments of the killed ranks to be unlinked")
    return pids


# -- 1. kill -9 at each phase ----------------------------------------------------------------------


def _save_then_park(rank, world, root, marks, mode):
    faulty.mark_fault_points()
    from unickpt.async_save import checkpointer

    asy = mode == "async"
    h = unickpt.save(_state(rank, world, 1), os.path.join(root, "step-00000001"), step=1, async_save=asy)
    if asy:
        h.wait(timeout=120)
    _write_pids(marks, rank, checkpointer()._proc.pid if asy else None)
    _arm(rank, marks)
    h = unickpt.save(_state(rank, world, 2), os.path.join(root, "step-00000002"), step=2, async_save=asy)
    if asy:
        h.wait(timeout=300)
    time.sleep(300)  # killed before


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("phase", ["after-create", "after-data", "before-commit"])
def test_kill9_at_each_phase_keeps_the_previous_checkpoint(tmp_path, phase, mode):
    root, marks = str(tmp_path / "ck"), str(tmp_path / "marks")
    os.makedirs(marks)
    job = _Job(_save_then_park, 2, root, marks, mode,
               env={"FAULTY_PARK": f"{phase}:300", "FAULTY_MARK_DIR": marks})
    # before-commit: rank 0 (or its writer) alone commits; rank 1's waits for it in the commit's agreement
    _kill_parked(job, marks, phase, parked=1 if phase == "before-commit" else 2)

    names = os.listdir(root)
    assert "step-00000002" not in names
    tmps = [n for n in names if n.startswith(".step-00000002.tmp-")]
    assert len(tmps) == 1, names  # the interrupted save, hidden
    assert unickpt.latest(root) == os.path.join(root, "step-00000001")
    _check_loads(unickpt.latest(root), 1)
    assert sorted(os.path.basename(p) for p in unickpt.sweep(root)) == tmps  # owners are dead
    assert os.listdir(root) == ["step-00000001"]
    unickpt.save(_whole(3), os.path.join(root, "step-00000003"), step=3)  # a new save works
    assert unickpt.latest(root) == os.path.join(root, "step-00000003")
    _check_loads(unickpt.latest(root), 3)
    _check_loads(os.path.join(root, "step-00000001"), 1)


def _tiny_trainer(root, asy: bool, keep: int = 1):
    from unickpt.train import LlamaConfig, TextData, Trainer, UnifiedCheckpoint

    return Trainer(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4),
        TextData(seq_len=16, max_bytes=1 << 16),
        checkpoint=UnifiedCheckpoint(dir=root, async_save=asy, keep=keep),
        global_batch=4,
        micro_batch=2,
    )


def _dump(t, marks: str, rank: int) -> None:
    from unickpt.state import flatten

    entries, _ = flatten(t.state_dict())
    torch.save({f"{e.role}/{e.name}": e.local.detach().clone() for e in entries},
               os.path.join(marks, f"expected-{t.step}-{rank}.pt"))


def _slow_delete(marks: str) -> None:
    """Retention parks half-way through deleting the old checkpoint (after its atomic hide)."""
    import unickpt.io.local as st

    real = st.LocalStorage.remove_tree

    def remove_tree(self, path):
        if ".del-" in os.path.basename(path) and os.path.exists(os.path.join(marks, "armed")):
            files = sorted(os.listdir(path))
            for f in files[: len(files) // 2]:
                os.unlink(os.path.join(path, f))
            open(os.path.join(marks, f"at-retention-{os.getpid()}"), "w").close()
            time.sleep(300)
        real(self, path)

    st.LocalStorage.remove_tree = remove_tree


def _train_then_park_in_retention(rank, world, root, marks, mode, where):
    faulty.mark_fault_points()
    from unickpt.async_save import checkpointer

    asy = mode == "async"
    if where == "delete":
        os.environ["FAULTY_PARK"] = ""
        _slow_delete(marks)
    t = _tiny_trainer(root, asy)
    t.train_step()
    _dump(t, marks, rank)
    t.save()
    t.wait_save()
    _write_pids(marks, rank, checkpointer()._proc.pid if asy else None)
    _arm(rank, marks)
    t.train_step()
    _dump(t, marks, rank)
    t.save()
    t.wait_save()  # async: the commit is reported here, then retention runs (rank 0)
    time.sleep(300)


def _verify_trainer(rank, world, root, marks, steps, mode):
    from unickpt.state import flatten

    t = _tiny_trainer(root, mode == "async")
    same = {}
    for s in steps:
        t.load(os.path.join(root, f"step-{s:08d}"))
        want = torch.load(os.path.join(marks, f"expected-{s}-{rank}.pt"))
        got = {f"{e.role}/{e.name}": e.local for e in flatten(t.state_dict())[0]}
        same[s] = sorted(got) == sorted(want) and all(_same(got[k], want[k]) for k in want)
    t.train_step()
    t.save()  # a new save after the crash works, and so does retention (keep=1)
    t.wait_save()
    return same, t.step


@pytest.mark.parametrize("mode,where", [("sync", "point"), ("async", "point"), ("sync", "delete")])
def test_kill9_during_retention_never_leaves_half_a_checkpoint(tmp_path, mode, where):
    """keep=1: killed at the retention fault point (new one committed, old one untouched) or
    half-way through deleting the old one (hidden first: only a .del- leftover remains)."""
    root, marks = str(tmp_path / "ck"), str(tmp_path / "marks")
    os.makedirs(marks)
    job = _Job(_train_then_park_in_retention, 2, root, marks, mode, where,
               env={"FAULTY_PARK": "retention:300", "FAULTY_MARK_DIR": marks})
    _kill_parked(job, marks, "retention", parked=1)  # rank 0 manages the directory

    committed = _committed(root)
    assert unickpt.latest(root) == os.path.join(root, "step-00000002")
    if where == "point":
        assert committed == ["step-00000001", "step-00000002"] and _leftovers(root) == []
    else:
        assert committed == ["step-00000002"]
        assert [n.split(".del-")[0] for n in _leftovers(root)] == [".step-00000001"]
    # whatever is visible is whole: every step-* directory is committed
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == committed
    unickpt.sweep(root)
    assert _leftovers(root) == []
    steps = [int(n[5:]) for n in committed]
    out = dist.run(_verify_trainer, 2, root, marks, steps, mode, timeout=120)
    for same, step in out:
        assert same == {s: True for s in steps}  # bit-identical to the state at save time
        assert step == 3
    assert _committed(root) == ["step-00000003"] and _leftovers(root) == []


# -- 1b. overwrite without an atomic exchange, killed between its two renames ---------------------

_OVERWRITE = """
import os, sys
sys.path.insert(0, {root!r})
import torch, unickpt
from tests import faulty
from tests.test_campaign import _whole
faulty.mark_fault_points()
unickpt.save(_whole(2), {path!r}, step=1, overwrite=True)  # (other values, the same step: the name holds its step)
"""


@pytest.fixture(scope="module")
def interrupted_overwrite(tmp_path_factory):
    """step-00000001 committed; an overwrite of it with UNICKPT_NO_RENAMEAT2=1 killed at
    between-renames; then a sweep. Returns (root, listing at the kill, swept, listing after)."""
    base = tmp_path_factory.mktemp("overwrite")
    root, marks = str(base / "ck"), str(base / "marks")
    os.makedirs(marks)
    open(os.path.join(marks, "armed"), "w").close()
    path = os.path.join(root, "step-00000001")
    unickpt.save(_whole(1), path, step=1)
    env = dict(os.environ, UNICKPT_NO_RENAMEAT2="1", FAULTY_PARK="between-renames:300", FAULTY_MARK_DIR=marks,
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _OVERWRITE.format(root=ROOT, path=path)], env=env, cwd=ROOT)
    try:
        _wait_for(lambda: glob.glob(os.path.join(marks, "at-between-renames-*")) or proc.poll() is not None, 120,
                  "the overwrite to reach between-renames")
        assert proc.poll() is None, f"the overwrite exited with {proc.returncode} before the fault point"
    finally:
        proc.kill()
        proc.wait()
    at_kill = sorted(os.listdir(root))
    swept = unickpt.sweep(root)
    return root, at_kill, swept, sorted(os.listdir(root))


def test_overwrite_killed_between_renames_is_restored_by_sweep(interrupted_overwrite):
    root, at_kill, swept, after = interrupted_overwrite
    assert "step-00000001" not in at_kill  # moved aside, the new one not yet in place
    assert [n.split(".old-")[0] for n in at_kill if ".old-" in n] == [".step-00000001"]
    assert unickpt.latest(root) == os.path.join(root, "step-00000001")  # put back by the sweep
    _check_loads(os.path.join(root, "step-00000001"), 1)  # the old one, bit for bit
    assert not [n for n in after if ".old-" in n]
    unickpt.save(_whole(3), os.path.join(root, "step-00000003"), step=3)
    _check_loads(unickpt.latest(root), 3)


def test_overwrite_killed_between_renames_leaves_no_temporary_after_sweep(interrupted_overwrite):
    root, at_kill, swept, after = interrupted_overwrite
    assert [n for n in at_kill if ".tmp-" in n]
    assert _leftovers(root) == [], after


# -- 2. one rank dies or hangs during a multi-rank save ----------------------------------------------


def _die_mid_write(rank, world, root):
    unickpt.save(_state(rank, world, 1), os.path.join(root, "step-00000001"), step=1)
    if rank == 1:
        import unickpt.io.local as st

        real = st.LocalStorage.open_writer

        def open_writer(self, path, direct=None, size=None):
            w = real(self, path, direct=direct, size=size)
            orig = w.write_at

            def write_at(offset, data, stable=False, _n=[0]):
                _n[0] += 1
                if _n[0] == 2:  # in the middle of the bucketed exchange
                    os.kill(os.getpid(), signal.SIGKILL)
                return orig(offset, data, stable)

            w.write_at = write_at
            return w

        st.LocalStorage.open_writer = open_writer
    try:
        unickpt.save(_state(rank, world, 2), os.path.join(root, "step-00000002"), step=2, bucket_bytes=8192)
    except Exception as e:
        return type(e).__name__, str(e), sorted(os.listdir(root))
    return None


def _save_and_load(rank, world, root, step):
    unickpt.save(_state(rank, world, step), os.path.join(root, f"step-{step:08d}"), step=step)
    return _load_rank(rank, world, root, step), unickpt.latest(root)


def test_rank_killed_mid_save_fails_the_others_at_once(tmp_path):
    root = str(tmp_path)
    job = _Job(_die_mid_write, 2, root)  # default timeout (600 s): a dead peer is seen at once
    try:
        out = job.results(90)  # a hang guard only (the timeout, 600 s, is longer still)
    finally:
        job.kill()
    assert job.procs[1].exitcode == -signal.SIGKILL
    assert 0 in out, "rank 0 did not report: it waited for its dead peer (hung)"
    name, msg, listing = out[0][1]
    assert name == "DistributedError" and "died or its connection broke" in msg, msg  # typed, not gloo's RuntimeError
    assert not dist.waited_out(msg), msg  # seen as a death, not waited out as a timeout
    assert listing == ["step-00000001"]  # nothing committed, the temporary removed by rank 0
    for ok, latest in dist.run(_save_and_load, 2, root, 3, timeout=60):  # a new job saves
        assert ok and latest.endswith("step-00000003")
    _check_loads(os.path.join(root, "step-00000001"), 1)


def _hang_one_rank(rank, world, root, timeout_s):
    """Rank HANG_RANK parks at fault point HANG_AT (``NAME:SECONDS:RELEASE``) until the file
    RELEASE exists, which the other rank creates once its own save has raised: whatever the
    other rank raised, the parked rank's waking cannot have caused it. Returns (error type,
    message, whether RELEASE existed when this rank's save returned)."""
    unickpt.save(_state(rank, world, 1), os.path.join(root, "step-00000001"), step=1)
    hung = rank == int(os.environ["HANG_RANK"])
    if hung:
        faulty.mark_fault_points(writers=False)
        os.environ["FAULTY_PARK"] = os.environ["HANG_AT"]
    try:
        unickpt.save(_state(rank, world, 2), os.path.join(root, "step-00000002"), step=2, timeout_s=timeout_s)
        out = (None, "")
    except UnickptError as e:
        out = (type(e).__name__, str(e))
    except Exception as e:
        out = ("untyped " + type(e).__name__, str(e))
    released = os.path.exists(os.environ["RELEASE"])
    if not hung:
        open(os.environ["RELEASE"], "w").close()  # the parked rank goes on only now
    return (*out, released)


def _hang_env(root, rank: int, point: str, **extra) -> dict:
    """Rank ``rank`` parks at ``point`` until the other rank has raised (RELEASE), 300 s at
    most: longer than the job's own limit, so a rank that waits for the parked one (instead
    of timing out) fails the test as hung rather than passing late."""
    release = os.path.join(os.path.dirname(root), os.path.basename(root) + ".release")
    return {"HANG_RANK": str(rank), "HANG_AT": f"{point}:300:{release}", "RELEASE": release, **extra}


def test_hung_rank_fails_the_others_within_the_timeout(tmp_path):
    """Rank 1 parks after writing its data until rank 0 has raised; timeout_s=2: rank 0 gives
    up on its own (the timeout, not the peer's wake-up, nor torch's 30 minutes: rank 1 is
    released only after rank 0 raised), rank 1 fails as soon as it wakes (gloo closed the
    connections), nothing is committed."""
    root = str(tmp_path / "ck")
    os.makedirs(root)
    # timeout=90: a hang guard only (a rank 0 that waited for rank 1 would never be released)
    out = dist.run(_hang_one_rank, 2, root, 2, timeout=90, env=_hang_env(root, 1, "after-data"))
    (n0, m0, _), (n1, m1, released1) = out
    assert n0 == "DistributedError" and "did not answer within 2 s" in m0, m0  # rank 0: the timeout
    assert released1, "rank 1 went on before rank 0 had raised"
    assert n1 == "DistributedError", (n1, m1)
    assert sorted(os.listdir(root)) == ["step-00000001"]
    for ok, latest in dist.run(_save_and_load, 2, root, 3, timeout=60):
        assert ok and latest.endswith("step-00000003")


def test_hung_coordinator_at_commit_times_out_the_others_and_stays_consistent(tmp_path):
    """Rank 0 (which commits) hangs at before-commit past UNICKPT_TIMEOUT_S: rank 1 raises
    within the timeout (while rank 0 is still parked: it is released only after rank 1
    raised). Rank 0 wakes and commits a complete checkpoint (the data was durable before),
    then fails its last agreement: whatever is visible is whole."""
    root = str(tmp_path / "ck")
    os.makedirs(root)
    # timeout=90: a hang guard only
    out = dist.run(_hang_one_rank, 2, root, None, timeout=90,
                   env=_hang_env(root, 0, "before-commit", UNICKPT_TIMEOUT_S="2"))
    (n0, m0, released0), (n1, m1, _) = out
    assert n1 == "DistributedError" and "did not answer within 2 s" in m1, m1  # rank 1: the timeout
    assert released0, "rank 0 went on before rank 1 had raised"
    assert n0 == "DistributedError", (n0, m0)
    assert _leftovers(root) == []
    for name in _committed(root):
        _check_loads(os.path.join(root, name), int(name[5:]))


def _async_writer_hangs(rank, world, root, marks):
    """Rank 1's writer parks after its data until rank 0's save has raised (the file
    ``release`` in ``marks``, 300 s at most: past the job's limit). Returns (error, whether
    the release existed when this rank's save returned, the next save loads)."""
    faulty.mark_fault_points()
    import torch.distributed as tdist

    release = os.path.join(marks, "release")
    if rank == 1:  # inherited by this rank's writer process (spawned by the first save)
        os.environ["FAULTY_PARK"] = f"after-data:300:{release}"

    unickpt.save(_state(rank, world, 1), os.path.join(root, "step-00000001"), step=1, async_save=True).wait(timeout=120)
    _arm(rank, marks)
    try:
        unickpt.save(_state(rank, world, 2), os.path.join(root, "step-00000002"), step=2, async_save=True,
                     timeout_s=2).wait(timeout=120)
        err = None
    except AsyncSaveError as e:
        err = str(e)
    released = os.path.exists(release)
    if rank == 0:
        open(release, "w").close()  # rank 1's writer goes on only now
    tdist.barrier()
    if rank == 0:
        os.unlink(os.path.join(marks, "armed"))
    tdist.barrier()
    unickpt.save(_state(rank, world, 3), os.path.join(root, "step-00000003"), step=3, async_save=True).wait(timeout=120)
    return err, released, _load_rank(rank, world, root, 3)


def test_hung_async_writer_fails_every_rank_within_the_timeout(tmp_path):
    """Rank 1's writer hangs (parked until rank 0 has raised); timeout_s=2: rank 0's save
    fails naming the timeout while rank 1's writer is still parked; rank 1's fails once its
    writer wakes, not later than the hang guards."""
    root, marks = str(tmp_path / "ck"), str(tmp_path / "marks")
    os.makedirs(marks)
    # timeout=150: a hang guard only (a rank 0 that waited for the parked writer would never release it)
    out = dist.run(_async_writer_hangs, 2, root, marks, timeout=150, env={"FAULTY_MARK_DIR": marks})
    (e0, _, ok0), (e1, released1, ok1) = out
    assert e0 and "did not answer within 2 s" in e0, e0  # rank 0: the timeout, its peer's writer still parked
    # rank 1: failed once its writer was released, at the writers' next collective (gloo had
    # closed the connections), not when its wait(timeout=120) ran out
    assert e1 and released1 and "DistributedError" in e1 and "still running after" not in e1, (e1, released1)
    assert ok0 and ok1  # the writers were restarted: the next save works
    assert _committed(root) == ["step-00000001", "step-00000003"] and _leftovers(root) == []


def _async_writer_killed_after_the_rename(rank, world, root, marks):
    faulty.mark_fault_points()
    import signal

    import psutil
    import torch.distributed as tdist

    release = os.path.join(marks, "release")
    if rank == 0:  # rank 0's writer parks once it has renamed the checkpoint into place, before the
        # commit's agreement, until rank 1's writer (waiting in that agreement) is killed
        os.environ["FAULTY_PARK"] = f"after-commit:60:{release}"
    unickpt.save(_state(rank, world, 1), os.path.join(root, "step-00000001"), step=1, async_save=True).wait(timeout=120)
    _arm(rank, marks)
    final = os.path.join(root, "step-00000002")
    h = unickpt.save(_state(rank, world, 2), final, step=2, async_save=True)
    if rank == 1:
        deadline = time.monotonic() + 60  # a hang guard only
        while not (any(n.startswith("at-after-commit-") for n in os.listdir(marks))
                   and os.path.exists(os.path.join(final, "unickpt.json"))):
            assert time.monotonic() < deadline, "the writers never reached the commit"
            time.sleep(0.02)
        for c in psutil.Process().children():
            if any("_writer_main" in a for a in c.cmdline()):
                os.kill(c.pid, signal.SIGKILL)
        open(release, "w").close()  # rank 0's writer goes on: its peer is dead
    try:
        h.wait(timeout=120)
        err = None
    except AsyncSaveError as e:
        err = str(e)
    tdist.barrier()
    if rank == 0:
        os.unlink(os.path.join(marks, "armed"))
    tdist.barrier()
    return err, _load_rank(rank, world, final, 2)


def test_a_writer_killed_after_the_rename_says_the_checkpoint_is_committed(tmp_path):
    """The writer of rank 0 renamed the checkpoint into place (and parks there); rank 1's,
    waiting in the commit's last agreement, is killed. The checkpoint is complete: rank 1 (whose writer died)
    says it is committed, never that nothing was; rank 0 says the outcome is unknown."""
    root, marks = str(tmp_path / "ck"), str(tmp_path / "marks")
    os.makedirs(marks)
    out = dist.run(_async_writer_killed_after_the_rename, 2, root, marks, timeout=150,
                   env={"FAULTY_MARK_DIR": marks, "UNICKPT_TIMEOUT_S": "60"})
    (e0, ok0), (e1, ok1) = out
    assert e1 and "died" in e1 and "is committed" in e1 and "nothing was committed" not in e1, e1
    assert e0 and "outcome is unknown" in e0 and "was committed by this rank" in e0, e0
    assert ok0 and ok1 and _committed(root) == ["step-00000001", "step-00000002"]


def test_a_dead_writers_message_tells_an_overwrites_old_checkpoint_from_its_own(tmp_path, aws_offline):
    """What a rank whose writer died says of the path: nothing there; the checkpoint that was
    there before an overwrite (its manifest unchanged: not this save's); a new one."""
    from unickpt.async_save.handle import committed_now, manifest_stat

    p = str(tmp_path / "ck")
    assert "is not committed now" in committed_now(p, manifest_stat(p))
    unickpt.save(_state(0, 1, 1), p, step=1)
    before = manifest_stat(p)
    assert "still holds the checkpoint that was there before this save" in committed_now(p, before)
    unickpt.save(_state(0, 1, 2), p, step=2, overwrite=True)
    assert "is committed" in committed_now(p, before)
    assert "outcome is unknown" in committed_now("s3://bucket/ck", None)


def _async_writer_disk_full(rank, world, root):
    faulty.mark_fault_points()
    unickpt.save(_state(rank, world, 1), os.path.join(root, "step-00000001"), step=1)
    if rank == 1:  # this rank's writer process starts with a full disk
        os.environ["UNICKPT_TEST_FAULTS"] = json.dumps({"write_error": [errno.ENOSPC, 2]})
    try:
        unickpt.save(_state(rank, world, 2), os.path.join(root, "step-00000002"), step=2, async_save=True,
                     bucket_bytes=8192).wait(timeout=120)
        err = None
    except UnickptError as e:
        from unickpt.errors import AsyncSaveError, DistributedError, StorageError

        err = (type(e).__name__, str(e), isinstance(e, AsyncSaveError), isinstance(e, StorageError),
               isinstance(e, DistributedError))
    os.environ.pop("UNICKPT_TEST_FAULTS", None)
    import torch.distributed as tdist

    tdist.barrier()  # rank 0's writer (which manages the directory) has cleaned up by now
    listing = sorted(os.listdir(root))
    unickpt.save(_state(rank, world, 3), os.path.join(root, "step-00000003"), step=3, async_save=True).wait(timeout=120)
    return err, listing, _load_rank(rank, world, root, 3), _load_rank(rank, world, os.path.join(root, "step-00000001"), 1)


def test_disk_full_in_one_async_writer_fails_every_rank(tmp_path):
    """Every rank fails with rank 1's disk-full error, at once: the others learn the cause
    from rank 1 (its message), not by waiting out the timeout (600 s, past the job's limit)."""
    out = dist.run(_async_writer_disk_full, 2, str(tmp_path), timeout=150)  # a hang guard only
    for r, (err, listing, ok3, ok1) in enumerate(out):
        assert err and err[2] and "No space left on device" in err[1], err  # AsyncSaveError on every rank
        assert (r == 1) == ("StorageError" in err[1].split(":")[1]), err  # the others learn it as rank 1's
        assert err[3:] == ((True, False) if r == 1 else (False, True)), err  # and of its writer's own class
        assert not dist.waited_out(err[1]), err
        assert listing == ["step-00000001"] and ok3 and ok1


def test_timeout_setting_is_validated(monkeypatch):
    from unickpt.transport import DEFAULT_TIMEOUT_S, resolve_timeout

    monkeypatch.delenv("UNICKPT_TIMEOUT_S", raising=False)
    assert resolve_timeout() == DEFAULT_TIMEOUT_S == 600
    assert resolve_timeout(2.5) == 2.5
    monkeypatch.setenv("UNICKPT_TIMEOUT_S", "7")
    assert resolve_timeout() == 7 and resolve_timeout(3) == 3
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv("UNICKPT_TIMEOUT_S", bad)
        with pytest.raises(InvalidArgumentError, match="UNICKPT_TIMEOUT_S"):
            resolve_timeout()
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        resolve_timeout(0)


# -- 3. a sick disk behind the storage seam ------------------------------------------------------------

# name: (failing ranks, faults, operation that meets them, errno expected or None: it succeeds)
STORAGE_FAULTS = {
    "enospc-3rd-write": ([1], {"write_error": [errno.ENOSPC, 3]}, "save", errno.ENOSPC),
    "eio-write": ([0], {"write_error": [errno.EIO, 1]}, "save", errno.EIO),
    "enospc-os-pwrite": ([1], {"pwrite_error": [errno.ENOSPC, 1]}, "save", errno.ENOSPC),
    "eio-fsync": ([1], {"fsync_error": errno.EIO}, "save", errno.EIO),
    "eio-dir-fsync-at-commit": ([0], {"fsync_dir_error": errno.EIO}, "save", errno.EIO),
    "eio-manifest-write": ([0], {"manifest_error": errno.EIO}, "save", errno.EIO),
    "eio-rename-at-commit": ([0], {"rename_error": errno.EIO}, "save", errno.EIO),
    "short-writes": ([0, 1], {"short_writes": "half"}, "save", None),
    "slow-fsync": ([1], {"fsync_delay": 0.4}, "save", None),
    "eio-read": ([1], {"read_error": errno.EIO}, "load", errno.EIO),
    # a data file's blocks are reserved when it is created: a full disk fails there, before any write
    "enospc-reserving-a-file": ([1], {"reserve_error": errno.ENOSPC}, "save", errno.ENOSPC),
    # a file system that cannot reserve: the file stays sparse and the save completes
    "reserve-unsupported": ([0, 1], {"reserve_error": errno.EOPNOTSUPP}, "save", None),
}


def _storage_campaign(rank, world, base):
    import torch.distributed as tdist

    out = {}
    for name, (ranks, faults, op, _) in STORAGE_FAULTS.items():
        root = os.path.join(base, name)
        unickpt.save(_state(rank, world, 1), os.path.join(root, "step-00000001"), step=1)
        rec = {"error": None}
        f = faulty.install(faults) if rank in ranks else None
        try:
            if op == "save":
                unickpt.save(_state(rank, world, 2), os.path.join(root, "step-00000002"), step=2, bucket_bytes=8192,
                             timeout_s=30)
            else:
                rec["loaded"] = _load_rank(rank, world, root, 1)
        except Exception as e:
            rec["error"] = (type(e).__name__, getattr(e, "errno", None), str(e))
        rec["injected"] = bool(f and f.injected)
        faulty.uninstall()
        tdist.barrier()
        if rank == 0:
            rec["listing"] = sorted(os.listdir(root))
            rec["latest"] = os.path.basename(unickpt.latest(root))
            if rec["error"] is not None:
                rec["retained_away"] = unickpt.retain(root, 1)  # retention after the failure deletes nothing
        tdist.barrier()
        rec["step1_intact"] = _load_rank(rank, world, os.path.join(root, "step-00000001"), 1)
        if op == "save" and rec["error"] is None:
            rec["step2_exact"] = _load_rank(rank, world, os.path.join(root, "step-00000002"), 2)
        unickpt.save(_state(rank, world, 3), os.path.join(root, "step-00000003"), step=3)  # the disk recovered
        rec["step3_exact"] = _load_rank(rank, world, root, 3)
        out[name] = rec
    return out


@pytest.fixture(scope="module")
def storage_campaign(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("storage"))
    return base, dist.run(_storage_campaign, 2, base, timeout=150)  # a hang guard only


@pytest.mark.parametrize("name", list(STORAGE_FAULTS))
def test_storage_fault(storage_campaign, name):
    base, out = storage_campaign
    ranks, _, op, code = STORAGE_FAULTS[name]
    recs = [o[name] for o in out]
    for r, rec in enumerate(recs):
        if r in ranks and (code is not None or {"short_writes", "reserve_error"} & set(STORAGE_FAULTS[name][1])):
            assert rec["injected"], f"rank {r}: the fault was never met"
        assert rec["step1_intact"] and rec["step3_exact"], rec
    if code is None:  # completed, never silently short
        assert all(rec["error"] is None for rec in recs), recs
        assert all(rec["step2_exact"] for rec in recs)
        assert recs[0]["listing"] == ["step-00000001", "step-00000002"]
        return
    failing = ranks[0]
    name_, err_no, msg = recs[failing]["error"]
    assert name_ == "StorageError" and err_no == code, recs[failing]["error"]
    for r, rec in enumerate(recs):
        if r != failing:  # told the failing rank's error at once, not after timeout_s (30 s)
            assert rec["error"][0] == "DistributedError" and f"rank {failing}" in rec["error"][2], rec["error"]
            assert not dist.waited_out(rec["error"][2]), rec["error"]
    if op == "save":
        assert recs[0]["listing"] == ["step-00000001"]  # nothing committed, the temporary removed
        assert recs[0]["latest"] == "step-00000001" and recs[0]["retained_away"] == []
    assert sorted(os.listdir(os.path.join(base, name))) == ["step-00000001", "step-00000003"]


def _eio_on_every_read(rank, world, root):
    unickpt.save(_state(rank, world, 1), root, step=1)
    if rank == 1:
        faulty.install({"read_error": errno.EIO, "read_bytes_error": errno.EIO})
    try:
        _load_rank(rank, world, root, 1)
    except Exception as e:
        return type(e).__name__, str(e)
    return None, ""


def test_eio_on_every_read_of_one_rank_is_typed_everywhere_at_once(tmp_path):
    """Rank 0 raises rank 1's read error at once: told by rank 1 (the message names it), not
    after the timeout, which is longer than the job's own limit (a rank 0 that waited it out
    would fail the test as hung)."""
    out = dist.run(_eio_on_every_read, 2, str(tmp_path / "ck"), timeout=90, env={"UNICKPT_TIMEOUT_S": "600"})
    assert out[1][0] == "StorageError", out[1]
    assert out[0][0] == "DistributedError" and "rank 1" in out[0][1], out[0]
    assert not dist.waited_out(out[0][1]), out[0]


_ZERO_WRITE = """
import os, sys, threading, time
sys.path.insert(0, {root!r})
from tests import faulty
import unickpt.io.local as st
faulty.install({{"short_writes": "zero"}})  # (imports torch: seconds on a loaded machine)
s = st.LocalStorage()
threading.Thread(target=lambda: (time.sleep(60), os._exit(3)), daemon=True).start()  # a hang guard only
p = os.path.join({d!r}, "f")
for attempt in ("write_bytes", "write_at"):
    try:
        if attempt == "write_bytes":
            s.write_bytes(p, b"x" * 100)
        else:
            s.create_file(p, 8192)
            w = s.open_writer(p, direct=False)
            w.write_at(0, memoryview(b"y" * 8192))
            w.close()
    except OSError as e:
        print(attempt, "raised", e, flush=True)
    else:
        print(attempt, "returned", flush=True)
"""


def test_a_write_that_makes_no_progress_is_an_error_not_a_hang(tmp_path):
    r = subprocess.run([sys.executable, "-c", _ZERO_WRITE.format(root=ROOT, d=str(tmp_path))], cwd=ROOT,
                       capture_output=True, text=True, timeout=180)  # a hang guard only
    assert r.returncode == 0, f"hung (exit {r.returncode}): {r.stdout}{r.stderr[-2000:]}"
    assert "write_bytes raised" in r.stdout and "write_at raised" in r.stdout, r.stdout
