"""Trust, second round (issue #35), each class tried as an attacker would: nothing blocks
forever (FIFOs where the library opens a file by name, a commit lock held by another
process or user, an object store that accepts connections and never answers), nothing
outside its place is followed or trusted (owner records, memory directories, staging
segments), every way to pick "the newest step" checks it, and clear errors with the right
exit codes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import unickpt
from tests import dist
from tests.clirun import cli
from tests.dist import apply_env
from tests.s3server import LoopbackServer, offline_env
from unickpt import memtier, shm
from unickpt.errors import (CheckpointNotFoundError, DistributedError, FormatError, InvalidArgumentError,
                            LockTimeoutError, StorageError)

NOBODY = 65534
HANG_GUARD_S = 240  # only stops a test that hangs (the bug under test); never what a test measures
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (uid 65534)")


def _state(value: float = 1.0) -> dict:
    return {"model": {"w": torch.full((64, 64), float(value)), "b": torch.arange(16.0)}}


def _fifo(path) -> str:
    path = os.fspath(path)
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)
    return path


def _bounded(fn, *args, **kw):
    """Run ``fn`` on a thread; the test fails (instead of hanging) if it blocks."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} blocked (hang guard)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# == 1. nothing blocks forever ==================================================================


def test_a_fifo_where_the_owner_record_is_never_blocks_clean_memory_or_the_claim(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir(mode=0o700)
    _fifo(mem / memtier.OWNER_FILE)
    (mem / "step-00000001").mkdir()
    # clean-memory: the FIFO is no owner record, so the directory is refused as not a memory directory
    r = cli("clean-memory", mem, "--json", timeout=HANG_GUARD_S)
    assert r.returncode == 2 and "no memory-tier owner record" in json.loads(r.stdout)["error"]["message"], r.stdout
    # the trainer's claim: not blocked; the FIFO is replaced by a regular owner record
    shutil.rmtree(mem / "step-00000001")
    _bounded(memtier.claim, str(mem), "job-a", [os.getpid()])
    assert stat.S_ISREG(os.lstat(mem / memtier.OWNER_FILE).st_mode)
    assert memtier._owner(str(mem))["job"] == "job-a"


def test_a_fifo_given_as_export_config_or_inside_the_source_is_refused_at_once(tmp_path):
    src = tmp_path / "src"
    unickpt.save(_state(), src, extra_files={"config.json": json.dumps({"model_type": "llama"})})
    fifo = _fifo(tmp_path / "config.json")
    r = cli("export", src, tmp_path / "out", "--config", fifo, "--json", timeout=HANG_GUARD_S)
    got = json.loads(r.stdout)
    assert r.returncode == 2 and "not a regular file" in got["error"]["message"] and "FIFO" in got["error"]["message"], got
    r = cli("export", src, tmp_path / "out", "--config", tmp_path, "--json", timeout=HANG_GUARD_S)  # a directory: its config.json
    assert r.returncode == 2 and "FIFO" in json.loads(r.stdout)["error"]["message"], r.stdout
    _fifo(src / "config.json")  # the source's own config.json replaced by a FIFO
    r = cli("export", src, tmp_path / "out2", "--json", timeout=HANG_GUARD_S)
    assert r.returncode == 2 and "not a regular file" in json.loads(r.stdout)["error"]["message"], r.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_a_fifo_at_every_checkpoint_file_is_refused_at_once(tmp_path):
    """The manifest, a data file, the index and DCP's metadata, each replaced by a FIFO:
    load, read_manifest, latest and verify fail typed without blocking."""
    root = tmp_path / "root"
    unickpt.save(_state(), root / "step-00000001", step=1)
    ck = root / "step-00000001"
    for victim in sorted(n for n in os.listdir(ck) if n.endswith(".safetensors")) + ["unickpt.json"]:
        shutil.rmtree(root)
        unickpt.save(_state(), ck, step=1)
        _fifo(ck / victim)
        t = _state(0.0)
        with pytest.raises((FormatError, CheckpointNotFoundError)) as ei:
            _bounded(unickpt.load, t, ck)
        assert victim in str(ei.value) or "no committed checkpoint" in str(ei.value), ei.value
        r = cli("verify", ck, "--json", timeout=HANG_GUARD_S)
        assert r.returncode in (1, 2) and json.loads(r.stdout)["ok"] is False, r.stdout


@pytest.mark.parametrize("kind", ["tmp", "del", "old"])
def test_a_fifo_named_like_a_temporary_never_blocks_sweep_or_save_and_is_never_restored(tmp_path, kind):
    root = tmp_path / "root"
    root.mkdir()
    unickpt.save(_state(1), root / "step-00000001", step=1)
    fifo = _fifo(root / f".step-00000010.{kind}-{'ab' * 8}")
    old = time.time() - 7 * 3600  # (past every grace a sweep gives a temporary)
    os.utime(fifo, (old, old))
    _bounded(unickpt.sweep, root)
    assert not os.path.lexists(fifo) or kind == "old"
    assert not (root / "step-00000010").exists()  # a FIFO is never "restored" as a checkpoint
    _bounded(unickpt.save, _state(10), root / "step-00000010", step=10)
    assert unickpt.latest(root).endswith("step-00000010")


def test_an_aside_copy_of_another_step_is_not_restored_by_a_sweep(tmp_path):
    root = tmp_path / "root"
    unickpt.save(_state(2), root / "step-00000002", step=2)
    shutil.copytree(root / "step-00000002", root / f".step-00000009.old-{'cd' * 8}")
    unickpt.sweep(root)
    assert not (root / "step-00000009").exists() and unickpt.latest(root).endswith("step-00000002")


_HOLDER = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
    if len(sys.argv) > 2:
        os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))  # another user, keeping the descriptor
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", os.geteuid(), flush=True)
    sys.stdin.read()  # until the test closes our stdin
""")


class _LockHolder:
    """Another process (optionally running as another user) holding the commit lock (an
    flock on the directory) of ``root`` until :meth:`release`."""

    def __init__(self, root, uid: int | None = None) -> None:
        args = [sys.executable, "-c", _HOLDER, os.fspath(root)] + ([str(uid)] if uid is not None else [])
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        assert line.startswith("locked"), line
        self.uid = int(line.split()[1])

    def release(self) -> None:
        self.p.stdin.close()
        self.p.wait(HANG_GUARD_S)


@pytest.mark.parametrize("who", ["same-user", pytest.param("other-user", marks=as_root)])
def test_a_held_commit_lock_fails_save_sweep_and_retain_after_timeout_s_naming_root_and_lock(tmp_path, who):
    root = tmp_path / "root"
    root.mkdir()
    unickpt.save(_state(1), root / "step-00000001", step=1)
    unickpt.save(_state(2), root / "step-00000002", step=2)
    holder = _LockHolder(root, NOBODY if who == "other-user" else None)
    try:
        assert holder.uid == (NOBODY if who == "other-user" else os.geteuid())
        calls = [
            lambda: unickpt.save(_state(3), root / "step-00000003", step=3, timeout_s=1.0),
            lambda: unickpt.sweep(root, timeout_s=1.0),
            lambda: unickpt.retain(root, 1, timeout_s=1.0),
        ]
        for call in calls:
            with pytest.raises(LockTimeoutError) as ei:
                _bounded(call)
            assert os.fspath(root) in str(ei.value) and "commit lock" in str(ei.value), ei.value
            assert ei.value.filename == os.fspath(root)
    finally:
        holder.release()
    assert [os.path.basename(p) for _, p in unickpt.io.catalog.committed_steps(unickpt.io.local.LocalStorage(), str(root))] \
        == ["step-00000001", "step-00000002"]  # nothing committed, nothing retired while it was held
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # the failed save's temporary is gone
    unickpt.save(_state(3), root / "step-00000003", step=3, timeout_s=1.0)  # released: all work again
    assert len(unickpt.retain(root, 1, timeout_s=1.0)) == 2


def _save_under_held_lock(rank, world, root):
    try:
        unickpt.save(_state(1), os.path.join(root, "step-00000005"), step=5, timeout_s=4.0)
    except (LockTimeoutError, DistributedError) as e:
        return type(e).__name__, str(e)
    return None, ""


def test_a_held_commit_lock_fails_a_multi_rank_save_on_every_rank_with_the_lock_named(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    holder = _LockHolder(root)
    try:
        out = dist.run(_save_under_held_lock, 2, str(root), timeout=HANG_GUARD_S)
    finally:
        holder.release()
    (t0, m0), (t1, m1) = out
    assert t0 == "LockTimeoutError" and t1 == "DistributedError", out
    for m in (m0, m1):
        assert "commit lock" in m and os.fspath(root) in m, m
    assert not os.listdir(root)


class _SilentServer(LoopbackServer):
    """Accepts TCP connections on 127.0.0.1 and never answers (``trickle``: answers one byte
    of a status line every 0.2 s, for ever); counts the connections."""

    def __init__(self, trickle: bool = False) -> None:
        self.trickle = trickle
        self.conns: list[socket.socket] = []
        super().__init__()

    def handle(self, c: socket.socket) -> None:
        self.conns.append(c)
        if self.trickle:
            self._trickle(c)

    @staticmethod
    def _trickle(c: socket.socket) -> None:
        try:
            c.recv(65536)
            for b in b"HTTP/1.1 200 OK\r\n" + b"X" * 100_000:
                c.sendall(bytes([b]))
                time.sleep(0.2)
        except OSError:
            pass

    def close(self) -> None:
        super().close()
        for c in self.conns:
            c.close()


_SILENT_CALL = textwrap.dedent("""
    import json, sys, torch, unickpt
    client, what = sys.argv[1], sys.argv[2]
    so = {"client": client}
    try:
        if what == "latest":
            unickpt.latest("s3://bucket/run", storage_options=so)
        elif what == "save":
            unickpt.save({"w": torch.ones(4)}, "s3://bucket/run/step-00000001", step=1, storage_options=so)
        else:
            unickpt.load({"w": torch.ones(4)}, "s3://bucket/run/step-00000001", storage_options=so)
        print(json.dumps({"type": None}))
    except Exception as e:
        print(json.dumps({"type": type(e).__name__, "message": str(e)}))
""")


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_an_object_store_that_accepts_and_never_answers_fails_each_call_typed_after_its_timeout(client):
    """Each call is one bounded attempt (obstore) or at most three attempts of a third of the
    timeout each (s3fs, whose own retry loop once made it 17-20 minutes): counted by the
    connections the silent server saw, not by the clock."""
    server = _SilentServer()
    env = dict(os.environ)
    apply_env({**offline_env(f"http://127.0.0.1:{server.port}", env), "UNICKPT_OBJECT_TIMEOUT_S": "1.5"}, env)
    try:
        for what in ("latest", "save", "load"):
            before = len(server.conns)
            r = subprocess.run([sys.executable, "-c", _SILENT_CALL, client, what], env=env, capture_output=True,
                               text=True, timeout=HANG_GUARD_S)
            got = json.loads(r.stdout.strip().splitlines()[-1])
            assert got["type"] in ("StorageError", "CheckpointNotFoundError"), (what, got, r.stderr[-2000:])
            assert "s3://bucket/run" in got["message"], got
            attempts = len(server.conns) - before
            assert 1 <= attempts <= (1 if client == "obstore" else 3) * (2 if what == "save" else 1), (what, attempts)
    finally:
        server.close()


_TRICKLE_CALL = textwrap.dedent("""
    import json, sys, unickpt
    try:
        unickpt.latest("s3://bucket/run", storage_options={"client": sys.argv[1]})
        print(json.dumps({"type": None}))
    except Exception as e:
        print(json.dumps({"type": type(e).__name__, "message": str(e)}))
""")


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_server_that_trickles_bytes_fails_each_call_within_its_bound(client):
    """A server that answers one byte at a time never trips a per-read timeout (s3fs ran for
    ever): every call is bounded as a whole. Typed, naming the URL."""
    server = _SilentServer(trickle=True)
    env = dict(os.environ)
    apply_env({**offline_env(f"http://127.0.0.1:{server.port}", env), "UNICKPT_OBJECT_TIMEOUT_S": "1"}, env)
    try:
        r = subprocess.run([sys.executable, "-c", _TRICKLE_CALL, client], env=env, capture_output=True, text=True,
                           timeout=HANG_GUARD_S)
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["type"] == "StorageError" and "s3://bucket/run" in got["message"], (got, r.stderr[-2000:])
    finally:
        server.close()


class _SwallowingProxy(LoopbackServer):
    """A TCP proxy to ``upstream`` that passes everything but requests whose first line
    starts with ``PUT`` or ``POST`` once ``armed``: those it reads and never answers."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.armed = threading.Event()
        self.swallowed = 0
        super().__init__()

    def handle(self, c: socket.socket) -> None:
        u = socket.create_connection(("127.0.0.1", self.upstream))
        threading.Thread(target=self._pipe, args=(u, c, False), daemon=True).start()
        self._pipe(c, u, True)

    def _pipe(self, a: socket.socket, b: socket.socket, requests: bool) -> None:
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    return
                if requests and self.armed.is_set() and d.startswith((b"PUT ", b"POST ")):
                    self.swallowed += 1
                    while a.recv(65536):  # read, never answer
                        pass
                    return
                b.sendall(d)
        except OSError:
            pass


_PUT_CALL = textwrap.dedent("""
    import json, os, sys, torch, unickpt
    client, root, arm = sys.argv[1], sys.argv[2], sys.argv[3]
    so = {"client": client}
    unickpt.save({"w": torch.ones(4)}, root + "/step-00000001", step=1, storage_options=so)
    open(arm, "w").close()
    print("armed", flush=True)
    sys.stdin.readline()  # the test arms the proxy, then lets this go on
    try:
        unickpt.save({"w": torch.full((1 << 20,), 2.0)}, root + "/step-00000002", step=2, storage_options=so)
        print(json.dumps({"type": None}))
    except Exception as e:
        print(json.dumps({"type": type(e).__name__, "message": str(e)}))
    print(json.dumps({"latest": unickpt.latest(root, storage_options=so)}))
""")


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_server_that_never_answers_uploads_fails_the_save_typed_and_keeps_the_previous_checkpoint(s3, client,
                                                                                                  tmp_path):
    """Listings and reads pass, every PUT/POST is swallowed (s3fs waited for its
    ``100 Continue`` for ever): the save fails typed, naming the URL; the committed step stays
    the newest."""
    import urllib.parse

    s3.bucket("swallow")
    proxy = _SwallowingProxy(urllib.parse.urlsplit(s3.endpoint).port)
    env = s3.environ({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", "UNICKPT_OBJECT_TIMEOUT_S": "1"})
    arm = tmp_path / "armed"
    root = f"s3://swallow/{client}"
    p = subprocess.Popen([sys.executable, "-c", _PUT_CALL, client, root, str(arm)], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "armed", p.stderr.read()[-2000:]
        proxy.armed.set()
        out, err = p.communicate("go\n", timeout=HANG_GUARD_S)
    finally:
        p.kill()
        proxy.close()
    lines = [json.loads(x) for x in out.strip().splitlines()]
    assert lines[0]["type"] == "StorageError" and root in lines[0]["message"], (lines, err[-2000:])
    assert lines[1]["latest"] == f"{root}/step-00000001" and proxy.swallowed >= 1


def test_object_timeout_is_checked():
    env = dict(os.environ, UNICKPT_OBJECT_TIMEOUT_S="soon")
    r = subprocess.run([sys.executable, "-c", "import unickpt.io.objstore"], env=env, capture_output=True, text=True,
                       timeout=HANG_GUARD_S)
    assert r.returncode != 0 and "InvalidArgumentError" in r.stderr and "UNICKPT_OBJECT_TIMEOUT_S" in r.stderr


# == 2. nothing outside its place is followed or trusted =======================================


def test_the_owner_record_is_never_written_through_a_link(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir(mode=0o700)
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    os.symlink(target, mem / memtier.OWNER_FILE)
    memtier.claim(str(mem), "job-a", [os.getpid()])
    assert target.read_text() == "keep me"
    assert stat.S_ISREG(os.lstat(mem / memtier.OWNER_FILE).st_mode)
    rec = memtier._owner(str(mem))
    assert rec["job"] == "job-a" and rec["started"][str(os.getpid())] > 0  # pid and start time
    assert not [n for n in os.listdir(mem) if n != memtier.OWNER_FILE]  # no temporary left


@as_root
def test_a_memory_directory_of_another_user_or_writable_by_others_is_refused(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir(mode=0o700)
    os.chown(mem, NOBODY, NOBODY)
    for call in (lambda: memtier.claim(str(mem), "job", [os.getpid()]), lambda: memtier.clean(str(mem))):
        with pytest.raises(InvalidArgumentError, match="belongs to another user"):
            call()
    r = cli("clean-memory", mem, "--json")
    assert r.returncode == 2 and "another user" in json.loads(r.stdout)["error"]["message"]
    os.chown(mem, 0, 0)
    os.chmod(mem, 0o777)  # world-writable, no sticky bit: anyone could plant a snapshot
    with pytest.raises(InvalidArgumentError, match="writable by other users"):
        memtier.claim(str(mem), "job", [os.getpid()])
    os.chmod(mem, 0o1777)  # sticky: others may add entries but not replace ours; theirs are not taken
    memtier.claim(str(mem), "job", [os.getpid()])


@as_root
def test_a_memory_directory_whose_parent_another_user_controls_is_refused(tmp_path):
    """A parent of another user's, or one others may write without the sticky bit, could
    swap the directory for a link to a durable root between a check and a deletion (a race
    an attacker won 6 times in 8): refused before anything is read or removed."""
    durable = tmp_path / "durable"
    unickpt.save(_state(3), durable / "step-00000003", step=3)
    run = tmp_path / "run"
    mem = run / "node0"
    mem.mkdir(parents=True, mode=0o700)
    memtier.claim(str(mem), "job", [os.getpid()])
    for owner, mode in ((NOBODY, 0o755), (0, 0o777)):
        os.chown(run, owner, owner)
        os.chmod(run, mode)
        for call in (lambda: memtier.claim(str(mem), "job", [os.getpid()]), lambda: memtier.clean(str(mem), force=True)):
            with pytest.raises(InvalidArgumentError, match="lies in"):
                call()
        r = cli("clean-memory", mem, "--json")
        assert r.returncode == 2, r.stdout
    os.chown(run, 0, 0)
    os.chmod(run, 0o1777)  # sticky: others cannot replace our entry
    assert memtier.clean(str(mem)) == [] and (durable / "step-00000003").is_dir()


@as_root
def test_an_owner_record_of_another_user_is_refused(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir(mode=0o1777)
    (mem / memtier.OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pids": [1], "job": "x"}))
    os.chown(mem / memtier.OWNER_FILE, NOBODY, NOBODY)
    with pytest.raises(InvalidArgumentError, match="owner record belongs to another user"):
        memtier.claim(str(mem), "job", [os.getpid()])


@as_root
def test_a_snapshot_planted_by_another_user_in_a_sticky_memory_directory_is_never_resumed(tmp_path):
    from unickpt.transport import Comm

    mem = tmp_path / "mem"
    mem.mkdir(mode=0o1777)
    memtier.claim(str(mem), "job", [os.getpid()])
    unickpt.save(_state(1), mem / "step-00000001", step=1, extra={memtier.JOB_KEY: "job"})
    unickpt.save(_state(9), mem / "step-00000009", step=9, extra={memtier.JOB_KEY: "job"})
    for dirpath, dirs, files in os.walk(mem / "step-00000009"):
        for n in dirs + files + ["."]:
            os.chown(os.path.join(dirpath, n), NOBODY, NOBODY)
    cands = memtier.candidates(Comm(None), str(mem), None, job="job")
    assert [(c.tier, c.step) for c in cands] == [("memory", 1)]


def test_a_dead_segment_never_blocks_a_new_one_even_under_the_same_pid_and_name(tmp_path, monkeypatch):
    """A segment left by a dead process whose pid this process now has (a container restarted
    in a fresh PID namespace), even under the very name the next segment would take: the new
    segment gets another name, the leftover is never written, and a sweep removes it once old."""
    from unickpt.async_save import segment

    left = f"unickpt-stage-{os.getpid()}-{'ab' * 8}"
    path = os.path.join(shm.SHM_DIR, left)
    with open(path, "wb") as f:
        f.write(b"left by a dead process")
    names = iter([left])
    real = shm.new_name
    monkeypatch.setattr(shm, "new_name", lambda kind: next(names, None) or real(kind))
    seg = segment.new_segment(1 << 16)
    try:
        assert seg.name != left and seg.name.startswith(f"unickpt-stage-{os.getpid()}-")
        with open(path, "rb") as f:
            assert f.read() == b"left by a dead process"
        shm.sweep(shm.SHM_DIR)
        assert os.path.exists(path)  # too fresh to judge yet (a creator may be between open and lock)
        old = time.time() - shm.GRACE_S - 1
        os.utime(path, (old, old))
        os.utime(os.path.join(shm.SHM_DIR, seg.name), (old, old))
        shm.sweep(shm.SHM_DIR)  # (a sweep of another test's may come first: what is left is what counts)
        assert not os.path.exists(path)
        assert os.path.exists(os.path.join(shm.SHM_DIR, seg.name))  # ours is held: alive
    finally:
        seg.close(unlink=True)
        if os.path.exists(path):
            os.unlink(path)


@as_root
def test_a_segment_name_pre_created_by_another_user_is_never_reused_or_swept(tmp_path, monkeypatch):
    from unickpt.async_save import segment

    planted = f"unickpt-stage-{os.getpid()}-{'cd' * 8}"
    path = os.path.join(shm.SHM_DIR, planted)
    with open(path, "wb") as f:
        f.write(b"theirs")
    os.chown(path, NOBODY, NOBODY)
    old = time.time() - shm.GRACE_S - 1
    os.utime(path, (old, old))
    names = iter([planted])
    real = shm.new_name
    monkeypatch.setattr(shm, "new_name", lambda kind: next(names, None) or real(kind))
    try:
        seg = segment.new_segment(1 << 16)
        assert seg.name != planted
        seg.close(unlink=True)
        with pytest.raises(OSError):  # opened by name as a peer would: another user's file is refused
            shm.open_existing(path)
        assert path not in shm.sweep(shm.SHM_DIR) and os.path.exists(path)
        with open(path, "rb") as f:
            assert f.read() == b"theirs"
    finally:
        os.unlink(path)


def test_a_link_in_place_of_a_segment_is_never_followed(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"x" * 4096)
    link = os.path.join(shm.SHM_DIR, shm.new_name("read"))
    os.symlink(target, link)
    try:
        with pytest.raises(FileExistsError):
            shm.create(link)
        with pytest.raises(OSError):
            shm.open_existing(link, 4096)
        assert target.read_bytes() == b"x" * 4096
    finally:
        os.unlink(link)


def _hold_segment(path, ready, done):
    fd = shm.create(path)
    ready.set()
    done.wait(HANG_GUARD_S)
    os.close(fd)


def test_a_segment_whose_creator_lives_is_never_swept_however_old(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    path = os.path.join(tmp_path, shm.new_name("stage"))  # (a directory of its own: no other test's sweep there)
    p = ctx.Process(target=_hold_segment, args=(path, ready, done))
    p.start()
    try:
        assert ready.wait(HANG_GUARD_S)
        old = time.time() - 3600
        os.utime(path, (old, old))
        assert path not in shm.sweep(str(tmp_path)) and os.path.exists(path)
    finally:
        done.set()
        p.join(HANG_GUARD_S)
    assert path in shm.sweep(str(tmp_path)) and not os.path.exists(path)  # its creator is gone


# == 3. every way to pick "the newest step" checks it ===========================================


def _misnamed_root(tmp_path):
    root = tmp_path / "root"
    for step in (2, 4):
        unickpt.save({**_state(step), "step": step}, root / f"step-{step:08d}", step=step)
    shutil.copytree(root / "step-00000002", root / "step-00000013")  # step 2 under a newer step's name
    return root


def test_latest_refuses_a_copy_of_an_older_step_under_a_newer_name(tmp_path):
    root = _misnamed_root(tmp_path)
    with pytest.raises(FormatError, match="named step 13, but its manifest says step 2") as ei:
        unickpt.latest(root)
    assert "step-00000004, step-00000002" in ei.value.__notes__[0]  # the older steps, named
    t = _state(0)
    with pytest.raises(FormatError, match="named step 13"):  # named outright: the same check
        unickpt.load(t, root / "step-00000013")
    with pytest.raises(FormatError, match="named step 13"):
        unickpt.read_manifest(root / "step-00000013")
    assert torch.equal(t["model"]["w"], torch.zeros(64, 64))  # nothing restored
    assert unickpt.retain(root, 1) == []
    r = cli("inspect", root, "--json")
    assert r.returncode == 2 and "named step 13" in json.loads(r.stdout)["error"]["message"]
    shutil.rmtree(root / "step-00000013")
    assert unickpt.latest(root).endswith("step-00000004")


def test_the_dcp_reader_refuses_a_copy_of_an_older_step_under_a_newer_name(tmp_path):
    import torch.distributed.checkpoint as dcp

    import unickpt.dcp

    root = _misnamed_root(tmp_path)
    t = _state(0)
    from torch.distributed.checkpoint.api import CheckpointException

    for path in (root, root / "step-00000013"):  # (DCP wraps the reader's error in its own)
        with pytest.raises((FormatError, CheckpointException), match="named step 13"):
            dcp.load(t, storage_reader=unickpt.dcp.StorageReader(path), no_dist=True)
    assert torch.equal(t["model"]["w"], torch.zeros(64, 64))
    shutil.rmtree(root / "step-00000013")
    dcp.load(t, storage_reader=unickpt.dcp.StorageReader(root), no_dist=True)
    assert torch.equal(t["model"]["w"], torch.full((64, 64), 4.0))


def test_a_save_without_step_into_a_step_directory_records_its_step_so_copies_are_caught(tmp_path):
    """README's `save(state, "ckpt/step-00000100")` (no step=) and DCP's writer recorded no
    step, and a copy under a newer name passed for the newest: the name's step is recorded."""
    import torch.distributed.checkpoint as dcp

    import unickpt.dcp

    root = tmp_path / "root"
    unickpt.save(_state(5), root / "step-00000005")
    dcp.save(_state(7), storage_writer=unickpt.dcp.StorageWriter(root / "step-00000007"), no_dist=True)
    assert unickpt.read_manifest(root / "step-00000005")[1].step == 5
    assert unickpt.read_manifest(root / "step-00000007")[1].step == 7
    shutil.copytree(root / "step-00000005", root / "step-00000013")
    with pytest.raises(FormatError, match="named step 13, but its manifest says step 5"):
        unickpt.latest(root)


def test_a_save_never_commits_a_step_directory_holding_another_step(tmp_path):
    root = tmp_path / "root"
    with pytest.raises(InvalidArgumentError, match="saving step 2 into a directory named for step 13"):
        unickpt.save(_state(), root / "step-00000013", step=2)
    assert not root.exists() or not os.listdir(root)
    unickpt.save(_state(), root / "step-00000002", step=2)
    r = cli("reshard", root / "step-00000002", root / "step-00000013", "--json")
    assert r.returncode == 2 and "named for step 13" in json.loads(r.stdout)["error"]["message"], r.stdout
    assert sorted(os.listdir(root)) == ["step-00000002"]


# == 4. clear errors, right exit codes ==========================================================


def test_deeply_nested_storage_options_are_a_usage_error_never_a_recursion_error(monkeypatch):
    deep = "[" * 100_000 + "]" * 100_000
    for env, args in (({"UNICKPT_STORAGE_OPTIONS": '{"x": ' + deep + "}"}, ()),
                      ({}, ("--storage-options", '{"x": ' + deep + "}")),
                      ({"UNICKPT_STORAGE_OPTIONS": '{"x": ' + "[" * 50 + "]" * 50 + "}"}, ())):
        monkeypatch.delenv("UNICKPT_STORAGE_OPTIONS", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        r = cli("inspect", "memory://bucket/x", "--json", *args)
        got = json.loads(r.stdout)
        msg = got["error"]["message"]
        assert r.returncode == 2 and got["error"]["type"] == "UsageError" and ("nested" in msg or "not JSON" in msg), got
    monkeypatch.delenv("UNICKPT_STORAGE_OPTIONS", raising=False)
    from unickpt.io.objstore import parse_options

    with pytest.raises(InvalidArgumentError):
        parse_options('{"x": ' + deep + "}", "UNICKPT_STORAGE_OPTIONS")
    nested: dict = {}
    for _ in range(5000):
        nested = {"x": nested}
    with pytest.raises(InvalidArgumentError, match="nested deeper"):
        unickpt.latest("memory://bucket/x", storage_options=nested)


def test_keys_no_client_can_delete_are_refused_before_any_write():
    """U+FFFF and other non-characters, and lone surrogates: a checkpoint under such a key
    committed, but S3's delete requests (XML) cannot name it, so retention and sweeps failed
    for ever; refused up front like the other unusable characters."""
    for ch in ("\uffff", "\ufffe", "\ufdd0", "\U0001fffe", "\udcff"):
        with pytest.raises(InvalidArgumentError, match="non-character|surrogate"):
            unickpt.latest(f"memory://bucket/x{ch}y")


def test_the_trainer_metrics_file_is_never_waited_on(tmp_path):
    from unickpt.train.metrics import append_line as append_text

    fifo = _fifo(tmp_path / "metrics.jsonl")
    with pytest.raises(FormatError, match="FIFO"):
        _bounded(append_text, fifo, "{}\n")
    append_text(str(tmp_path / "m.jsonl"), "{}\n")
    append_text(str(tmp_path / "m.jsonl"), "{}\n")
    assert (tmp_path / "m.jsonl").read_text() == "{}\n{}\n"


def test_verify_of_a_file_it_cannot_read_exits_2_could_not_check_not_1_damaged(tmp_path, monkeypatch):
    from unickpt import cli as cli_mod
    from unickpt.io.local import LocalStorage

    ck = tmp_path / "ck"
    unickpt.save({"model": {"w": torch.ones(256, 256)}, "optim": {"m": torch.ones(256, 256)}}, ck)
    victim = sorted(n for n in os.listdir(ck) if n.startswith("model"))[0]
    real = LocalStorage.open_reader

    def eio(self, path):
        if os.path.basename(path) == victim:
            raise StorageError(errno.EIO, "Input/output error", path)
        return real(self, path)

    monkeypatch.setattr(LocalStorage, "open_reader", eio)
    out = []
    monkeypatch.setattr(cli_mod, "_out", lambda text: out.append(text) or True)
    assert cli_mod.main(["verify", str(ck), "--json", "-q"]) == 2
    got = json.loads(out[-1])
    assert got["verdict"] == "could not check" and got["bad"] == [] and got["error"]["type"] == "StorageError", got
    assert got["unchecked"] and got["unchecked"][0]["file"] == victim and "Input/output" in got["unchecked"][0]["reason"]
    with open(ck / [n for n in os.listdir(ck) if n.startswith("optim")][0], "r+b") as f:  # damage elsewhere too: 1
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    out.clear()
    assert cli_mod.main(["verify", str(ck), "--json", "-q"]) == 1
    got = json.loads(out[-1])
    assert got["verdict"] == "damaged" and got["bad"] and got["unchecked"], got


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_object_keys_with_special_characters_round_trip_or_are_refused_before_any_write(s3, client):
    from unickpt.io.storage import storage_for

    so = {"client": client}
    bucket = s3.bucket("odd-keys")
    root = f"{bucket}/{client}/run é+=@,:!$&'() 日本"
    unickpt.save(_state(7), f"{root}/step-00000007", step=7, storage_options=so)
    assert unickpt.latest(root, storage_options=so) == f"{root}/step-00000007"
    t = _state(0)
    res = unickpt.load(t, root, storage_options=so)
    assert res.step == 7 and torch.equal(t["model"]["w"], torch.full((64, 64), 7.0))
    assert unickpt.retain(root, 1, storage_options=so) == []
    for ch in '?#%*[]{}\\^~`"<>|\x01\x7f\n':
        with pytest.raises(InvalidArgumentError, match="read specially"):
            unickpt.save(_state(), f"{bucket}/{client}/bad{ch}x/step-00000001", step=1, storage_options=so)
        with pytest.raises(InvalidArgumentError, match="read specially"):
            unickpt.latest(f"{bucket}/{client}/bad{ch}x", storage_options=so)
    st, p = storage_for(bucket, so)
    assert not [m.key for m in st.list_objects(p) if "/bad" in m.key]  # nothing written
