"""Node-shared reads (unickpt.noderead): ranks of one node that need interleaved pieces of
the same stored bytes (column blocks) read each checksummed range once, counted by the
storage layer's readers; results are bit-exact; damage, I/O errors and a missing shared
memory directory behave as they do for ranks reading alone."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import time

import pytest
import torch

import unickpt
from unickpt import shm
from tests import dist

ROWS, COLS = 1536, 512  # 3 MiB per fp32 matrix: several checksummed 1 MiB blocks each
NAMES = ("a", "b", "c")


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(ROWS + 8 * i, COLS, generator=g) for i, n in enumerate(NAMES)}


def _save(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    unickpt.save({"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _full().items()}}, root)


def _load_columns(rank, world, root, node_of=None, patch=None, timeout_s=20):
    """Load every matrix as column blocks (Shard(1)); returns (bytes_read, verified, ok) or
    (error type, message, None): the third item is falsy for an error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if node_of is not None:
        os.environ["UNICKPT_NODE_ID"] = node_of[rank]
    if patch is not None:
        patch(rank)
    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    tgt = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}}
    try:
        res = unickpt.load(tgt, root, timeout_s=timeout_s)
    except Exception as e:
        return type(e).__name__, str(e), None
    ok = all(torch.equal(tgt["model"][k].to_local(), v.tensor_split(world, dim=1)[rank]) for k, v in full.items())
    return res.bytes_read, res.verified, ok


def _both(rank, world, root, node_of=None):
    """The same load with node-shared reads and without (UNICKPT_NODE_SHARED_READS=0)."""
    shared = _load_columns(rank, world, root, node_of)
    os.environ["UNICKPT_NODE_SHARED_READS"] = "0"
    alone = _load_columns(rank, world, root, node_of)
    return shared, alone


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint of the three matrices, saved by 2 ranks as row blocks (read-only: a
    test that damages it works on a copy)."""
    root = str(tmp_path_factory.mktemp("node_read") / "ck")
    dist.run(_save, 2, root)
    return root


def _tensor_bytes() -> int:
    return sum(v.numel() * 4 for v in _full().values())


def test_ranks_of_a_node_read_each_needed_byte_once(saved):
    out = dist.run(_both, 2, saved)
    shared, alone = [o[0] for o in out], [o[1] for o in out]
    assert all(s[2] for s in shared) and all(a[2] for a in alone), out
    need = _tensor_bytes()  # column blocks: the node needs every stored byte, once
    total_shared = sum(s[0] for s in shared)
    total_alone = sum(a[0] for a in alone)
    assert total_alone - total_shared == need, (total_alone, total_shared, need)  # alone: every rank reads all
    headers = total_shared - need  # safetensors headers, read by every rank that opens a file
    assert 0 < headers < 64 << 10, headers
    # every checksummed range checked once per node, not once per rank
    assert sum(s[1] for s in shared) * 2 == sum(a[1] for a in alone), out


def test_each_node_reads_its_needs_once(saved):
    """4 ranks on 2 simulated nodes (UNICKPT_NODE_ID): each node reads the bytes its two
    ranks need once."""
    nodes = ["n0", "n0", "n1", "n1"]
    out = dist.run(_both, 4, saved, nodes)
    assert all(o[0][2] and o[1][2] for o in out), out
    for node in (0, 1):
        shared = out[2 * node][0][0] + out[2 * node + 1][0][0]
        alone = out[2 * node][1][0] + out[2 * node + 1][1][0]
        need = _tensor_bytes()  # a node's two column blocks of 4 cover every 1 MiB block
        assert 0 < shared - need < 64 << 10 and alone - shared >= need // 2, (node, shared, alone, need)


def test_three_ranks_load_what_two_saved(saved):
    out = dist.run(_load_columns, 3, saved)
    assert all(o[2] for o in out), out


def _damage(root: str) -> None:
    """Flip one byte in the middle of tensor 'b' in its data file."""
    _, man = unickpt.read_manifest(root)
    st = man.tensors[("model", "b")]
    path = os.path.join(root, st.file)
    at = man.files[st.file].data_start + st.begin + (st.end - st.begin) // 2
    with open(path, "r+b") as f:
        f.seek(at)
        x = f.read(1)
        f.seek(at)
        f.write(bytes([x[0] ^ 0x10]))


def test_a_damaged_block_fails_every_rank_that_uses_it(saved, tmp_path):
    root = str(tmp_path / "ck")
    shutil.copytree(saved, root)
    _damage(root)
    out = dist.run(_load_columns, 2, root)
    for o in out:  # both ranks need bytes of the damaged block: both name it, whoever read it
        assert o[0] == "ChecksumError" and "'b'" in o[1], out


def _eio_on_block_reads(rank):
    """Rank 1 fails every read larger than a header (the shared rounds' reads)."""
    if rank != 1:
        return
    import unickpt.io.local as st

    real = st._Reader.readinto

    def readinto(self, offset, out):
        if len(memoryview(out)) > 256 << 10:
            raise OSError(errno.EIO, "injected", self.path)
        return real(self, offset, out)

    st._Reader.readinto = readinto


def test_an_io_error_in_a_shared_round_stops_every_rank_at_once(saved):
    """Rank 0 is told rank 1's error, not left to wait out timeout_s: 600 s, past the job's
    90 s (a hang guard only), and its error names rank 1, not a timeout."""
    out = dist.run(_load_columns, 2, saved, None, _eio_on_block_reads, 600, timeout=90)
    assert out[1][0] == "StorageError" and "injected" in out[1][1], out
    assert out[0][0] == "DistributedError" and "rank 1" in out[0][1], out
    assert not dist.waited_out(out[0][1]), out


def _no_shm_on_rank_0(rank):
    if rank == 0:
        import unickpt.noderead as nr

        nr.SHM_DIR = "/nonexistent-shm-dir"


def test_without_shared_memory_ranks_read_alone(saved):
    out = dist.run(_load_with_pid, 2, saved, None, _no_shm_on_rank_0)
    assert all(o[2] for o, _ in out), out
    assert sum(o[0] for o, _ in out) >= 2 * _tensor_bytes(), out  # each read everything itself
    assert not dist.shm_left_by({out[0][1]}) and not dist.shm_left_by({out[1][1]})


def test_a_segment_left_by_a_killed_load_is_removed_by_the_next(saved):
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that no longer runs
    stale = f"/dev/shm/unickpt-read-{p.pid}-0123456789abcdef"
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    old = os.stat(stale).st_mtime - shm.GRACE_S - 1  # (a sweep leaves alone what changed within GRACE_S)
    os.utime(stale, (old, old))
    out = dist.run(_load_columns, 2, saved)
    assert all(o[2] for o in out), out
    assert not os.path.exists(stale)


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_each_rank_streams_one_contiguous_share_of_the_union(saved, ranks, monkeypatch):
    """The node's plan: every rank reads one contiguous stretch of the union in file order
    (a sequential stream the kernel's read-ahead follows), the shares are balanced, a round's
    parts never overlap in the segment and each holds at most ROUND / ranks bytes (or one range)."""
    import numpy as np

    from unickpt import noderead
    from unickpt.manifest import Manifest

    monkeypatch.setattr(noderead, "ROUND", 2 << 20)  # several rounds of the 9 MiB union
    _, man = unickpt.read_manifest(saved)
    assert isinstance(man, Manifest)
    keys = list(man.tensors)
    needs = {t: np.ones(len(man.tensors[k].checksums), dtype=bool) for t, k in enumerate(keys)
             if man.tensors[k].checksums}
    plan = noderead._plan_node(list(range(ranks)), "t", needs, keys, man)
    size = plan.end - plan.begin
    assert int(size.sum()) == sum(e - b for k in keys for b, e, _ in man.tensors[k].checksums)
    assert (np.diff(plan.reader) >= 0).all()  # rank r's ranges all come before rank r + 1's
    shares = np.bincount(plan.reader, weights=size, minlength=ranks)
    assert shares.max() - shares.min() <= 2 * size.max()
    for r in range(ranks):  # within a share: rounds in order, parts packed from the rank's offset
        sel = plan.reader == r
        assert (np.diff(plan.round[sel]) >= 0).all()
        assert ((plan.seg[sel] >= plan.part[r]) & (plan.seg[sel] + size[sel] <= plan.part[r + 1])).all()
        assert plan.part[r + 1] - plan.part[r] <= max(noderead.ROUND // ranks, int(size.max())) + 4096
    assert plan.rounds > 1
    # needs in memory (page cache, tmpfs): pieces of WARM_PIECE per rank (at most ROUND / ranks)
    monkeypatch.setattr(noderead, "WARM_PIECE", 1 << 20)
    warm = noderead._plan_node(list(range(ranks)), "t", needs, keys, man, warm=True)
    assert (warm.begin == plan.begin).all() and (warm.reader == plan.reader).all()  # same shares, other rounds
    for r in range(ranks):
        assert warm.part[r + 1] - warm.part[r] <= max(min(1 << 20, noderead.ROUND // ranks), int(size.max())) + 4096
    assert warm.rounds >= plan.rounds and warm.size <= plan.size
    for k in range(plan.rounds):
        sel = np.flatnonzero(plan.round == k)
        order = sel[np.argsort(plan.seg[sel])]
        assert (plan.seg[order][1:] >= plan.seg[order][:-1] + size[order][:-1]).all()


def _load_recording_exchanges(rank, world, root, node_of):
    """_load_columns, recording what node-shared reads send over the group: the records
    all-gathered across the job and the peers of every point-to-point exchange."""
    import json

    from unickpt import transport

    seen = {"gathered": [], "peers": set()}
    gather, exchange = transport.Comm.all_gather_bytes, transport.Comm.exchange

    def all_gather_bytes(self, data, what=None):
        out = gather(self, data, what)
        if what == "load (node-shared reads)":
            seen["gathered"] += [json.loads(b) for b in out]
        return out

    def exch(self, sends, recvs):
        seen["peers"] |= {p for p, _ in sends} | {p for p, _ in recvs}
        return exchange(self, sends, recvs)

    transport.Comm.all_gather_bytes, transport.Comm.exchange = all_gather_bytes, exch
    return _load_columns(rank, world, root, node_of), seen


def test_needs_and_rounds_stay_inside_the_node(saved):
    """What a rank sends to every rank of the job is a small fixed record (no needs, which
    grow with the model); the needs, the rounds' flags and the checksum results only go to
    the ranks of its own node. So a rank's work does not grow with the number of nodes."""
    nodes = ["n0", "n0", "n1", "n1"]
    out = dist.run(_load_recording_exchanges, 4, saved, nodes)
    for rank, ((_, _, ok), seen) in enumerate(out):
        assert ok, out
        assert len(seen["gathered"]) == 4 and all(set(r) == {"node", "can", "token", "failed", "n", "verify", "cached",
                                                              "warm", "remote"}
                                                  for r in seen["gathered"]), seen
        mates = {r for r, n in enumerate(nodes) if n == nodes[rank] and r != rank}
        assert seen["peers"] == mates, (rank, seen)


def test_a_node_of_one_rank_reads_alone_while_the_other_node_shares(saved):
    """Nodes decide for themselves: n1's single rank reads alone at once (no rounds to wait
    for), n0's two ranks share; every result is bit-exact and n0 reads its needs once."""
    out = dist.run(_both, 3, saved, ["n0", "n0", "n1"])
    assert all(o[0][2] and o[1][2] for o in out), out
    assert out[2][0][0] == out[2][1][0]  # the lone rank reads the same with or without sharing
    shared, alone = out[0][0][0] + out[1][0][0], out[0][1][0] + out[1][1][0]
    assert shared < alone, (shared, alone)


# --- review: segment setup and teardown ---------------------------------------------------


def _tmpfs(path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` for the test (skipped where mounting is not allowed)."""
    import subprocess

    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture
def small_shm(tmp_path):
    """A 1 MiB tmpfs (a container's small /dev/shm): far less than a segment needs."""
    yield from _tmpfs(tmp_path / "small-shm", "1m")


def _set_shm_dir(path, rank):
    import unickpt.noderead as nr

    nr.SHM_DIR = path


def test_a_shared_memory_too_small_for_the_segment_reads_alone(saved, small_shm):
    """ftruncate on tmpfs reserves nothing: reads into the segment past the free space fail
    (EFAULT from preadv; SIGBUS for a reader that copies in user space). Out of space must
    mean "read alone", as the docs promise."""
    out = dist.run(_load_columns, 2, saved, None, functools.partial(_set_shm_dir, small_shm), timeout=60)
    assert all(o[2] is True for o in out), out
    assert sum(o[0] for o in out) >= 2 * _tensor_bytes(), out  # each read everything itself
    assert os.listdir(small_shm) == [], os.listdir(small_shm)


def _mmap_fails_on_rank_0(rank):
    if rank == 0:
        import types

        import unickpt.noderead as nr

        def fail(*a, **k):
            raise OSError(errno.ENOMEM, "injected")
        nr.mmap = types.SimpleNamespace(mmap=fail)


def _load_with_pid(rank, world, root, node_of=None, patch=None, timeout_s=20):
    return _load_columns(rank, world, root, node_of, patch, timeout_s), os.getpid()


def test_a_segment_that_cannot_be_mapped_is_not_left_behind(saved):
    out = dist.run(_load_with_pid, 2, saved, None, _mmap_fails_on_rank_0)
    assert all(o[0][2] is True for o in out), out  # read alone
    assert not dist.shm_left_by({out[0][1]}), dist.shm_left_by({out[0][1]})


def _fails_on(which: int, name: str, exc: BaseException, rank: int) -> None:
    """A patch for _load_columns: on rank ``which``, ``unickpt.noderead.<name>`` raises ``exc``."""
    if rank == which:
        import unickpt.noderead as nr

        def fail(*a, **k):
            raise exc

        setattr(nr, name, fail)


# rank 1 never reaches the segment's first exchange (an error of its own in between)
_rank_1_fails_before_the_segment = functools.partial(_fails_on, 1, "_plan_node", RuntimeError("injected before the segment"))


def test_a_segment_is_removed_when_a_peer_never_maps_it(saved):
    out = dist.run(_load_with_pid, 2, saved, None, _rank_1_fails_before_the_segment, 3, timeout=90)
    assert out[0][0][0] == "DistributedError" and "injected" in out[1][0][1], out
    assert not dist.shm_left_by({out[0][1]}), dist.shm_left_by({out[0][1]})


def _load_verify_per_rank(rank, world, root, verify_of):
    """Column blocks with a per-rank ``verify`` (rank 0 opts out, rank 1 checks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    tgt = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}}
    try:
        unickpt.load(tgt, root, timeout_s=20, verify=verify_of[rank])
    except Exception as e:
        return type(e).__name__, str(e)
    return "ok", str(all(torch.equal(tgt["model"][k].to_local(), v.tensor_split(world, dim=1)[rank])
                         for k, v in full.items()))


@pytest.mark.parametrize("verify_of", [("none", "auto"), ("auto", "none")])
def test_a_rank_that_verifies_never_returns_bytes_a_non_verifying_peer_read(saved, tmp_path, verify_of):
    """verify is a per-rank argument: the rank that asked for checks must get them, whoever
    read the bytes (alone it would raise ChecksumError for the damaged block)."""
    root = str(tmp_path / "ck")
    shutil.copytree(saved, root)
    _damage(root)
    out = dist.run(_load_verify_per_rank, 2, root, verify_of)
    checker = verify_of.index("auto")
    assert out[checker][0] in ("ChecksumError", "DistributedError") and "'b'" in out[checker][1], out


def _fake_manifest(ranges_per_tensor):
    """A manifest-like object for the planner: one tensor per list of checksummed range sizes."""
    import types

    tensors, off = {}, 0
    for i, sizes in enumerate(ranges_per_tensor):
        cs, b = [], 0
        for n in sizes:
            cs.append((b, b + n, "0"))
            b += n
        tensors[("model", str(i))] = types.SimpleNamespace(file="f", begin=off, checksums=cs)
        off += b
    return types.SimpleNamespace(tensors=tensors)


@pytest.mark.parametrize("ranks", [3, 5, 8, 16])
@pytest.mark.parametrize("ranges", [[[8 << 20]], [[4096] * 3] * 50, [[1 << 20] * 4] * 64])
def test_the_segment_is_never_more_than_the_docs_say(ranks, ranges):
    """Segment bytes <= BUFFERS x ROUND (docs: 4 x 32 MiB) plus a page per part, and never
    more than BUFFERS times the union (plus pages): one 8 MiB range on 8 ranks took 256 MiB."""
    import numpy as np

    from unickpt import noderead

    man = _fake_manifest(ranges)
    keys = list(man.tensors)
    needs = {t: np.ones(len(man.tensors[k].checksums), dtype=bool) for t, k in enumerate(keys)}
    plan = noderead._plan_node(list(range(ranks)), "t", needs, keys, man)
    union = int((plan.end - plan.begin).sum())
    size = plan.size
    assert size <= noderead.BUFFERS * (noderead.ROUND + ranks * 4096), (size >> 20, union >> 20)
    assert size <= noderead.BUFFERS * (union + ranks * 4096), (size >> 20, union >> 20)


_scatter_fails_on_rank_1 = functools.partial(_fails_on, 1, "copy_window", MemoryError("injected in the scatter"))


def test_a_failed_scatter_stops_the_node_at_the_next_round_not_at_the_timeout(saved):
    """An error while copying a round into this rank's targets is told to the node's ranks at
    the next round's flags (or raised after the last round): no peer waits out timeout_s
    (600 s, past the job's 90 s: a hang guard only; the error names rank 1, not a timeout)."""
    out = dist.run(_load_columns, 2, saved, None, _scatter_fails_on_rank_1, 600, timeout=90)
    assert out[1][0] == "MemoryError" and "injected" in out[1][1], out
    assert out[0][0] == "DistributedError" and "rank 1" in out[0][1], out
    assert not dist.waited_out(out[0][1]), out


def _needs_understated(rank):
    """Every rank sends the node only the first half of each stretch of ranges it needs."""
    import unickpt.noderead as nr

    real = nr._intervals
    nr._intervals = lambda mask: [[a, a + max(1, (b - a) // 2)] for a, b in real(mask)]


def test_a_target_the_union_does_not_cover_is_read_alone_not_reported_done(saved):
    """The union the node reads is built from what its ranks said they need; a target needing
    ranges outside it is read alone (bit-exact), never marked done with bytes nobody read."""
    out = dist.run(_load_columns, 3, saved, None, _needs_understated)
    assert all(o[2] is True for o in out), out


def _in_scatter_on_rank_1(action: str, rank: int, release: str | None = None) -> None:
    """A patch for _load_columns: rank 1, at its third scatter of a shared round, kills itself
    (``"kill"``: SIGKILL, no chance to tell anyone) or stalls (``"stall"``) until the file
    ``release`` exists (300 s at most: past any job's limit here)."""
    if rank != 1:
        return
    import signal

    import unickpt.noderead as nr

    real, calls = nr.copy_window, [0]

    def hook(*a, **k):
        calls[0] += 1
        if calls[0] == 3:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            for _ in range(3000):  # "stall"
                if os.path.exists(release):
                    break
                time.sleep(0.1)
        return real(*a, **k)

    nr.copy_window = hook


def test_a_peer_killed_during_the_rounds_fails_its_node_mates_at_once(saved):
    """The ranks of a node meet through status words in shared memory, not messages: a peer
    killed between two of them can tell nobody. Its mates notice that its process is gone
    within a poll and raise DistributedError naming it, long before timeout_s (600 s, past the
    job's 90 s: a hang guard only)."""
    out = dist.run(_load_with_pid, 2, saved, None, functools.partial(_in_scatter_on_rank_1, "kill"), 600,
                   timeout=90, may_die={1})
    assert out[1] is None, out  # killed
    (got, pid0) = out[0]
    assert got[0] == "DistributedError" and "[1]" in got[1] and "exited" in got[1], out  # seen dead, not timed out
    assert not dist.waited_out(got[1]), out
    assert not dist.shm_left_by({pid0})  # the node's first rank (rank 0) created the segment: it is gone


def _load_columns_then_release(rank, world, root, patch, timeout_s, release):
    """_load_columns; then rank 0 creates the file ``release`` (which a stalled rank 1 waits for)."""
    got = _load_columns(rank, world, root, None, patch, timeout_s)
    if rank == 0:
        open(release, "w").close()
    return got


def test_a_peer_stalled_in_the_rounds_fails_its_node_mates_at_timeout_s(saved, tmp_path):
    """A live peer that makes no progress (stopped, swapped out, stuck in a scatter) holds
    its mates up for timeout_s at most: then they raise DistributedError naming it. Rank 1
    stalls until rank 0 has raised: rank 0's error cannot come from rank 1 going on."""
    release = str(tmp_path / "release")
    stall = functools.partial(_in_scatter_on_rank_1, "stall", release=release)
    out = dist.run(_load_columns_then_release, 2, saved, stall, 2, release, timeout=90)  # a hang guard only
    assert out[0][0] == "DistributedError" and "[1]" in out[0][1] and "within 2 s" in out[0][1], out  # the timeout
    assert out[1][0] == "DistributedError", out  # rank 0's failure reaches it once it resumes


def _prefetch_fails(rank: int) -> None:
    """Every prefetch hint fails (EIO) and is recorded."""
    import unickpt.io.local as st

    def prefetch(self, offset, n):
        os.environ["UNICKPT_TEST_PREFETCHED"] = "1"
        raise OSError(errno.EIO, "injected", self.path)

    st._Reader.prefetch = prefetch


def _load_columns_prefetch_failing(rank, world, root):
    got = _load_columns(rank, world, root, None, _prefetch_fails)
    return got, os.environ.get("UNICKPT_TEST_PREFETCHED")


def test_a_failing_prefetch_hint_changes_nothing(saved):
    """The first rounds' bytes are hinted to the kernel while the segment is set up; a hint
    that fails is only a hint: the load is bit-exact and reads what it reads without it."""
    out = dist.run(_load_columns_prefetch_failing, 2, saved)
    assert all(o[0][2] is True and o[1] == "1" for o in out), out
    assert sum(o[0][0] for o in out) == sum(o[0] for o in dist.run(_load_columns, 2, saved)), out


@pytest.fixture
def shm_5m(tmp_path):
    """A 5 MiB tmpfs: room for the status words and the first 4 MiB round buffer, not more."""
    yield from _tmpfs(tmp_path / "shm-5m", "5m")


def _small_rounds_in(path, rank):
    """Rounds of 4 MiB (3 buffers for the 9 MiB union) in ``path``; records that the
    creator's background reservation ran."""
    import unickpt.noderead as nr

    nr.SHM_DIR, nr.ROUND, nr.WARM_PIECE = path, 4 << 20, 2 << 20  # (the files are in the page cache)
    real = shm._reserve_chunks

    def reserve(fd, chunks, word):
        real(fd, chunks, word)
        os.environ["UNICKPT_TEST_RESERVED"] = "ran"

    shm._reserve_chunks = reserve


def _load_columns_reserving(rank, world, root, path):
    got = _load_columns(rank, world, root, None, functools.partial(_small_rounds_in, path), 600)
    return got, os.environ.get("UNICKPT_TEST_RESERVED")


def test_a_shared_memory_that_runs_out_while_the_segment_grows_reads_alone(saved, shm_5m):
    """The node's first rank reserves the first round's buffer before anyone maps the
    segment and the rest on a thread, while the first rounds are read; when /dev/shm runs
    out meanwhile, no rank can finish the rounds, and every rank reads alone: bit-exact, in
    no more time than it takes (no rank waits out timeout_s: 600 s, past the job's 60 s, a
    hang guard only), nothing left in /dev/shm."""
    out = dist.run(_load_columns_reserving, 2, saved, shm_5m, timeout=60)
    assert out[0][1] == "ran", out  # the creator's reservation thread ran (and failed: 5 MiB)
    assert all(o[0][2] is True for o in out), out
    assert sum(o[0][0] for o in out) >= 2 * _tensor_bytes(), out  # each read everything itself
    assert os.listdir(shm_5m) == [], os.listdir(shm_5m)


def _tiny_rounds(buffers, ranks, rank):
    """Rounds of 4 MiB (one or two 1 MiB ranges per rank) in ``buffers`` buffers: the 9 MiB
    union takes more rounds than there are buffers, so every buffer is read into again."""
    import unickpt.noderead as nr

    nr.ROUND, nr.BUFFERS, nr.WARM_PIECE = 4 << 20, buffers, (4 << 20) // ranks  # (the files are in the page cache)


@pytest.mark.parametrize("ranks,buffers", [(2, 2), (3, 2), (3, 3)])
def test_buffers_are_reused_round_after_round(saved, ranks, buffers):
    """More rounds than buffers: a rank reads into a buffer again only once every rank of
    the node scattered the round it held; bit-exact, each needed byte read once per node."""
    out = dist.run(_load_columns, ranks, saved, None, functools.partial(_tiny_rounds, buffers, ranks), 20, timeout=60)
    assert all(o[2] is True for o in out), out
    need = _tensor_bytes()
    assert 0 <= sum(o[0] for o in out) - need < 64 << 10, out


def _eio_seen_as_a_flag_first(rank):
    """Rank 1: its shared reads fail (EIO) after 20 ms, and its polls check the node's
    failure flags 50 ms late: so its own read error is first seen as its own failure flag
    (a GIL switch between the two checks does the same, rarely)."""
    if rank != 1:
        return
    import unickpt.noderead as nr
    import unickpt.io.local as st

    real_read = st._Reader.readinto

    def readinto(self, offset, out):
        if len(memoryview(out)) > 256 << 10:
            time.sleep(0.02)
            raise OSError(errno.EIO, "injected", self.path)
        return real_read(self, offset, out)

    st._Reader.readinto = readinto
    real_failed = nr._Status.failed

    def failed(self):
        time.sleep(0.05)
        return real_failed(self)

    nr._Status.failed = failed


def test_a_read_error_is_raised_however_the_rank_first_sees_it(saved):
    """From a review: when the failing rank's poll saw its own failure flag before its own
    error, every rank returned as if a peer had failed, nobody raised, and the load
    'succeeded' with unread targets. The rank whose read failed always raises its error."""
    out = dist.run(_load_columns, 2, saved, None, _eio_seen_as_a_flag_first, timeout=90)
    assert out[1][0] == "StorageError" and "injected" in out[1][1], out
    assert out[0][0] == "DistributedError" and "rank 1" in out[0][1], out


def _segment_still_mapped(rank, world, root):
    import gc

    got = _load_columns(rank, world, root)
    gc.disable()  # while waiting, no collection may free what only a garbage collection would
    try:
        for _ in range(600):  # the unmap runs on a thread: 60 s, a hang guard only (it takes milliseconds)
            left = [line for line in open("/proc/self/maps") if "unickpt-read-" in line]
            if not left:
                break
            time.sleep(0.1)
    finally:
        gc.enable()
    return got, left


def test_the_segment_is_unmapped_when_the_load_returns(saved):
    """From a review: a reference cycle through the rounds' closures kept a view of the
    segment alive, so it stayed mapped (its /dev/shm pages held) until a garbage collection."""
    out = dist.run(_segment_still_mapped, 2, saved)
    assert all(o[0][2] is True and o[1] == [] for o in out), out


def test_a_zombie_is_a_dead_process():
    """A node mate killed and not yet reaped by its launcher still has /proc/PID/stat with its
    start time: it counts as gone (else its mates wait out timeout_s)."""
    import subprocess
    import sys

    from unickpt import liveness

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # until it exited, left unreaped: a zombie
    with open(f"/proc/{p.pid}/stat", "rb") as f:
        assert f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    assert liveness.start_ticks(p.pid) is None  # (what the node's status words are checked with)
    assert liveness.start_ticks(os.getpid()) is not None
    assert liveness.start_time(p.pid) is None  # (and what owner records are checked with)
    p.wait()


def _load_rows(rank, world, root, cached=None):
    """Load every matrix as row blocks (Shard(0), the saved layout: long runs, every rank's
    stretches interleaved with the others' in the files). ``cached``: what the readers'
    page-cache probe answers (None: the real probe). Returns (ok, whether the node shared,
    bytes read) or the error's type and message."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import unickpt.noderead as nr
    import unickpt.io.local as st

    if cached is not None:
        st._Reader.resident = lambda self, offset, n: n if cached else 0
    ran = []
    real = nr._rounds
    nr._rounds = lambda *a, **k: ran.append(1) or real(*a, **k)
    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    tgt = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()}}
    try:
        res = unickpt.load(tgt, root, timeout_s=20)
    except Exception as e:
        return type(e).__name__, str(e)
    ok = all(torch.equal(tgt["model"][k].to_local(), distribute_tensor(v, mesh, [Shard(0)]).to_local())
             for k, v in full.items())
    return ok, bool(ran), res.bytes_read


@pytest.mark.parametrize("ranks", [2, 3])
def test_interleaved_row_blocks_are_read_through_the_node_from_disk_and_alone_from_the_cache(saved, ranks):
    """Row blocks of every matrix: each rank's needs are stretches of the files that the other
    ranks' stretches separate. From disk the node reads them as one contiguous share per rank
    (sequential streams, large requests); from the page cache every rank reads its own."""
    cold = dist.run(_load_rows, ranks, saved, False)
    warm = dist.run(_load_rows, ranks, saved, True)
    assert all(o[0] is True and o[1] for o in cold), cold
    # (3 ranks: the 1 MiB ranges at block boundaries of these small matrices are needed by two
    # ranks each; long runs no longer count toward MIN_OVERLAP, so they are read alone too,
    # but the check leaves 3 ranks free either way)
    assert all(o[0] is True and (ranks == 3 or not o[1]) for o in warm), warm
    need = _tensor_bytes()
    assert 0 <= sum(o[2] for o in cold) - need < 64 << 10, cold  # each needed byte read once per node


def test_a_damaged_block_of_a_shared_row_block_fails_the_rank_that_needs_it(saved, tmp_path):
    root = str(tmp_path / "ck")
    shutil.copytree(saved, root)
    _damage(root)  # the middle of 'b': in rank 1's row block of 2, read by rank 0 or 1
    out = dist.run(_load_rows, 2, root, False)
    assert out[1][0] == "ChecksumError" and "'b'" in out[1][1], out
    assert out[0][0] is not True, out  # the load failed on every rank


def test_only_needs_cut_into_short_stretches_count_as_interleaved():
    """A rank whose needs are long stretches (whole files, whole tensors) streams them alone;
    one that would read at least half of its bytes in stretches shorter than STRETCH does not."""
    from unickpt import noderead
    from unickpt.manifest import TensorEntry

    ranges = 8
    block = noderead.STRETCH // ranges  # one tensor: STRETCH bytes in 8 checksummed ranges
    sums = tuple((k * block, (k + 1) * block, "0") for k in range(ranges))
    man = type("Man", (), {"tensors": {}})()
    for f in range(2):
        for i in range(4):
            begin = i * (noderead.STRETCH + 4096)  # tensors padded apart: still one stretch
            man.tensors[("m", f"t{f}{i}")] = TensorEntry("m", f"t{f}{i}", f"f{f}", "F32", (block // 4 * ranges,),
                                                         begin, begin + noderead.STRETCH, sums)
    keys = list(man.tensors)
    whole = {r: [(t, 0, ranges) for t in range(len(keys)) if t // 4 == r] for r in range(2)}
    assert not noderead._interleaved(whole, keys, man)  # each rank: one file, front to back
    halves = {r: [(t, r * ranges // 2, (r + 1) * ranges // 2) for t in range(len(keys))] for r in range(2)}
    assert noderead._interleaved(halves, keys, man)  # each rank: half of every tensor
    # one long stretch and a few short ones: most bytes stream, so not interleaved
    mixed = {0: [(t, 0, ranges) for t in range(4)] + [(t, 0, 1) for t in range(4, 8)], 1: []}
    assert not noderead._interleaved(mixed, keys, man)


def test_the_ranges_a_target_touches_are_those_its_byte_runs_overlap():
    """``noderead.touched`` (one search per checksummed range among the runs, sorted first
    when they are not in order) marks exactly the ranges the loader's stream check would widen
    the runs to, for runs in order, out of order, overlapping, empty, at range edges and inside
    one range."""
    import numpy as np

    from unickpt import noderead
    from unickpt.loading.verify import StreamCheck as _StreamCheck

    rng = np.random.default_rng(5)
    for trial in range(300):
        cuts = np.unique(rng.integers(1, 4000, size=int(rng.integers(0, 12))))
        edges = np.concatenate(([0], cuts, [4000])).tolist()
        sums = [(a, b, "0") for a, b in zip(edges[:-1], edges[1:])]
        pts = np.sort(rng.choice(4000, size=2 * int(rng.integers(1, 20)), replace=False))
        b, e = pts[0::2].astype(np.int64), pts[1::2].astype(np.int64)
        if trial % 3 == 1:  # out of order
            p = rng.permutation(len(b))
            b, e = b[p], e[p]
        if trial % 5 == 2:  # an empty run, which touches nothing
            e[0] = b[0]
        if trial % 7 == 3:  # a run on a range's edges
            b[0], e[0] = edges[0], edges[1]
        want = _StreamCheck(sums)
        want.touch_runs(b, e)
        got = noderead.touched(noderead.bounds(type("St", (), {"checksums": sums})()), b, e)
        assert got.tolist() == want.touched.tolist(), (sums, b.tolist(), e.tolist())
    st = type("St", (), {"checksums": [(0, 10, "0"), (10, 20, "0"), (20, 30, "0")]})()
    for runs, want in (([(10, 15)], [False, True, False]), ([(5, 10), (20, 21)], [True, False, True]),
                       ([(9, 11)], [True, True, False]), ([(29, 30)], [False, False, True]),
                       ([(0, 25), (5, 8)], [True, True, True]), ([(12, 14), (0, 5)], [True, True, False])):
        b, e = (np.array(x, dtype=np.int64) for x in zip(*runs))
        assert noderead.touched(noderead.bounds(st), b, e).tolist() == want, runs


def test_the_page_cache_probe_sees_what_was_read_and_reads_nothing(tmp_path):
    """``_Reader.resident`` (mmap + mincore): 0 after the file's pages were dropped, all of
    them once read, and asking reads nothing."""
    from unickpt.io import local as storage

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    r = storage._Reader(str(path))
    try:
        if r.resident(0, r.size) == r.size:
            pytest.skip("this filesystem keeps every page in memory (tmpfs)")
        assert r.resident(0, r.size) == 0
        assert r.resident(0, r.size) == 0 and r.bytes_read == 0  # the probe faulted nothing in
        r.readinto(1 << 20, memoryview(bytearray(1 << 20)))
        assert r.resident(1 << 20, 1 << 20) == 1 << 20
        assert r.resident(5, 100) in (0, 4096)  # partial pages count whole
    finally:
        r.close()


def _mixed_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {"small": torch.randn(768, 1024, generator=g), "big": torch.randn(4096, 1024, generator=g)}


_MIXED = {"small": 1, "big": 0}  # small as column blocks (overlap), big as row blocks (long runs)


def _save_mixed(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    unickpt.save({"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _mixed_full().items()}}, root)


def _load_mixed(rank, world, root):
    """'small' as column blocks (every rank touches every range: overlap), 'big' as row blocks
    (long runs, disjoint, most of the bytes), from the page cache (the probe says so)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import unickpt.io.local as st

    st._Reader.resident = lambda self, offset, n: n
    mesh = init_device_mesh("cpu", (world,))
    full = _mixed_full()
    tgt = {"model": {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(_MIXED[k])]) for k, v in full.items()}}
    res = unickpt.load(tgt, root, timeout_s=20)
    ok = all(torch.equal(tgt["model"][k].to_local(), distribute_tensor(v, mesh, [Shard(_MIXED[k])]).to_local())
             for k, v in full.items())
    return ok, res.bytes_read


def test_long_runs_read_alone_do_not_stop_the_node_sharing_overlapping_column_blocks(tmp_path):
    """The overlap rule counts the short-run needs alone: row blocks read alone (cached) next to
    column blocks still leave every needed byte read once per node."""
    root = str(tmp_path / "ck")
    dist.run(_save_mixed, 2, root)
    out = dist.run(_load_mixed, 2, root)
    assert all(o[0] for o in out), out
    need = sum(v.numel() * 4 for v in _mixed_full().values())
    assert 0 <= sum(o[1] for o in out) - need < 64 << 10, (out, need)
