"""Node-shared reads: the ranks of one node read each byte range they need once.

When several ranks of a node need interleaved pieces of the same stored bytes (column
blocks of row-major tensors: every rank needs a slice of every row), independent reads move
the same bytes through read calls once per rank and hash them once per rank. Instead, the
ranks of a node agree on the union of the checksummed ranges they need and read it once:

1. One all-gather of a small record per rank: its node, whether it can map shared memory,
   and the length of its needs: the checksummed ranges (indices into
   ``TensorEntry.checksums``) its short-run targets touch. The needs themselves go only to
   the other ranks of the node (point to point), and every exchange after this one stays
   inside the node, so a rank's work does not grow with the number of nodes. The ranks of
   a node compute the same plan from the same inputs, so the plan needs no agreement.
2. A node shares only when it pays: at least two ranks, and the ranks' needs add up to
   more than :data:`MIN_OVERLAP` times their union. Otherwise its ranks read alone.
3. The node's lowest rank creates a shared-memory segment (``/dev/shm``, mode 0600,
   unlinked as soon as every rank of the node has mapped it) of :data:`BUFFERS` buffers
   of about :data:`ROUND` bytes. The union (in file order) is cut into one contiguous share
   per rank of about equal bytes, at checksummed-range boundaries, so each rank streams
   through its own part of the files as a sequential reader (the kernel's read-ahead
   follows it; shares striped through every round defeat it and read at about half the
   speed here). Each share is cut into pieces of ``ROUND / ranks`` bytes; round ``k`` is
   every rank's ``k``-th piece, read into its part of buffer ``k % BUFFERS`` and hashed
   (in the reading thread). After one exchange of failure flags between the node's ranks
   (a failing rank stops every rank of its node at the next round; the other nodes learn
   of it at the load's agreement that follows the reads, within the timeout) every rank
   scatters round ``k`` into its own targets while the next rounds are being read.
4. The ranges whose checksum did not match are exchanged within the node at the end; every
   rank that used bytes of such a tensor reports it (``ChecksumError`` naming file and tensor).

Bytes through read calls per node = bytes of the checksummed ranges its ranks need (each
counted once); each range is hashed once, by the rank that read it. A rank returns bytes
that a rank of its own node read and verified (same job, same node, a 0600 segment).
Where shared memory cannot be set up (no ``/dev/shm``, out of space), every rank falls back
to reading alone: sharing changes speed, never results.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ._copy import copy_window
from ._metrics import log
from .format import Hasher
from .layout import Runs
from .manifest import Manifest, TensorEntry
from .transport import Comm, node_id

__all__ = ["SharedJob", "read_shared", "ROUND", "MIN_OVERLAP", "enabled"]

ROUND = 32 << 20
"""Bytes a node reads per round."""
BUFFERS = 4
"""Rounds held by the segment: one being scattered, one whose sync is pending, and
``BUFFERS - 2`` read ahead (the reads in flight per rank)."""
MIN_OVERLAP = 1.25
"""A node shares its reads when its ranks' needs add up to at least this many times their union."""
PIECE = 8 << 20  # one read call at most
SHM_DIR = "/dev/shm"


def enabled() -> bool:
    """Node-shared reads are on unless ``UNICKPT_NODE_SHARED_READS=0``."""
    return os.environ.get("UNICKPT_NODE_SHARED_READS", "1") != "0"


@dataclass
class SharedJob:
    """One short-run target: its runs in ``st``'s bytes and which checksummed ranges they touch."""

    st: TensorEntry
    reader: object  # RandomReader of st.file
    base: int  # file offset of st's first byte
    runs: Runs
    isz: int
    dest: torch.Tensor  # flat uint8: the target's bytes
    touched: np.ndarray  # bool per st.checksums range
    done: Callable[[tuple[bool, int]], None]

    def __post_init__(self) -> None:
        self.ends = self.runs.starts + self.runs.lengths  # once, not per round


def eligible(st: TensorEntry, isz: int) -> bool:
    """A tensor can be read shared when its checksummed ranges are small enough to pack into
    rounds and start on element boundaries (so a range never splits an element)."""
    if st.codec != "raw" or not st.checksums:
        return False
    b = np.fromiter((c[0] for c in st.checksums), dtype=np.int64, count=len(st.checksums))
    e = np.fromiter((c[1] for c in st.checksums), dtype=np.int64, count=len(st.checksums))
    return bool(int((e - b).max()) <= ROUND // 4 and not (b % isz).any())


def _intervals(mask: np.ndarray) -> list[list[int]]:
    """``[start, end)`` of the true stretches of a bool array."""
    d = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    return np.stack([np.flatnonzero(d == 1), np.flatnonzero(d == -1)], axis=1).tolist()


@dataclass
class _NodePlan:
    ranks: list[int]  # the node's ranks, ascending; ranks[0] creates the segment
    token: str
    # one row per checksummed range of the union, in read order
    tensor: np.ndarray  # index into the manifest's tensor keys
    rng: np.ndarray  # index into that tensor's checksums
    begin: np.ndarray  # bytes, relative to the tensor
    end: np.ndarray
    round: np.ndarray
    seg: np.ndarray  # offset in the round's buffer
    reader: np.ndarray  # position in ranks of the rank that reads it
    rounds: int
    part: np.ndarray  # rank i's part of a round's buffer: [part[i], part[i + 1]); part[-1]: the buffer
    buffers: int  # round buffers in the segment: BUFFERS, or fewer when there are fewer rounds

    @property
    def size(self) -> int:
        """Bytes of the node's segment."""
        return self.buffers * int(self.part[-1])


def _plan_node(ranks: list[int], token: str, needs: dict[int, np.ndarray], keys: list, man: Manifest) -> _NodePlan:
    cols: dict[str, list] = {k: [] for k in ("tensor", "rng", "begin", "end")}
    order = sorted(needs, key=lambda t: (man.tensors[keys[t]].file, man.tensors[keys[t]].begin))
    for t in order:
        st = man.tensors[keys[t]]
        idx = np.flatnonzero(needs[t])
        cols["tensor"].append(np.full(len(idx), t, dtype=np.int64))
        cols["rng"].append(idx)
        cols["begin"].append(np.array([st.checksums[i][0] for i in idx.tolist()], dtype=np.int64))
        cols["end"].append(np.array([st.checksums[i][1] for i in idx.tolist()], dtype=np.int64))
    tensor, rng, begin, end = (np.concatenate(cols[k]) if cols[k] else np.zeros(0, np.int64)
                               for k in ("tensor", "rng", "begin", "end"))
    size = end - begin
    m = len(ranks)
    # the union cut into m contiguous shares of about equal bytes, one per rank: each rank
    # streams through its own part of the files, as one sequential reader would (the kernel's
    # read-ahead follows it); stripes of every round interleaved between ranks defeat it
    cum = np.cumsum(size) - size // 2
    total = int(size.sum())
    reader = np.minimum(cum * m // max(total, 1), m - 1).astype(np.int64)
    # each rank fills an equal part of a round's buffer (at least the largest range: a range is never split)
    sub = max(ROUND // m, int(size.max()) if len(size) else 0)
    rnd = np.zeros(len(size), dtype=np.int64)
    within = np.zeros(len(size), dtype=np.int64)
    rounds = 0
    fill = np.zeros(m, dtype=np.int64)
    for r in range(m):  # round k of rank r: the k-th sub-slot's worth of its share, first fit in order
        sel = np.flatnonzero(reader == r)
        k, used = 0, 0
        for i, n in zip(sel.tolist(), size[sel].tolist()):
            if used + n > sub and used:
                k, used = k + 1, 0
            rnd[i], within[i] = k, used
            used += n
            fill[r] = max(fill[r], used)
        if len(sel):
            rounds = max(rounds, k + 1)
    # each rank's part as large as it fills (page-aligned): a rank with a small share, or none,
    # takes no more (every part sized for the largest range made the segment ranks x that)
    part = np.concatenate(([0], np.cumsum(-(-fill // 4096) * 4096))).astype(np.int64)
    seg = part[reader] + within
    return _NodePlan(ranks, token, tensor, rng, begin, end, rnd, seg, reader, rounds, part,
                     max(1, min(BUFFERS, rounds)))


class _Segment:
    """The node's shared buffers: created by the node's first rank, mapped by the others."""

    def __init__(self, path: str, size: int, create: bool) -> None:
        self.path, self.size, self.created = path, size, create
        self.map: mmap.mmap | None = None
        flags = os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                # reserve the pages now: ftruncate reserves nothing on tmpfs, and a read into a
                # page /dev/shm has no room for fails (EFAULT) or kills the process (SIGBUS)
                os.posix_fallocate(fd, 0, size)
            st = os.fstat(fd)
            if st.st_size != size or st.st_uid != os.getuid():
                raise OSError(f"{path}: not the segment this load created")
            self.map = mmap.mmap(fd, size)
            self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        except BaseException:
            self.close()  # nothing left behind in /dev/shm by a segment that failed
            raise
        finally:
            os.close(fd)

    def unlink(self) -> None:
        if self.created:
            self.created = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        self.bytes = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view still exists: the mapping goes with the last one
                pass
            self.map = None


def _sweep_dead() -> None:
    """Remove segments left by loads whose creating process is gone (killed between creating
    its segment and unlinking it, two exchanges later). A live creator in another PID
    namespace looks dead: its peers then fail to map the segment and read alone."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith("unickpt-read-")]
    except OSError:
        return
    for n in names:
        pid = n[len("unickpt-read-"):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(SHM_DIR, n))
            except OSError:
                pass
        except OSError:  # alive (another user's process): not ours to judge
            pass


class _Node:
    """The ranks of this node, and the exchanges among them: point to point on the load's
    group, so nothing here grows with the number of nodes (a round costs ``ranks - 1`` small
    messages per rank, never a collective over the whole job)."""

    def __init__(self, comm: Comm, ranks: list[int]) -> None:
        self.comm, self.ranks = comm, ranks
        self.peers = [r for r in ranks if r != comm.rank]

    def _swap(self, mine: torch.Tensor, sizes: dict[int, int]) -> dict[int, torch.Tensor]:
        recvs = [(p, torch.empty(sizes[p], dtype=mine.dtype)) for p in self.peers]
        self.comm.exchange([(p, mine) for p in self.peers], recvs)
        return dict(recvs)

    def any_failed(self, failed: bool) -> bool:
        """True on every rank of the node when any of them failed."""
        got = self._swap(torch.tensor([1 if failed else 0], dtype=torch.int64), dict.fromkeys(self.peers, 1))
        return failed or any(int(t.item()) for t in got.values())

    def gather(self, data: bytes, sizes: dict[int, int] | None = None) -> dict[int, bytes]:
        """Every node rank's bytes (``sizes``: their lengths, when already known)."""
        if sizes is None:
            n = self._swap(torch.tensor([len(data)], dtype=torch.int64), dict.fromkeys(self.peers, 1))
            sizes = {p: int(t.item()) for p, t in n.items()}
        mine = torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)
        got = self._swap(mine, {p: max(sizes[p], 1) for p in self.peers})
        out = {p: bytes(t[: sizes[p]].numpy().tobytes()) for p, t in got.items()}
        out[self.comm.rank] = bytes(data)
        return out


def read_shared(comm: Comm, jobs: list[SharedJob], man: Manifest, files, pool, verify: bool, failed: bool
                ) -> tuple[int, list[SharedJob], bool]:
    """Collective over ``comm``: read ``jobs`` with the other ranks of this node.

    Every rank calls it exactly once per load (with ``failed=True`` when its own reads
    already failed: then every rank returns at once). ``files.get(name)`` opens readers,
    ``pool`` runs the reads. Returns ``(ranges verified here, jobs left to read alone,
    aborted)``: ``aborted`` means some rank failed and nothing more should be read."""
    keys = list(man.tensors)
    index = {k: i for i, k in enumerate(keys)}
    need: dict[int, np.ndarray] = {}
    for j in jobs:
        t = index[j.st.key]
        need[t] = need.get(t, np.zeros(len(j.st.checksums), dtype=bool)) | j.touched
    can = enabled() and os.path.isdir(SHM_DIR)
    blob = json.dumps([[t, a, b] for t, m in sorted(need.items()) for a, b in _intervals(m)]).encode()
    me = {"node": node_id(), "can": can, "token": f"{os.getpid()}-{secrets.token_hex(8)}", "failed": failed,
          "n": len(blob), "verify": verify}
    # a small record from every rank; the needs themselves travel only between the node's ranks
    all_ = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(me).encode(), "load (node-shared reads)")]
    if any(d["failed"] for d in all_):
        return 0, [], True
    ranks = [r for r, d in enumerate(all_) if d["node"] == me["node"]]
    # every rank of the node decides the same from the same records; ranks that disagree on
    # verify read alone (a rank that checks never returns bytes a non-checking peer read)
    if len(ranks) < 2 or not all(all_[r]["can"] and all_[r]["verify"] == all_[ranks[0]]["verify"] for r in ranks):
        return 0, jobs, False
    node = _Node(comm, ranks)
    needs = node.gather(blob, {r: all_[r]["n"] for r in ranks})
    union: dict[int, np.ndarray] = {}
    asked = 0
    for r in ranks:
        try:
            descr = json.loads(needs[r])
        except ValueError:
            descr = None
        for item in descr if isinstance(descr, list) else []:
            if not (isinstance(item, list) and len(item) == 3 and all(type(x) is int for x in item)):
                continue  # not what a rank of this version sends: it adds nothing to the union
            t, a, b = item
            if not (0 <= t < len(keys)) or not (0 <= a < b <= len(man.tensors[keys[t]].checksums)):
                continue
            m = union.setdefault(t, np.zeros(len(man.tensors[keys[t]].checksums), dtype=bool))
            m[a:b] = True
            asked += sum(c[1] - c[0] for c in man.tensors[keys[t]].checksums[a:b])
    total = sum(sum(c[1] - c[0] for c, u in zip(man.tensors[keys[t]].checksums, m.tolist()) if u)
                for t, m in union.items())
    if not total or asked < MIN_OVERLAP * total:
        return 0, jobs, False
    plan = _plan_node(ranks, all_[ranks[0]]["token"], union, keys, man)

    # the segment: created by the node's first rank, opened by the others, then unlinked
    seg: _Segment | None = None
    err = False
    size = plan.size
    path = os.path.join(SHM_DIR, f"unickpt-read-{plan.token}")
    try:
        try:
            if comm.rank == plan.ranks[0]:
                _sweep_dead()
                seg = _Segment(path, size, create=True)
        except OSError as e:
            log.info("node-shared reads off: cannot create %s (%s)", path, e)
            err = True
        if not node.any_failed(err):
            try:
                if seg is None:
                    seg = _Segment(path, size, create=False)
            except OSError as e:
                log.info("node-shared reads off: cannot map %s (%s)", path, e)
                err = True
            err = node.any_failed(err)
        else:
            err = True
    except BaseException:  # a peer that never answered (DistributedError): the segment goes too
        if seg is not None:
            seg.close()
        raise
    if seg is not None:
        seg.unlink()  # every rank of the node mapped it (or gave up): nothing left in /dev/shm
    if err:  # sharing is only speed: everyone reads alone
        if seg is not None:
            seg.close()
        return 0, jobs, False
    # a target the union does not cover whole (never, with the needs this rank sent) is read
    # alone: marking it done after the rounds would return bytes nobody read
    def covered(j: SharedJob) -> bool:
        m = union.get(index[j.st.key])
        return m is not None and len(m) == len(j.touched) and not (j.touched & ~m).any()

    try:
        checked, aborted = _rounds(comm, node, plan, seg, [j for j in jobs if covered(j)], keys, index, man,
                                   files, pool, verify)
        return checked, [j for j in jobs if not covered(j)], aborted
    finally:
        seg.close()


def _rounds(comm, node: "_Node", plan: _NodePlan, seg: _Segment, jobs: list[SharedJob], keys, index, man,
            files, pool, verify: bool) -> tuple[int, bool]:
    """The rounds. Round ``k`` lives in buffer ``k % BUFFERS``. Iteration ``k``: wait for this
    rank's reads of round ``k`` (each read task hashes what it read), start its reads of round
    ``k + BUFFERS - 2`` (its buffer last held round ``k - 2``, which every rank finished
    scattering before the sync of round ``k - 1``), sync, then scatter round ``k`` while the
    rounds ahead are read. The disk never waits for a sync or a scatter."""
    slot = int(plan.part[-1])  # one round's buffer: one part per rank (round k: buffer k % BUFFERS < plan.buffers)
    me = plan.ranks.index(comm.rank)
    by_tensor: dict[int, list[SharedJob]] = {}
    for j in jobs:
        by_tensor.setdefault(index[j.st.key], []).append(j)
    bad: set[int] = set()
    checked = 0
    failure: BaseException | None = None
    inflight: dict[int, list] = {}

    def read_hash(reader, offset: int, at: int, n: int, rows: np.ndarray) -> tuple[int, list[int]]:
        """One read into the segment, then the checksum of every range it holds."""
        view = memoryview(seg.map)[at : at + n]
        try:
            reader.readinto(offset, view)
            if not verify:
                return 0, []
            wrong = []
            for r in rows.tolist():
                t, i = int(plan.tensor[r]), int(plan.rng[r])
                a = int(plan.seg[r]) - int(plan.seg[rows[0]])
                if Hasher.of(view[a : a + int(plan.end[r] - plan.begin[r])]) != man.tensors[keys[t]].checksums[i][2]:
                    wrong.append(t)
            return len(rows), wrong
        finally:
            view.release()

    def submit(k: int) -> list:
        """Start this rank's reads of round ``k``: consecutive ranges of one tensor in one read
        of at most PIECE bytes."""
        sel = np.flatnonzero((plan.round == k) & (plan.reader == me))
        out = []
        i = 0
        while i < len(sel):
            j = i + 1
            while (j < len(sel) and plan.tensor[sel[j]] == plan.tensor[sel[i]] and plan.rng[sel[j]] == plan.rng[sel[j - 1]] + 1
                   and plan.end[sel[j]] - plan.begin[sel[i]] <= PIECE):
                j += 1
            rows = sel[i:j]
            st = man.tensors[keys[int(plan.tensor[rows[0]])]]
            b, n = int(plan.begin[rows[0]]), int(plan.end[rows[-1]] - plan.begin[rows[0]])
            base = man.files[st.file].data_start + st.begin
            out.append(pool.submit(read_hash, files.get(st.file), base + b, (k % BUFFERS) * slot + int(plan.seg[rows[0]]),
                                   n, rows))
            i = j
        return out

    def collect(futs: list) -> None:
        nonlocal checked
        for f in futs:
            n, wrong = f.result()
            checked += n
            bad.update(wrong)

    def scatter(k: int) -> None:
        sel = np.flatnonzero(plan.round == k)
        for t in np.unique(plan.tensor[sel]).tolist():
            if t not in by_tensor:
                continue
            rows = sel[plan.tensor[sel] == t]
            # stretches of ranges adjacent in the tensor and in the buffer
            cut = np.flatnonzero((plan.begin[rows[1:]] != plan.end[rows[:-1]])
                                 | (plan.seg[rows[1:]] != plan.seg[rows[:-1]] + plan.end[rows[:-1]] - plan.begin[rows[:-1]])) + 1
            for part in np.split(rows, cut):
                ub, ue = int(plan.begin[part[0]]), int(plan.end[part[-1]])
                at = (k % BUFFERS) * slot + int(plan.seg[part[0]])
                for j in by_tensor[t]:
                    copy_window(seg.bytes[at : at + ue - ub], ub // j.isz, ue // j.isz, j.runs.starts, j.ends,
                                j.runs.local, j.dest, j.isz)

    try:
        try:
            for k in range(min(BUFFERS - 2, plan.rounds)):
                inflight[k] = submit(k)
        except BaseException as e:
            failure = e
        for k in range(plan.rounds):
            if failure is None:
                try:
                    collect(inflight.pop(k))
                    ahead = k + BUFFERS - 2  # its buffer last held round k - 2, scattered before sync k - 1
                    if ahead < plan.rounds:
                        inflight[ahead] = submit(ahead)
                except BaseException as e:  # stops every rank of the node at this round's sync
                    failure = e
            if node.any_failed(failure is not None):
                if failure is not None:
                    raise failure
                return checked, True  # a peer failed: it reports why; every rank stops here
            try:
                scatter(k)
            except BaseException as e:  # told to the node at the next round's flags (or raised after the last)
                failure = e
    finally:  # reads still in flight write into the segment: wait for them before it goes
        for futs in inflight.values():
            for f in futs:
                f.cancel()
                try:
                    f.result()
                except BaseException:
                    pass
    gathered = node.gather(json.dumps(sorted(bad)).encode())
    if failure is not None:  # the last round's scatter failed: the peers finished theirs
        raise failure
    bad_all = {t for b in gathered.values() for t in json.loads(b)}
    for j in jobs:
        j.done((index[j.st.key] not in bad_all, 0))
    return checked, False


