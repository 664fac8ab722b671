"""O_DIRECT writes straight from the caller's memory (``write_at(..., stable=True)``) and the
asynchronous staging laid out at the file's page phase: heads and tails of pieces take the
copy path, the rest is written from memory, and the files are the same bytes either way."""

import errno
import mmap
import os

import numpy as np
import pytest
import torch

import unickpt
from tests import dist, faulty
from unickpt import cli
from unickpt.io import local as st
from unickpt.errors import StorageError

PAGE = st.ALIGN


def _direct_supported(d) -> bool:
    p = os.path.join(d, "probe")
    with open(p, "wb"):
        pass
    try:
        os.close(os.open(p, os.O_WRONLY | getattr(os, "O_DIRECT", 0)))
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        os.unlink(p)


@pytest.fixture
def from_memory(monkeypatch):
    """Bytes queued as writes straight from callers' memory, in this process."""
    seen = []
    real = st._DirectEngine.submit_direct

    def submit_direct(self, fn, view, offset):
        seen.append((offset, len(view)))
        return real(self, fn, view, offset)

    monkeypatch.setattr(st._DirectEngine, "submit_direct", submit_direct)
    return seen


def _body(offset: int, n: int) -> int:
    """Bytes of a write of ``n`` bytes at ``offset`` that may skip the copy: its whole pages."""
    head = -offset % PAGE
    return max(0, (n - head) // PAGE * PAGE) if n >= st.FROM_MEMORY_MIN else 0


def test_stable_pieces_at_the_file_phase_are_written_from_memory(tmp_path, from_memory):
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT here")
    rng = np.random.default_rng(3)
    size = (9 << 20) + 4321
    data = rng.integers(0, 256, size=size, dtype=np.uint8)
    same = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)  # byte i at page offset i % PAGE: the file's
    same[:] = data
    shifted = np.frombuffer(mmap.mmap(-1, size + PAGE), dtype=np.uint8)[7 : 7 + size]  # elsewhere in a page
    shifted[:] = data
    # pieces: odd sizes and offsets, some contiguous runs, some unstable or shifted
    cuts = [0, 5, 4096 * 3 + 17, (2 << 20) + 1, (2 << 20) + 9000, (4 << 20) + 3, (6 << 20) + 4096, size]
    pieces = list(zip(cuts, cuts[1:]))
    kinds = ["stable", "stable", "stable", "unstable", "stable", "shifted", "stable"]
    order = [6, 0, 1, 2, 4, 3, 5]
    path = str(tmp_path / "f")
    s = st.LocalStorage()
    s.create_file(path, size)
    w = s.open_writer(path, direct=True, size=size)
    assert w.direct
    expect = 0
    for k in order:
        a, b = pieces[k]
        src = shifted if kinds[k] == "shifted" else same
        w.write_at(a, memoryview(src[a:b]), stable=kinds[k] != "unstable")
        if kinds[k] == "stable":
            expect += _body(a, b - a)
    frags = w.close()
    s.close()
    s.finish_file(path, frags, size)
    with open(path, "rb") as f:
        got = np.frombuffer(f.read(), dtype=np.uint8)
    assert got.size == size and np.array_equal(got, data)
    assert expect > (4 << 20) and sum(n for _, n in from_memory) == expect
    assert all(off % PAGE == 0 and n % PAGE == 0 for off, n in from_memory)


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {
        "a": torch.randn(262147, generator=g),  # 1 MiB + 12 bytes: the next tensor starts mid-page
        "c": torch.randn(3, 350001, generator=g),
        "b": torch.randn(600001, generator=g).to(torch.bfloat16),
        "small": torch.randn(5, generator=g),
    }}


def _placed(state, phases, shift=0):
    """Copies of the tensors in one page-aligned buffer, each at ``phases[name] + shift``
    within a page."""
    total = sum(t.numel() * t.element_size() + 2 * PAGE for t in state["model"].values())
    mem = torch.frombuffer(mmap.mmap(-1, total), dtype=torch.uint8)
    out, pos = {}, 0
    for name, t in state["model"].items():
        pos += (phases[name] + shift - pos) % PAGE
        n = t.numel() * t.element_size()
        out[name] = mem[pos : pos + n].view(t.dtype).view(t.shape)
        out[name].copy_(t)
        pos += n
    return {"model": out}


def _file_phases(path):
    _, man = unickpt.read_manifest(path)
    return {k[1]: (man.files[t.file].data_start + t.begin) % PAGE for k, t in man.tensors.items()}


def _data_files(path):
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as f:
                out[name] = f.read()
    return out


@pytest.mark.parametrize("shift", [0, 8])
def test_a_save_from_memory_at_the_file_phase_is_the_same_checkpoint(tmp_path, from_memory, shift):
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT here")
    state = _state()
    unickpt.save(state, tmp_path / "plain")
    phases = _file_phases(tmp_path / "plain")
    assert phases["c"] % PAGE and phases["b"] % PAGE  # heads and tails on both sides
    from_memory.clear()
    unickpt.save(_placed(state, phases, shift), tmp_path / "placed")
    _, man = unickpt.read_manifest(tmp_path / "placed")
    expect = sum(_body(man.files[t.file].data_start + t.begin, t.nbytes) for t in man.tensors.values())
    assert sum(n for _, n in from_memory) == (expect if shift == 0 else 0) and expect > (6 << 20)
    assert _data_files(tmp_path / "placed") == _data_files(tmp_path / "plain")
    back = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    unickpt.load(back, tmp_path / "placed")
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k].view(torch.uint8), v.view(torch.uint8)), k
    assert cli.main(["verify", str(tmp_path / "placed")]) == 0


def test_a_failed_write_from_memory_is_a_storage_error_and_commits_nothing(tmp_path, from_memory):
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT here")
    state = _state()
    unickpt.save(state, tmp_path / "plain")
    placed = _placed(state, _file_phases(tmp_path / "plain"))
    from_memory.clear()
    faulty.install({"pwrite_error": [errno.EIO, 2]})
    try:
        with pytest.raises(StorageError) as e:
            unickpt.save(placed, tmp_path / "failed")
    finally:
        faulty.uninstall()
    assert e.value.errno == errno.EIO and from_memory
    assert sorted(os.listdir(tmp_path)) == ["plain"]


def _async_odd_pieces(rank, world, root):
    from unickpt.async_save import checkpointer
    from unickpt.state import flatten

    rows, cols = (1001, 999)[rank], 333  # 1.3 MB row blocks starting mid-page in the file
    g = torch.Generator().manual_seed(rank)

    def state(k):
        return {"model": {
            f"w{i}": unickpt.shard(torch.randn(rows, cols, generator=g) + k, (2000, cols), offsets=(rank * 1001, 0))
            for i in range(3)
        }, "optimizer": {"m": {"v": unickpt.shard(torch.randn(rows * cols + 1 - rank, generator=g),
                                                  (2000 * cols + 1,), offsets=(0 if rank == 0 else 1001 * cols + 1,))}}}

    cp = checkpointer()
    staged = []
    for k in range(3):
        sd = state(k)
        unickpt.save(sd, os.path.join(root, f"async-{k}"), step=k, async_save=True).wait(timeout=120)
        entries, _ = flatten(sd, rank, world)
        staged.append(cp._place(entries))
        unickpt.save(sd, os.path.join(root, f"sync-{k}"), step=k)
    # after a save the writer's plan gives every large piece the page phase it has in its file
    sig, phases = cp._phases
    assert sig == staged[-1].signature and all(isinstance(p, int) for p in phases)
    assert all(row.offset % PAGE == p for row, p in zip(staged[-1].entries, phases))
    return phases


def test_async_pieces_with_odd_offsets_are_staged_at_their_phase_and_load_back(tmp_path):
    root = str(tmp_path)
    phases = dist.run(_async_odd_pieces, 2, root)
    assert any(p % PAGE for ph in phases for p in ph)  # not all page aligned: heads and tails exist
    for k in range(3):
        a, s = os.path.join(root, f"async-{k}"), os.path.join(root, f"sync-{k}")
        assert _data_files(a) == _data_files(s)
        assert cli.main(["verify", a]) == 0


def _can_fallocate(d) -> bool:
    import ctypes

    p = os.path.join(d, "probe")
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        return fn(fd, 0, 0, PAGE) == 0
    finally:
        os.close(fd)
        os.unlink(p)


def test_a_created_file_has_its_blocks_reserved_and_reads_as_zeros(tmp_path, monkeypatch):
    """create_file reserves the whole file (few large extents, a full disk fails before any
    write); UNICKPT_NO_FALLOCATE=1 leaves it sparse, as on a file system that cannot."""
    if not _can_fallocate(tmp_path):
        pytest.skip("this file system cannot fallocate")
    s = st.LocalStorage()
    size = (8 << 20) + 123
    path = str(tmp_path / "reserved")
    s.create_file(path, size)
    info = os.stat(path)
    assert info.st_size == size and info.st_blocks * 512 >= size
    with open(path, "rb") as f:
        assert f.read() == bytes(size)
    monkeypatch.setenv("UNICKPT_NO_FALLOCATE", "1")
    sparse = str(tmp_path / "sparse")
    s.create_file(sparse, size)
    assert os.stat(sparse).st_size == size and os.stat(sparse).st_blocks * 512 < size


class _LockClock:
    """The storage module's clock in a test: ``sleep`` advances it instead of waiting, and
    ``fcntl.flock`` is counted, so how long a reservation waited for the lock is a fact (the
    seconds it slept, the attempts it made), not a wall-clock measurement."""

    def __init__(self, monkeypatch) -> None:
        import fcntl
        import time

        self.now, self.slept, self.flocks = 1000.0, 0.0, 0
        self._time = time
        real_flock = fcntl.flock

        def flock(fd, op):
            self.flocks += 1
            return real_flock(fd, op)

        monkeypatch.setattr(fcntl, "flock", flock)
        monkeypatch.setattr(st, "time", self)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += s

    def __getattr__(self, name):  # anything else the module uses: the real time module
        return getattr(self._time, name)


def test_ranks_of_a_machine_reserve_their_files_one_at_a_time(tmp_path):
    """Reservations at the same moment interleave the files' blocks 8 MiB by 8 MiB (a later
    sequential read of one file skips every other 8 MiB on disk): create_file reserves under
    a lock that every process of this user on this machine takes."""
    import threading
    import time

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm for the lock")
    s = st.LocalStorage()
    order = []
    with st._node_lock("alloc"):  # another rank reserving (a separate open file: flock excludes it)
        t = threading.Thread(target=lambda: (s.create_file(str(tmp_path / "f"), 1 << 20), order.append("reserved")))
        t.start()
        time.sleep(0.3)  # time for the thread to reach the lock (a slow machine only makes this weaker)
        assert not order  # waits for the other reservation
        order.append("released")  # then the lock goes at the end of this block
    t.join(60)  # a hang guard only: the reservation follows the release at once
    assert order == ["released", "reserved"] and os.path.getsize(tmp_path / "f") == 1 << 20


def test_a_lock_held_too_long_or_planted_by_someone_else_is_gone_around(tmp_path, monkeypatch):
    """The reservation lock is only an optimisation: a holder that never lets go (a stopped
    process, a child forked while it was held) delays a reservation by LOCK_WAIT_S at most,
    and a lock file that is not this user's own regular file with one link is not used.
    The waiting is counted on the storage module's clock (_LockClock), not timed."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm for the lock")
    monkeypatch.setattr(st, "LOCK_WAIT_S", 0.5)
    s = st.LocalStorage()
    with st._node_lock("alloc"):  # held for the whole test
        clock = _LockClock(monkeypatch)
        s.create_file(str(tmp_path / "f"), 1 << 20)
        # tried until LOCK_WAIT_S had passed (1 ms polls), then went on without the lock
        assert 0.5 <= clock.slept <= 0.5 + 0.002 and clock.flocks >= 100, (clock.slept, clock.flocks)
        assert os.path.getsize(tmp_path / "f") == 1 << 20
    monkeypatch.undo()
    name = f"test-{os.getpid()}"
    lock = f"/dev/shm/unickpt-{name}-{os.getuid()}.lock"
    link = lock + ".link"
    try:
        with st._node_lock(name):  # held
            os.link(lock, link)  # two links: a file someone else could have planted
            clock = _LockClock(monkeypatch)
            with st._node_lock(name, wait_s=10):
                pass  # not used, so not waited for
            assert clock.flocks == 0 and clock.slept == 0, (clock.flocks, clock.slept)
    finally:
        monkeypatch.undo()
        for p in (lock, link):
            if os.path.exists(p):
                os.unlink(p)


def test_files_in_memory_are_reserved_without_the_lock(monkeypatch):
    """tmpfs has no extents to interleave, and reserving there zeroes pages (0.24 s per 512 MiB):
    no reason to make a node's ranks wait for each other. With the lock held elsewhere, the
    reservation never tries it (no flock, no wait on the storage module's clock)."""
    if st._fs_type("/dev/shm/x") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    s = st.LocalStorage()
    path = f"/dev/shm/unickpt-test-{os.getpid()}.bin"
    try:
        with st._node_lock("alloc"):
            clock = _LockClock(monkeypatch)
            s.create_file(path, 1 << 20)
            assert clock.flocks == 0 and clock.slept == 0, (clock.flocks, clock.slept)
            assert os.path.getsize(path) == 1 << 20
    finally:
        monkeypatch.undo()
        os.unlink(path)


def test_a_disk_without_room_for_a_file_fails_its_creation_naming_it(tmp_path):
    s = st.LocalStorage()
    f = faulty.install({"reserve_error": errno.ENOSPC})
    try:
        with pytest.raises(StorageError) as ei:
            s.create_file(str(tmp_path / "big"), 1 << 30)
    finally:
        faulty.uninstall()
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(tmp_path / "big")
    assert str(1 << 30) in str(ei.value) and f.injected
    s.create_file(str(tmp_path / "after"), 4096)  # uninstalled: the real call again
    assert os.path.getsize(tmp_path / "after") == 4096


def test_staging_buffers_ask_for_huge_pages():
    """O_DIRECT requests are built from a buffer's physical pages, at most max_segments of
    them: from scattered 4 KiB pages a request carries ~1 MB. Staging buffers are private
    anonymous memory advised for 2 MiB pages, which the kernel gives where transparent huge
    pages are in "madvise" or "always" mode (shared anonymous memory would not get them)."""
    import re

    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off")
    def fallbacks() -> int:
        for line in open("/proc/vmstat"):
            if line.startswith("thp_fault_fallback "):
                return int(line.split()[1])
        return 0

    before = fallbacks()
    s = st._Staging(16 << 20)
    try:
        s.arr[:] = 1  # touch every page
        addr = s.arr.ctypes.data
        huge = None
        for line in open("/proc/self/smaps").read().splitlines():
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                huge = int(line.split()[1]) << 10
                break
        if not huge and fallbacks() > before:
            pytest.skip("the kernel had no free huge page to give (it was asked: a fallback was counted)")
        assert addr % 4096 == 0 and huge is not None and huge >= 2 << 20, huge
    finally:
        del s.arr
        s.buf.close()
