"""How the asynchronous writer is launched: real scripts, real launchers.

The writer is a fresh interpreter that never imports the trainer's ``__main__``: a torchrun
script without an ``if __name__ == "__main__":`` guard must not run again in it (with
``multiprocessing``'s spawn it did, and the copy joined the job). Each script prints one
``SCRIPT START`` line per run of its top level, so a second run would be seen.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import unickpt
from tests.dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# two async saves and one load, at top level (no guard); checks the writer's environment
BODY = textwrap.dedent(
    """
    import os, sys
    import psutil, torch, torch.distributed as dist
    import unickpt
    from unickpt.async_save import checkpointer

    # one write per line (ranks share the pipe; print() under PYTHONUNBUFFERED writes each
    # argument on its own, and two ranks' words interleaved: 'RANK DONERANK DONE  01')
    sys.stdout.write(f"SCRIPT START {os.getpid()}\\n"); sys.stdout.flush()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = sys.argv[1]

    def state(v):
        return {"model": {"w": unickpt.shard(torch.full((4, 3), float(v + rank)), (4 * world, 3), offsets=(4 * rank, 0))},
                "step": v}

    h = unickpt.save(state(1), os.path.join(root, "step-1"), step=1, async_save=True)
    h.wait()
    writer = psutil.Process(checkpointer()._proc.pid)
    assert writer.ppid() == os.getpid(), (writer.ppid(), os.getpid())
    # the writer yields the cores to training (UNICKPT_WRITER_NICE, default 10)
    assert writer.nice() == min(19, psutil.Process().nice() + 10), (writer.nice(), psutil.Process().nice())
    env = writer.environ()
    leaked = sorted(k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
                    if k in env) + sorted(k for k in env if k.startswith("TORCHELASTIC_"))
    assert not leaked, leaked
    # torch's C++ log (a stack trace per line) is off in the writer unless the caller set a level
    assert env.get("TORCH_CPP_LOG_LEVEL") == os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL"), env.get("TORCH_CPP_LOG_LEVEL")
    assert not any(a.endswith(".py") for a in writer.cmdline()), writer.cmdline()
    h = unickpt.save(state(2), os.path.join(root, "step-2"), step=2, async_save=True)
    h.wait()
    t = {"model": {"w": torch.zeros(4 * world, 3)}}
    unickpt.load(t, os.path.join(root, "step-2"))
    assert torch.equal(t["model"]["w"][4 * rank : 4 * rank + 4], torch.full((4, 3), 2.0 + rank))
    unickpt.async_save.shutdown()
    dist.destroy_process_group()
    sys.stdout.write(f"RANK DONE {rank}\\n"); sys.stdout.flush()
    """
)


def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def _run(cmds, cwd, envs) -> list[str]:
    """Run the commands to the end (each in a session of its own, killed whole if it hangs:
    a hung job leaves no stray ranks or writers); fail with their output unless all exit 0."""
    procs = [subprocess.Popen(c, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c, e in zip(cmds, envs)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    return outs


def _check(out: str, root: str, world: int = 2) -> None:
    assert out.count("SCRIPT START") == world, out  # the writers did not run the script
    assert sorted(line for line in out.splitlines() if line.startswith("RANK DONE")) == \
        [f"RANK DONE {r}" for r in range(world)], out
    for step in (1, 2):
        path = os.path.join(root, f"step-{step}")
        _, man = unickpt.read_manifest(path)
        assert man.step == step
        t = {"model": {"w": torch.zeros(4 * world, 3)}}
        unickpt.load(t, path)
        want = torch.cat([torch.full((4, 3), float(step + r)) for r in range(world)])
        assert torch.equal(t["model"]["w"], want)


def test_unguarded_script_under_torchrun(tmp_path):
    script = tmp_path / "train_noguard.py"
    script.write_text(BODY)
    root = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(root)]
    (out,) = _run([cmd], tmp_path, [_env()])
    _check(out, str(root))


def test_guarded_module_run_with_python_m(tmp_path):
    """``python -m pkg.train`` (a guarded main), ranks started by hand from the env."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = "\n".join("    " + line if line else "" for line in BODY.splitlines())
    (pkg / "train.py").write_text("def main():\n" + body + "\n\nif __name__ == '__main__':\n    main()\n")
    root = tmp_path / "ckpt"
    port = free_port()
    envs = [_env({"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for r in range(2)]
    outs = _run([[sys.executable, "-m", "mypkg.train", str(root)]] * 2, tmp_path, envs)
    _check("".join(outs), str(root))


def _start_fails_on_rank_1(rank, world, root):
    import pytest

    from unickpt.errors import AsyncSaveError, UnickptError

    sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(rank)), (4 * world, 3), offsets=(4 * rank, 0))}}
    exe = sys.executable
    if rank == 1:
        sys.executable = os.path.join(root, "no-such-python")
    try:
        # agreed like any error preparing a save: every rank raises, the failing one its own
        with pytest.raises(AsyncSaveError if rank == 1 else UnickptError, match="writer process could not be started"):
            unickpt.save(sd, os.path.join(root, "a"), step=1, async_save=True)
    finally:
        sys.executable = exe
    unickpt.save(sd, os.path.join(root, "b"), step=2, async_save=True).wait()  # writers restarted
    unickpt.async_save.shutdown()
    return sorted(os.listdir(root))


def _started_early(rank, world, root):
    import pytest

    from unickpt import async_save
    from unickpt.async_save import rendezvous, segment
    from unickpt.errors import AsyncSaveError

    sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(rank)), (4 * world, 3), offsets=(4 * rank, 0))}}
    exe = sys.executable
    if rank == 1:
        sys.executable = os.path.join(root, "no-such-python")
    try:  # a writer that cannot start: every rank raises AsyncSaveError at once, the failing one its own
        with pytest.raises(AsyncSaveError, match="writer process could not be started"):
            unickpt.start_async_writer()
    finally:
        sys.executable = exe
    unickpt.save(sd, os.path.join(root, "a"), step=1, async_save=True).wait()  # the save restarts the writers
    pid = async_save.checkpointer()._proc.pid
    unickpt.start_async_writer()  # running: nothing to do
    assert async_save.checkpointer()._proc.pid == pid

    async_save.shutdown()
    unickpt.start_async_writer(sd)  # before any save: the writer and the staging for sd
    c = async_save.checkpointer()
    proc, seg = c._proc, c._seg
    assert proc is not None and proc.is_alive() and proc.pid != pid
    assert seg is not None and seg.size >= 4 * 3 * 4
    unickpt.save(sd, os.path.join(root, "b"), step=2, async_save=True).wait()
    assert (c._proc.pid, c._seg) == (proc.pid, seg)  # the save used both
    async_save.shutdown()

    real = segment.StagingSegment.__init__
    if rank == 1:  # staging that cannot be allocated on one rank: every rank raises at once
        def no_room(self, name, size, create):
            raise AsyncSaveError("no room for the staging (injected)")

        segment.StagingSegment.__init__ = no_room
    try:
        with pytest.raises(AsyncSaveError, match="no room for the staging"):
            unickpt.start_async_writer(sd)
    finally:
        segment.StagingSegment.__init__ = real
    async_save.shutdown()

    serve = rendezvous.serve
    if rank == 0:  # no rendezvous for the writers' group: every rank learns it, none waits in the broadcast
        def no_port(timeout_s):
            raise RuntimeError("injected: no free port")

        rendezvous.serve = no_port
    try:
        with pytest.raises(AsyncSaveError, match="could not serve the writers' rendezvous"):
            unickpt.start_async_writer()
    finally:
        rendezvous.serve = serve
    async_save.shutdown()
    return sorted(os.listdir(root))


def test_start_async_writer_starts_the_writers_the_saves_then_use(tmp_path):
    from tests import dist

    assert dist.run(_started_early, 2, str(tmp_path)) == [["a", "b"], ["a", "b"]]
    t = {"model": {"w": torch.zeros(8, 3)}}
    unickpt.load(t, str(tmp_path / "b"))
    assert torch.equal(t["model"]["w"], torch.cat([torch.zeros(4, 3), torch.ones(4, 3)]))


def _rendezvous_held(rank, world, root):
    import psutil

    from unickpt import async_save

    sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(rank)), (4 * world, 3), offsets=(4 * rank, 0))}}
    unickpt.start_async_writer()
    c = async_save.checkpointer()

    def listening() -> set[int]:
        return {x.laddr.port for x in psutil.Process().net_connections("tcp") if x.status == psutil.CONN_LISTEN}

    port = c._rendezvous.port if rank == 0 else None
    if rank == 0:  # bound by the trainer itself, before any writer started: no port was picked and let go
        assert port in listening()
    unickpt.save(sd, os.path.join(root, "a"), step=1, async_save=True).wait()
    if rank == 1:  # a writer gone: the next save starts a new group on every rank
        c._proc.kill()
        c._proc.join(10)
    unickpt.save(sd, os.path.join(root, "b"), step=2, async_save=True).wait()
    if rank == 0:  # the new group met on a store of its own; the old one (and its keys) is gone
        now = listening()
        assert c._rendezvous.port in now and (port == c._rendezvous.port or port not in now)
    async_save.shutdown()
    if rank == 0:
        assert c._rendezvous is None
    return sorted(os.listdir(root))


def test_the_writers_meet_on_a_store_rank_0_holds(tmp_path):
    """Rank 0's trainer serves the writers' rendezvous on a port the kernel gave it at bind
    time: no port is picked, released and bound again seconds later by a writer (which
    another process could take in between); a restarted group meets on a new store, and
    the old one is let go."""
    from tests import dist

    assert dist.run(_rendezvous_held, 2, str(tmp_path)) == [["a", "b"], ["a", "b"]]
    t = {"model": {"w": torch.zeros(8, 3)}}
    unickpt.load(t, str(tmp_path / "b"))
    assert torch.equal(t["model"]["w"], torch.cat([torch.zeros(4, 3), torch.ones(4, 3)]))


def _subgroup_async(rank, world, root):
    import torch.distributed as tdist

    from unickpt import async_save

    group = tdist.new_group([1, 2])  # collective: every rank creates it; its rank 0 is the job's rank 1
    served = None
    if rank != 0:
        g = rank - 1
        sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(g)), (8, 3), offsets=(4 * g, 0))}}
        unickpt.save_async(sd, os.path.join(root, "a"), step=1, group=group).wait()
        c = async_save.checkpointer(group)
        served = c._rendezvous is not None  # by the subgroup's rank 0 (the job's rank 1), not the job's rank 0
        async_save.shutdown()
    tdist.barrier()  # (rank 0 must not exit while the others' gloo pairs still connect to it)
    return served


def test_the_writers_of_a_subgroup_meet_at_its_own_rank_0(tmp_path):
    """An asynchronous save over a subgroup whose rank 0 is not the job's: that rank serves
    the writers' rendezvous and tells the others where (its own address towards
    MASTER_ADDR), and the save commits."""
    from tests import dist

    assert dist.run(_subgroup_async, 3, str(tmp_path), env={"MASTER_ADDR": "127.0.0.1"}) == [None, True, False]
    t = {"model": {"w": torch.zeros(8, 3)}}
    unickpt.load(t, str(tmp_path / "a"))
    assert torch.equal(t["model"]["w"], torch.cat([torch.zeros(4, 3), torch.ones(4, 3)]))


def _subgroup_addr_override(rank, world, root):
    import pytest
    import torch.distributed as tdist

    from unickpt import async_save
    from unickpt.errors import AsyncSaveError

    group = tdist.new_group([1, 2])
    if rank == 0:
        tdist.barrier()  # (rank 0 must not exit while the others' gloo pairs still connect to it)
        return None
    if rank == 1:  # the subgroup's rank 0 says it is reached at an address nobody answers on
        os.environ["UNICKPT_WRITER_ADDR"] = "192.0.2.1"  # TEST-NET-1 (RFC 5737)
    with pytest.raises(AsyncSaveError) as info:
        unickpt.start_async_writer(group=group)
    said = str(info.value)
    os.environ.pop("UNICKPT_WRITER_ADDR", None)
    g = rank - 1
    sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(g)), (8, 3), offsets=(4 * g, 0))}}
    unickpt.save_async(sd, os.path.join(root, "a"), step=1, group=group).wait()  # writers restarted
    async_save.shutdown()
    tdist.barrier()
    return said


def test_the_writers_rendezvous_address_can_be_set(tmp_path):
    """``UNICKPT_WRITER_ADDR`` on the host of the group's rank 0 is where the other writers
    look for the rendezvous: an address nobody answers on fails the start on every rank
    (within the timeout), and without it the next save finds its writers."""
    from tests import dist

    # (the job's 180 s are a hang guard only: the writers give up after UNICKPT_TIMEOUT_S)
    out = dist.run(_subgroup_addr_override, 3, str(tmp_path), env={"MASTER_ADDR": "127.0.0.1", "UNICKPT_TIMEOUT_S": "5"})
    assert out[0] is None
    for said in out[1:]:  # every rank of the subgroup: the start failed, naming the address nobody answered on
        assert "could not be started" in said and "192.0.2.1" in said, said
    t = {"model": {"w": torch.zeros(8, 3)}}
    unickpt.load(t, str(tmp_path / "a"))
    assert torch.equal(t["model"]["w"], torch.cat([torch.zeros(4, 3), torch.ones(4, 3)]))


def _two_checkpointers(rank, world, root):
    import torch.distributed as tdist

    from unickpt import async_save

    sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(rank)), (4 * world, 3), offsets=(4 * rank, 0))}}
    other = tdist.new_group([0, 1])
    unickpt.save(sd, os.path.join(root, "a"), step=1, async_save=True).wait()
    # the default group, named: the same checkpointer (one staging buffer, one set of writers)
    unickpt.save(sd, os.path.join(root, "b"), step=2, async_save=True, group=tdist.group.WORLD).wait()
    same = async_save.checkpointer(tdist.group.WORLD) is async_save.checkpointer(None)
    # another group (here the same ranks): its own checkpointer, staging and writers
    unickpt.save(sd, os.path.join(root, "c"), step=3, async_save=True, group=other).wait()
    segs = {async_save.checkpointer(g)._seg.name for g in (None, tdist.group.WORLD, other)}
    async_save.shutdown()
    return same, len(segs), sorted(os.listdir(root))


def test_two_checkpointers_of_one_process_stage_in_segments_of_their_own(tmp_path):
    """Each group's checkpointer numbered its segments from 1: the second one's first save
    failed with "File exists" on the other's /dev/shm segment. ``group=None`` and the
    default group named are one group (they were two sets of writers for the same ranks)."""
    from tests import dist

    assert dist.run(_two_checkpointers, 2, str(tmp_path)) == [(True, 2, ["a", "b", "c"])] * 2


def test_a_writer_that_cannot_start_fails_the_save_on_every_rank(tmp_path):
    from tests import dist

    out = dist.run(_start_fails_on_rank_1, 2, str(tmp_path))
    assert out == [["b"], ["b"]]
    t = {"model": {"w": torch.zeros(8, 3)}}
    unickpt.load(t, str(tmp_path / "b"))
    assert torch.equal(t["model"]["w"], torch.cat([torch.zeros(4, 3), torch.ones(4, 3)]))


def test_a_writer_that_exited_unheard_has_its_last_words_logged(caplog):
    """A writer started early whose own set-up failed replies, then exits, with no save
    listening; the save that replaces it logs that reply instead of dropping it."""
    import logging
    import multiprocessing.connection as mpc

    from unickpt import async_save

    class Exited:  # the part of _WriterProcess that _stop_writer uses, for a process that is gone
        exitcode = 1

        def is_alive(self):
            return False

        def join(self, timeout=None):
            pass

        def close(self):
            pass

    c = async_save.Checkpointer()
    parent, child = mpc.Pipe(duplex=True)
    child.send_bytes(b'{"ok": false, "error": "writer group setup failed: injected"}')
    child.close()
    c._proc, c._conn = Exited(), parent
    with caplog.at_level(logging.WARNING, logger="unickpt"):
        c._stop_writer(graceful=True)
    assert "writer group setup failed: injected" in caplog.text and "exit code 1" in caplog.text
    assert c._proc is None and c._conn is None


@pytest.mark.parametrize("bg", [False, True], ids=["in-the-call", "background"])
def test_start_async_writer_leaves_the_staging_of_a_save_in_flight_alone(tmp_path, bg, monkeypatch):
    """Called again with a larger state while a save is in flight (its writer's fsyncs take
    1 s each, so it certainly is), the staging stays: replacing it unmapped the memory the
    copy and the writer were using (a crash, or zeros committed with their checksums). Once
    the save is over, the next call grows it."""
    import json

    from tests import faulty
    from unickpt import async_save
    from unickpt.async_save import writer

    async_save.shutdown()
    monkeypatch.setattr(writer, "main", faulty.writer_main)  # the writer installs these faults
    monkeypatch.setenv("UNICKPT_TEST_FAULTS", json.dumps({"fsync_delay": 1.0}))
    sd = {"model": {"w": torch.arange(3_000_000, dtype=torch.float32)}}
    unickpt.start_async_writer(sd)
    c = async_save.checkpointer()
    seg = c._seg
    h = unickpt.save(sd, str(tmp_path / "a"), step=1, async_save=True, background_staging=bg)
    bigger = {"model": {"w": torch.ones(6_000_000)}}
    unickpt.start_async_writer(bigger)
    assert c._seg is seg and not h.done()
    h.wait(timeout=120)
    unickpt.start_async_writer(bigger)
    assert c._seg is not seg and c._seg.size >= 24_000_000
    unickpt.save(bigger, str(tmp_path / "b"), step=2, async_save=True, background_staging=bg).wait(timeout=120)
    async_save.shutdown()
    for name, want in (("a", sd), ("b", bigger)):
        t = {"model": {"w": torch.zeros_like(want["model"]["w"])}}
        unickpt.load(t, str(tmp_path / name))
        assert torch.equal(t["model"]["w"], want["model"]["w"]), name


def _stateful_fails_on_rank_1(rank, world, root):
    import pytest

    from unickpt.errors import AsyncSaveError

    class Broken:
        def state_dict(self):
            raise RuntimeError("state_dict failed (injected)")

        def load_state_dict(self, sd):
            pass

    sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(rank)), (4 * world, 3), offsets=(4 * rank, 0))}}
    if rank == 1:
        sd["extra"] = Broken()
    with pytest.raises(RuntimeError if rank == 1 else AsyncSaveError, match="injected"):
        unickpt.start_async_writer(sd)  # the other rank is told at once, not after its timeout
    unickpt.async_save.shutdown()
    return True


def test_a_state_dict_that_fails_on_one_rank_fails_start_async_writer_on_every_rank(tmp_path):
    from tests import dist

    assert dist.run(_stateful_fails_on_rank_1, 2, str(tmp_path), timeout=60, env={"UNICKPT_TIMEOUT_S": "600"}) == [True, True]


def _writer_fails_at_set_up(rank, world, root):
    import pytest

    from tests import faulty
    from unickpt import async_save
    from unickpt.async_save import writer
    from unickpt.errors import AsyncSaveError

    sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(rank)), (4 * world, 3), offsets=(4 * rank, 0))}}
    real = writer.main
    for bad, said in ((faulty.writer_cannot_join, "writer group setup failed: injected"),
                      (faulty.writer_exits, r"exited \(exit code 3\) before joining the writers' group")):
        if rank == 1:
            writer.main = bad
        if rank == 0:  # its own writer may fail first, at the gate rank 1's trainer closed
            said = f"{said}|rank 1's writer process \\(pid \\d+\\) exited before it joined the writers' group"
        try:  # reported by start_async_writer on every rank (one error type), not left to the first save
            with pytest.raises(AsyncSaveError, match=said):
                unickpt.start_async_writer(sd)
        finally:
            writer.main = real
        # the peers' writers wait for a group that cannot form: stopped on every rank
        assert async_save.checkpointer()._proc is None
    unickpt.start_async_writer(sd)
    unickpt.save(sd, os.path.join(root, "a"), step=1, async_save=True).wait()
    async_save.shutdown()
    return sorted(os.listdir(root))


def test_a_writer_that_fails_at_set_up_fails_start_async_writer_on_every_rank(tmp_path):
    """The writers' group forms before start_async_writer returns: a writer that cannot join
    it (it said why, or it died) fails the call on every rank at once, well within the
    600 s timeout that bounds the peers' writers (the job would be killed at 120 s)."""
    from tests import dist

    out = dist.run(_writer_fails_at_set_up, 2, str(tmp_path), timeout=120, env={"UNICKPT_TIMEOUT_S": "600"})
    assert out == [["a"], ["a"]]
    t = {"model": {"w": torch.zeros(8, 3)}}
    unickpt.load(t, str(tmp_path / "a"))
    assert torch.equal(t["model"]["w"], torch.cat([torch.zeros(4, 3), torch.ones(4, 3)]))


def _writer_killed_while_a_save_starts_it(rank, world, root):
    import signal

    import pytest

    from tests import faulty
    from unickpt import async_save
    from unickpt.async_save import writer
    from unickpt.errors import AsyncSaveError

    sd = {"model": {"w": unickpt.shard(torch.full((4, 3), float(rank)), (4 * world, 3), offsets=(4 * rank, 0))}}
    unickpt.save(sd, os.path.join(root, "a"), step=1)
    real = writer.main
    if rank == 1:
        writer.main = faulty.writer_starts_slowly
    try:  # no start_async_writer(): this save starts the writers and returns while they start
        h = unickpt.save(sd, os.path.join(root, "b"), step=2, async_save=True)
    finally:
        writer.main = real
    if rank == 1:
        os.kill(async_save.checkpointer()._proc.pid, signal.SIGKILL)
        said = "the writer process of this rank died"
    else:  # told by rank 1's trainer through the writers' rendezvous, not after its 600 s timeout
        said = r"rank 1's writer process \(pid \d+\) exited before it joined the writers' group"
    with pytest.raises(AsyncSaveError, match=said):
        h.wait()
    unickpt.save(sd, os.path.join(root, "c"), step=3, async_save=True).wait()  # new writers on every rank
    async_save.shutdown()
    return sorted(os.listdir(root))


def test_a_writer_killed_while_a_save_starts_it_fails_that_save_on_every_rank_at_once(tmp_path):
    """A save that starts the writers itself returns while they start. When one rank's writer
    dies before joining their group, its trainer closes the group's gate with the reason, so
    the other ranks' saves fail at once naming it, not when their 600 s timeout ends (the job
    would be killed at 120 s). The next save starts new writers; "b" was never committed."""
    from tests import dist

    out = dist.run(_writer_killed_while_a_save_starts_it, 2, str(tmp_path), timeout=120,
                   env={"UNICKPT_TIMEOUT_S": "600"})
    assert out == [["a", "c"], ["a", "c"]]
    for name in ("a", "c"):
        t = {"model": {"w": torch.zeros(8, 3)}}
        unickpt.load(t, str(tmp_path / name))
        assert torch.equal(t["model"]["w"], torch.cat([torch.zeros(4, 3), torch.ones(4, 3)]))
