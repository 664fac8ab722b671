"""Node-shared reads: the ranks of one node read each byte range they need once.

When several ranks of a node need interleaved pieces of the same stored bytes (column
blocks of row-major tensors: every rank needs a slice of every row), independent reads move
the same bytes through read calls once per rank and hash them once per rank. When their
needs only interleave (row blocks of every tensor, ZeRO ranges), reading alone moves each
byte once, but every rank jumps from stretch to stretch of the files, and a disk serves
that at a fraction of its streaming speed (smaller requests, read-ahead that runs into the
next rank's stretch). Instead, the ranks of a node agree on the union of the checksummed
ranges they need and read it once, each rank one contiguous share:

1. One all-gather of a small record per rank: its node, whether it can map shared memory,
   how much of its long-run needs the page cache holds, and the length of its needs: the
   checksummed ranges (indices into ``TensorEntry.checksums``) its targets touch (short-run
   targets, and long-run ones read into their own memory). The needs themselves go only to
   the other ranks of the node (point to point), and every exchange after this one stays
   inside the node, so a rank's work does not grow with the number of nodes. The ranks of
   a node compute the same plan from the same inputs, so the plan needs no agreement.
2. A node shares only when it pays: at least two ranks, and either the ranks' needs add up
   to more than :data:`MIN_OVERLAP` times their union (short-run needs), or the long-run
   needs interleave (some rank would read at least half of them in stretches shorter than
   :data:`STRETCH`) and the node's ranks find less than half of them in the page cache
   (from the cache, the copy out of the segment costs more than it saves). Otherwise its
   ranks read alone.
3. The node's lowest rank creates a shared-memory segment (``/dev/shm``, mode 0600,
   unlinked as soon as every rank of the node has mapped it): a page of status words, then
   :data:`BUFFERS` buffers of about :data:`ROUND` bytes. The union (in file order) is cut
   into one contiguous share per rank of about equal bytes, at checksummed-range
   boundaries, so each rank streams through its own part of the files as a sequential
   reader (the kernel's read-ahead follows it; shares striped through every round defeat it
   and read at about half the speed here). Each share is cut into pieces of
   ``ROUND / ranks`` bytes (:data:`WARM_PIECE` when the needs are in memory); round ``k``
   is every rank's ``k``-th piece, read into its part of buffer ``k % BUFFERS`` and hashed,
   in order, by one read thread per rank (several threads on one share made the kernel send
   requests half the size).
   The ranks meet only through the status words (:class:`_Status`), never through a message
   per round: each rank publishes the rounds it has read and hashed and the rounds it has
   scattered. A rank scatters round ``k`` into its own targets once every rank of the node
   published it, and reads into a buffer again once every rank scattered the round it held,
   so each reads up to ``BUFFERS`` rounds ahead. (A message exchange per round made every
   rank wait for the slowest one's turn on a core, ~36 times per GB: with 4 ranks on 2
   cores that cost more than reading every byte twice.) A failing rank sets its failure
   flag: its node mates stop at their next poll and learn why at the load's agreement
   that follows; a node mate that dies is noticed within a poll (its pid and start time are
   in the status words), one that stops making progress within ``timeout_s``.
4. A status word says whether a rank found ranges whose checksum did not match; only then
   are they exchanged within the node at the end, and every rank that used bytes of such a
   tensor reports it (``ChecksumError`` naming file and tensor).

Bytes through read calls per node = bytes of the checksummed ranges its ranks need (each
counted once); each range is hashed once, by the rank that read it. A rank returns bytes
that a rank of its own node read and verified (same job, same node, a 0600 segment).
Where shared memory cannot be set up (no ``/dev/shm``, out of space), and on machines other
than x86-64 (see :class:`_Status`), every rank reads alone: sharing changes speed, never results.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import liveness, shm
from ._copy import Windows, copy_window
from ._metrics import log
from .errors import DistributedError
from .format import CHECK_BLOCK, Hasher
from .layout import Runs
from .manifest import Manifest, TensorEntry
from .transport import Comm, node_id

__all__ = ["SharedJob", "read_shared", "ROUND", "MIN_OVERLAP", "enabled"]

ROUND = 32 << 20
"""Bytes a node reads per round (each rank ``ROUND / ranks``), from the disk."""
WARM_PIECE = 4 << 20
"""Bytes each rank reads per round when the node's needs are in memory (page cache, tmpfs:
the memory tier): a round is then still in the caches when the node's ranks scatter it.
Against 32 MiB rounds, 1.2 GB of 512-wide rows loaded as columns from tmpfs by 2 ranks took
10% less time and CPU, as TP x ZeRO blocks by 4 ranks 2-4%; from the disk, reads of the
larger pieces stream better. At most ``ROUND / ranks`` (more than 8 ranks: the segment is
never larger than from the disk)."""
BUFFERS = 4
"""Rounds held by the segment: a rank reads up to this many rounds ahead of the node's
slowest scatter."""
MIN_OVERLAP = 1.25
"""A node shares its reads when its ranks' needs add up to at least this many times their union."""
PIECE = 16 << 20  # one read call at most
STRETCH = 128 << 20
"""A node also shares its reads when some rank would otherwise read at least half of its
long-run bytes in stretches of the files shorter than this, skipping the bytes between them
(see :func:`_interleaved`)."""
SHM_DIR = shm.SHM_DIR
# the status words (:class:`_Status`): one line of _WORDS int64 per rank of the node
_WORDS, _READ, _USED, _FAIL, _PID, _START, _BAD, _DONE, _ALLOC = 8, 0, 1, 2, 3, 4, 5, 6, 7
_NO_SPACE = shm.NO_SPACE  # the reserved-buffers byte (_ALLOC) when /dev/shm ran out (BUFFERS stays below it)


def enabled() -> bool:
    """Node-shared reads are on unless ``UNICKPT_NODE_SHARED_READS=0``, on x86-64 (the ranks
    of a node meet through status words in shared memory, whose ordering :class:`_Status`
    takes from x86-64's; elsewhere every rank reads alone)."""
    return os.environ.get("UNICKPT_NODE_SHARED_READS", "1") != "0" and platform.machine().lower() in ("x86_64", "amd64")


@dataclass
class SharedJob:
    """One target the node may read shared: its runs in ``st``'s bytes and which checksummed
    ranges they touch (``long``: long runs, read straight into the target when not shared)."""

    st: TensorEntry
    reader: object  # RandomReader of st.file
    base: int  # file offset of st's first byte
    runs: Runs
    isz: int
    dest: torch.Tensor  # flat uint8: the target's bytes
    touched: np.ndarray  # bool per st.checksums range
    done: Callable[[tuple[bool, int]], None]
    long: bool = False  # long runs (read straight into the target when the node does not share)
    local: torch.Tensor | None = None  # the target itself (dest is its bytes, or a temporary)
    direct: bool = True  # dest is the target's own memory

    def __post_init__(self) -> None:
        self.windows = Windows(self.runs.starts, self.runs.lengths, self.runs.local)  # once, not per round


def bounds(st: TensorEntry) -> tuple[np.ndarray, np.ndarray]:
    """Begins and ends of ``st``'s checksummed ranges (they tile its bytes in order)."""
    n = len(st.checksums)
    return (np.fromiter((c[0] for c in st.checksums), dtype=np.int64, count=n),
            np.fromiter((c[1] for c in st.checksums), dtype=np.int64, count=n))


def eligible(st: TensorEntry, isz: int, long: bool = False,
             be: tuple[np.ndarray, np.ndarray] | None = None) -> bool:
    """A tensor can be read shared when its checksummed ranges are small enough to pack into
    rounds and start on element boundaries (so a range never splits an element). For long-run
    targets (shared only for the access pattern) at most 1 MiB: larger ranges (format 1: one
    per tensor) would size each rank's part of the segment by the largest one. ``be``: its
    :func:`bounds`, when already known."""
    if st.coder.coded or not st.checksums:
        return False
    b, e = be if be is not None else bounds(st)
    return bool(int((e - b).max()) <= (CHECK_BLOCK if long else ROUND // 4) and not (b % isz).any())


def touched(be: tuple[np.ndarray, np.ndarray], b: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Which checksummed ranges (``be``: :func:`bounds`) the byte runs ``[b[i], e[i])`` touch,
    as a bool per range: one search per range among the runs, not per run. A column block of
    a tall matrix has a run per row (24,576 for a 48 MiB matrix 512 wide) and a few dozen
    ranges; the per-run search cost about 1 ms a tensor, a quarter of the CPU of a load's
    start (docs/performance.md). A range is touched when the first run (by begin) that
    reaches past its begin starts before its end."""
    rb, re_ = be
    live = e > b
    b, e = b[live], e[live]
    out = np.zeros(len(rb), dtype=bool)
    if not len(b) or not len(rb):
        return out
    if len(b) > 1 and not bool((b[1:] >= b[:-1]).all()):  # a target's runs are in order already
        o = np.argsort(b, kind="stable")
        b, e = b[o], e[o]
    reach = np.maximum.accumulate(e)  # the furthest any run so far reaches (= e for disjoint runs)
    j = np.searchsorted(reach, rb, side="right")
    ok = j < len(b)
    out[ok] = b[j[ok]] < re_[ok]
    return out


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
    def header(self) -> int:
        """Bytes of the status words at the head of the segment (whole pages)."""
        return -(-len(self.ranks) * _WORDS * 8 // 4096) * 4096

    @property
    def size(self) -> int:
        """Bytes of the node's segment: the status words, then the round buffers."""
        return self.header + self.buffers * int(self.part[-1])


def _cached(jobs: list[SharedJob], samples: int = 16, n: int = 16 << 20, seen: dict | None = None) -> float | None:
    """Fraction of the sampled bytes of ``jobs`` (up to ``samples`` of them, ``n`` bytes
    each) in the page cache now; None when the readers cannot tell (not local files: object
    stores have no read-ahead for interleaved reads to defeat) or there are no such jobs.
    ``seen``: the answers of earlier calls by job (a job sampled twice is probed once)."""
    got = want = 0
    seen = {} if seen is None else seen
    for j in jobs[:: max(1, -(-len(jobs) // samples))]:
        ask = getattr(j.reader, "resident", None)
        if ask is None:
            return None
        if not len(j.runs):
            continue
        k = min(n, int(j.runs.lengths[0]) * j.isz)
        if id(j) not in seen:
            seen[id(j)] = ask(j.base + int(j.runs.starts[0]) * j.isz, k)
        r = seen[id(j)]
        if r is None:
            return None
        got, want = got + min(r, k), want + k
    return got / want if want else None


def _interleaved(long: dict[int, list], keys: list, man: Manifest) -> bool:
    """True when some rank of the node, reading alone, would read at least half of its
    long-run bytes in stretches shorter than :data:`STRETCH`: stretches of the stored bytes
    that other ranks' stretches separate (row blocks of every tensor, ZeRO ranges...). The
    disk serves such reads at a fraction of its streaming speed; shared, each rank streams
    one contiguous share. ``long``: each rank's needs as ``(tensor, first range, end range)``."""
    for need in long.values():
        spans: list[list] = []  # [file, begin, end] of the needed bytes, merged
        for t, a, b in sorted(need, key=lambda x: (man.tensors[keys[x[0]]].file, man.tensors[keys[x[0]]].begin, x[1])):
            st = man.tensors[keys[t]]
            lo, hi = st.begin + st.checksums[a][0], st.begin + st.checksums[b - 1][1]
            if spans and spans[-1][0] == st.file and lo - spans[-1][2] <= 1 << 20:  # padding: read through
                spans[-1][2] = max(spans[-1][2], hi)
            else:
                spans.append([st.file, lo, hi])
        size = sum(e - b for _, b, e in spans)
        if size and 2 * sum(e - b for _, b, e in spans if e - b < STRETCH) >= size:
            return True
    return False


def _plan_node(ranks: list[int], token: str, needs: dict[int, np.ndarray], keys: list, man: Manifest,
               warm: bool = False) -> _NodePlan:
    """The node's rounds (every rank of the node computes the same from the same inputs);
    ``warm``: the needs are in memory (pieces of :data:`WARM_PIECE`, not ``ROUND / ranks``)."""
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
    # (warm: never more than from the disk, so the segment stays within BUFFERS x ROUND)
    sub = max(min(WARM_PIECE, ROUND // m) if warm else ROUND // m, int(size.max()) if len(size) else 0)
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
                     max(1, min(BUFFERS, rounds, _NO_SPACE - 1)))


def _prefetch(plan: _NodePlan, me: int, keys: list, man: Manifest, files, pool) -> None:
    """Start the disk on this rank's first rounds while the segment is set up (its creation,
    two exchanges): the readers' ``prefetch`` hint, where they have one (local files), given
    on a read thread. Only a hint: a file that cannot be opened now fails in its reads."""
    sel = np.flatnonzero((plan.reader == me) & (plan.round < min(plan.buffers, plan.rounds)))
    ext: list[list] = []  # [file, start, end] of runs of adjacent ranges, in read order
    for r in sel.tolist():
        ent = man.tensors[keys[int(plan.tensor[r])]]
        a = man.files[ent.file].data_start + ent.begin + int(plan.begin[r])
        b = a + int(plan.end[r] - plan.begin[r])
        if ext and ext[-1][0] == ent.file and ext[-1][2] == a:
            ext[-1][2] = b
        else:
            ext.append([ent.file, a, b])
    try:  # readers are opened here, on this thread (files is not shared between threads)
        hints = [(getattr(files.get(name), "prefetch", None), a, b - a) for name, a, b in ext]
    except Exception:
        return

    def give() -> None:
        for hint, a, n in hints:
            if hint is not None:
                try:
                    hint(a, n)
                except OSError:
                    return

    if any(h is not None for h, _, _ in hints):
        pool.submit(give)


def _open_segment(path: str, size: int) -> shm.SharedFile:
    """The node's segment, created by its first rank (:func:`read_shared`), as another rank
    maps it (:func:`unickpt.shm.open_existing` checks the file it opens: this user's, not a
    link, of ``size`` bytes; the size is looked at first only to say what is wrong)."""
    if os.stat(path, follow_symlinks=False).st_size != size:
        raise OSError(f"{path}: not the segment this load created")
    return shm.SharedFile(path, size)


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


def read_shared(comm: Comm, jobs: list[SharedJob], man: Manifest, files, pool, verify: bool, failed: bool,
                record: dict | None = None) -> tuple[int, list[SharedJob], bool]:
    """Collective over ``comm``: read ``jobs`` with the other ranks of this node.

    Every rank calls it exactly once per load (with ``failed=True`` when its own reads
    already failed: then every rank returns at once). ``files.get(name)`` opens readers,
    ``pool`` runs the reads. Returns ``(ranges verified here, jobs left to read alone,
    aborted)``: ``aborted`` means some rank failed and nothing more should be read.
    ``record``: the load's own figure for the next stage, ``{"remote": n}`` (pieces this rank
    needs from other nodes), sent with this rank's record; every rank's comes back in
    ``record["remote_counts"]`` (one all-gather for both decisions, not two)."""
    keys = list(man.tensors)
    index = {k: i for i, k in enumerate(keys)}
    decided = _decide(comm, jobs, man, keys, index, verify, failed, record)
    if decided is None:
        return 0, [], True
    if not decided:
        return 0, jobs, False
    node, union, plan = decided
    _prefetch(plan, plan.ranks.index(comm.rank), keys, man, files, pool)
    seg = _segment(comm, node, plan)
    if seg is None:  # sharing is only speed: everyone reads alone
        return 0, jobs, False

    # a target the union does not cover whole (never, with the needs this rank sent) is read
    # alone: marking it done after the rounds would return bytes nobody read
    def covered(j: SharedJob) -> bool:
        m = union.get(index[j.st.key])
        return m is not None and len(m) == len(j.touched) and not (j.touched & ~m).any()

    try:
        checked, how = _rounds(comm, node, plan, seg, [j for j in jobs if covered(j)], keys, index, man,
                               files, pool, verify)
        if how == "alone":  # /dev/shm ran out while the segment was being reserved: nothing was handed over
            log.info("node-shared reads off: %s ran out of space for the segment; every rank reads alone", SHM_DIR)
            return 0, jobs, False
        return checked, [j for j in jobs if not covered(j)], how == "failed"
    finally:
        seg.close(background=True)


def _decide(comm: Comm, jobs: list[SharedJob], man: Manifest, keys: list, index: dict, verify: bool, failed: bool,
            record: dict | None = None):
    """Whether this node reads shared (collective: every rank of the node decides the same
    from the same records): None when a rank failed already (every rank stops), False when
    the node reads alone, else ``(node, union of the needs, the node's plan)``."""
    need: dict[tuple[int, int], np.ndarray] = {}  # (tensor, 1 for long-run targets else 0): ranges touched
    for j in jobs:
        k = (index[j.st.key], int(j.long))
        need[k] = need.get(k, np.zeros(len(j.st.checksums), dtype=bool)) | j.touched
    can = enabled() and os.path.isdir(SHM_DIR)
    seen: dict = {}  # (one probe of a job both samplings take)
    blob = json.dumps([[t, a, b, kind] for (t, kind), m in sorted(need.items()) for a, b in _intervals(m)]).encode()
    me = {"node": node_id(), "can": can, "token": shm.new_name("read"), "failed": failed,
          "n": len(blob), "verify": verify, "cached": _cached([j for j in jobs if j.long], seen=seen) if can else None,
          "warm": _cached(jobs, seen=seen) if can else None,
          "remote": int((record or {}).get("remote", 0))}
    # a small record from every rank; the needs themselves travel only between the node's ranks
    all_ = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(me).encode(), "load (node-shared reads)")]
    if record is not None:
        record["remote_counts"] = [int(d.get("remote", 0)) for d in all_]
    if any(d["failed"] for d in all_):
        return None
    ranks = [r for r, d in enumerate(all_) if d["node"] == me["node"]]
    # ranks that disagree on verify read alone (a rank that checks never returns bytes a
    # non-checking peer read)
    if len(ranks) < 2 or not all(all_[r]["can"] and all_[r]["verify"] == all_[ranks[0]]["verify"] for r in ranks):
        return False
    node = _Node(comm, ranks)
    short, long, asked = _needs(node.gather(blob, {r: all_[r]["n"] for r in ranks}), ranks, keys, man)
    total = sum(sum(c[1] - c[0] for c, u in zip(man.tensors[keys[t]].checksums, m.tolist()) if u)
                for t, m in short.items())
    # overlapping short-run needs are worth sharing (bytes read once, not once per rank);
    # long-run needs that interleave are worth it from the disk, not from the page cache (the
    # copy out of the segment costs more than the reads it makes sequential there)
    cached = [all_[r].get("cached") for r in ranks if long[r]]  # ranks without long runs have no say
    cold = bool(cached) and all(type(c) in (int, float) for c in cached) and sum(cached) < 0.5 * len(cached)
    share_long = cold and _interleaved(long, keys, man)
    if not (total and asked >= MIN_OVERLAP * total) and not share_long:
        return False
    union = short
    for t, a, b in (x for r in ranks for x in long[r]) if share_long else ():
        union.setdefault(t, np.zeros(len(man.tensors[keys[t]].checksums), dtype=bool))[a:b] = True
    if not union:
        return False
    warm = all(type(c) in (int, float) and c >= 0.5 for c in (all_[r].get("warm") for r in ranks))
    return node, union, _plan_node(ranks, all_[ranks[0]]["token"], union, keys, man, warm)


def _needs(needs: dict[int, bytes], ranks: list[int], keys: list, man: Manifest
           ) -> tuple[dict[int, np.ndarray], dict[int, list], int]:
    """The node's ranks' needs, checked: the union of the short-run ones (per tensor, the
    checksummed ranges), each rank's long-run ones ``(tensor, a, b)``, and the bytes the
    short-run needs ask for in all (counted once per rank)."""
    short: dict[int, np.ndarray] = {}
    long: dict[int, list] = {r: [] for r in ranks}
    asked = 0
    for r in ranks:
        try:
            descr = json.loads(needs[r])
        except ValueError:
            descr = None
        for item in descr if isinstance(descr, list) else []:
            if not (isinstance(item, list) and len(item) == 4 and all(type(x) is int for x in item)):
                continue  # not what a rank of this version sends: it adds nothing to the union
            t, a, b, kind = item
            if not (0 <= t < len(keys)) or not (0 <= a < b <= len(man.tensors[keys[t]].checksums)) or kind not in (0, 1):
                continue
            if kind:
                long[r].append((t, a, b))
                continue
            m = short.setdefault(t, np.zeros(len(man.tensors[keys[t]].checksums), dtype=bool))
            m[a:b] = True
            asked += sum(c[1] - c[0] for c in man.tensors[keys[t]].checksums[a:b])
    return short, long, asked


def _segment(comm: Comm, node: "_Node", plan: _NodePlan) -> "shm.SharedFile | None":
    """The node's segment: created by its first rank, opened by the others, then unlinked
    (collective over the node); None when any rank of the node could not (read alone)."""
    seg: shm.SharedFile | None = None
    err = False
    size = plan.size
    path = os.path.join(SHM_DIR, plan.token)
    try:
        try:
            if comm.rank == plan.ranks[0]:
                shm.sweep(SHM_DIR)
                slot = int(plan.part[-1])
                # ftruncate reserves nothing on tmpfs, and a read into a page /dev/shm has no room
                # for fails (EFAULT) or kills the process (SIGBUS): the status words and the first
                # round's buffer are reserved before anyone maps the segment, the other buffers on a
                # thread while the first rounds are read, counted in the low byte of this rank's
                # _ALLOC word (no rank reads into a buffer before; _NO_SPACE: /dev/shm ran out)
                seg = shm.SharedFile(path, size, create=True, reserve=plan.header + slot, progress=_ALLOC * 8,
                                     chunks=[(plan.header + b * slot, slot) for b in range(1, plan.buffers)])
        except OSError as e:
            log.info("node-shared reads off: cannot create %s (%s)", path, e)
            err = True
        if not node.any_failed(err):
            try:
                if seg is None:
                    seg = _open_segment(path, size)
                _Status(seg, plan.ranks, plan.ranks.index(comm.rank)).register()  # before the exchange below
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
        seg.unlink(background=not err)  # every rank of the node mapped it (or gave up): nothing left in /dev/shm
    if err:
        if seg is not None:
            seg.close()
        return None
    return seg


def _in_order(reads: list) -> tuple[int, list[int]]:
    """``(fn, *args)`` calls of ``read_hash``, one after another: ranges hashed, tensors whose range did not match."""
    n, wrong = 0, []
    for fn, *args in reads:
        a, b = fn(*args)
        n += a
        wrong += b
    return n, wrong


class _Status:
    """The status words at the head of the node's segment, :data:`_WORDS` int64 per rank of
    the node (one 64-byte line each): rounds read and hashed, rounds scattered, a failure
    flag, and the rank's pid and start time (so a peer that dies is noticed at once).

    A rank publishes a round only after its reads of the round completed (the read threads'
    futures resolved: their stores happen before), and scatters a round only after every rank
    published it; a buffer is read into again only after every rank published that it
    finished scattering the round it held. Aligned 8-byte stores and loads are atomic and, on
    x86-64, seen by other cores in program order (TSO), which is all this protocol needs:
    :func:`enabled` keeps node-shared reads to x86-64."""

    def __init__(self, seg: shm.SharedFile, ranks: list[int], me: int) -> None:
        self.m, self.me = len(ranks), me
        self.w = np.frombuffer(seg.map, dtype=np.int64, count=self.m * _WORDS).reshape(self.m, _WORDS)

    def register(self) -> None:
        self.w[self.me, _PID] = os.getpid()
        self.w[self.me, _START] = liveness.start_ticks(os.getpid()) or -1

    def peers_seen(self) -> list[int]:
        """Node positions of the peers whose process this process can watch (same pid
        namespace: the pid it wrote is a live process here with the start time it wrote)."""
        return [i for i in range(self.m) if i != self.me and self.w[i, _START] != -1
                and liveness.start_ticks(int(self.w[i, _PID])) == int(self.w[i, _START])]

    def dead(self, seen: list[int]) -> list[int]:
        return [i for i in seen if liveness.start_ticks(int(self.w[i, _PID])) != int(self.w[i, _START])]

    def set(self, word: int, value: int) -> None:
        self.w[self.me, word] = value

    def low(self, word: int) -> int:
        return int(self.w[:, word].min())

    def failed(self) -> list[int]:
        return np.flatnonzero(self.w[:, _FAIL]).tolist()



def _rounds(comm, node: "_Node", plan: _NodePlan, seg: shm.SharedFile, jobs: list[SharedJob], keys, index, man,
            files, pool, verify: bool) -> tuple[int, str]:
    """The rounds (:class:`_Rounds`). Returns ``(ranges verified, how)``: ``"done"`` (every
    job marked done), ``"failed"`` (a rank of the node failed; nothing marked done) or
    ``"alone"`` (/dev/shm ran out of space before the last buffer was reserved, so no rank of
    the node can finish the rounds; nothing marked done: the jobs are read alone)."""
    return _Rounds(comm, node, plan, seg, jobs, keys, index, man, files, pool, verify).run()


class _Rounds:
    """Round ``k`` lives in buffer ``k % buffers``. Each rank reads its part of every round as
    soon as that buffer is free (every rank scattered the round it held) and publishes the
    round once its reads of it are done and hashed; it scatters round ``k`` once every rank
    published it. The ranks meet only through the status words (:class:`_Status`): no message
    per round, so no rank waits for another's turn on a core except for bytes it needs. A
    failure sets this rank's flag and stops every rank of the node at its next wait; a peer
    that dies is noticed within a poll, one that hangs within ``comm.timeout_s``. No rank
    reads into a buffer before the node's first rank reserved it (:class:`unickpt.shm.SharedFile`)."""

    def __init__(self, comm, node: "_Node", plan: _NodePlan, seg: shm.SharedFile, jobs: list[SharedJob], keys, index, man,
                 files, pool, verify: bool) -> None:
        self.comm, self.node, self.plan, self.seg, self.jobs = comm, node, plan, seg, jobs
        self.keys, self.index, self.man, self.files, self.pool, self.verify = keys, index, man, files, pool, verify
        self.slot = int(plan.part[-1])  # one round's buffer: one part per rank
        self.nbuf = plan.buffers
        self.st = _Status(seg, plan.ranks, plan.ranks.index(comm.rank))
        self.seen = self.st.peers_seen()
        self.by_tensor: dict[int, list[SharedJob]] = {}
        for j in jobs:
            self.by_tensor.setdefault(index[j.st.key], []).append(j)
        self.bad: set[int] = set()
        self.checked = 0
        self.inflight: dict[int, list] = {}
        self.mine = plan.reader == self.st.me
        self.submitted = self.published = 0
        self.error: BaseException | None = None
        self.closing = self.alone = False
        self.lock = threading.RLock()
        self.stream = ThreadPoolExecutor(1, thread_name_prefix="unickpt-share-read")

    def run(self) -> tuple[int, str]:
        plan, man, keys = self.plan, self.man, self.keys
        try:
            try:
                # every file this rank reads, opened here: the read threads then only look readers up
                # (opening one reads and checks its header, which must not happen under the lock)
                for name in sorted({man.tensors[keys[int(t)]].file for t in np.unique(plan.tensor[self.mine])}):
                    self.files.get(name)
                how = self._all_rounds()
            except BaseException:
                self.st.set(_FAIL, 1)  # every rank of the node stops at its next wait
                raise
        finally:  # reads still in flight write into the segment: wait for them before it goes
            self._close()
        if self.error is not None:  # this rank's read failed (whatever the wait saw first): it says why
            raise self.error
        bad_all: set[int] = set()
        if how == "bad":  # a range did not match its checksum: the node learns which
            gathered = self.node.gather(json.dumps(sorted(self.bad)).encode())
            bad_all = {t for b in gathered.values() for t in json.loads(b)}
        elif how != "done":
            return self.checked, how
        for j in self.jobs:
            j.done((self.index[j.st.key] not in bad_all, 0))
        return self.checked, "done"

    def _close(self) -> None:
        with self.lock:
            self.closing = True
        for futs in list(self.inflight.values()):
            for f in futs:
                f.cancel()
                try:
                    f.result()
                except BaseException:
                    pass
        self.inflight.clear()
        self.stream.shutdown(wait=True)
        self.st.w = None  # the mapping can go now

    def _all_rounds(self) -> str:
        st, plan = self.st, self.plan
        for k in range(plan.rounds):
            got = self._wait(lambda: st.low(_READ) > k, f"read round {k + 1} of {plan.rounds}",
                             lambda i: st.w[i, _READ] <= k)
            if got != "ready":  # a rank failed (it reports why): every rank stops here; or no space
                return got
            self._scatter(k)
            st.set(_USED, k + 1)
        st.set(_BAD, 1 if self.bad else 0)
        st.set(_DONE, 1)
        # every rank finished: nobody sets a failure flag after this, so every rank sees the
        # same words and takes the same branch below
        got = self._wait(lambda: st.low(_DONE) == 1, "finish the reads", lambda i: not st.w[i, _DONE])
        if got != "ready":
            return got
        return "bad" if int(st.w[:, _BAD].max()) else "done"

    def _read_hash(self, reader, offset: int, at: int, n: int, rows: np.ndarray) -> tuple[int, list[int]]:
        """One read into the segment, then the checksum of every range it holds."""
        plan = self.plan
        view = memoryview(self.seg.map)[at : at + n]
        try:
            reader.readinto(offset, view)
            if not self.verify:
                return 0, []
            wrong = []
            for r in rows.tolist():
                t, i = int(plan.tensor[r]), int(plan.rng[r])
                a = int(plan.seg[r]) - int(plan.seg[rows[0]])
                if Hasher.of(view[a : a + int(plan.end[r] - plan.begin[r])]) != self.man.tensors[self.keys[t]].checksums[i][2]:
                    wrong.append(t)
            return len(rows), wrong
        finally:
            view.release()

    def _submit(self, k: int) -> list:
        """Queue this rank's reads of round ``k``: consecutive ranges of one tensor in one read
        of at most PIECE bytes. Local files (readers with ``sequential``): on this rank's one
        read thread, in file order after the previous round's; reads of one share in flight on
        several threads at once reach the disk as requests of half the size (the kernel's
        read-ahead loses track of the stream) and took 1.4x as long here (docs/performance.md).
        Other readers (object stores: each read a ranged GET): on the pool, in parallel."""
        plan = self.plan
        sel = np.flatnonzero((plan.round == k) & self.mine)
        out = []
        i = 0
        while i < len(sel):
            j = i + 1
            while (j < len(sel) and plan.tensor[sel[j]] == plan.tensor[sel[i]] and plan.rng[sel[j]] == plan.rng[sel[j - 1]] + 1
                   and plan.end[sel[j]] - plan.begin[sel[i]] <= PIECE):
                j += 1
            rows = sel[i:j]
            ent = self.man.tensors[self.keys[int(plan.tensor[rows[0]])]]
            b, n = int(plan.begin[rows[0]]), int(plan.end[rows[-1]] - plan.begin[rows[0]])
            base = self.man.files[ent.file].data_start + ent.begin
            out.append((self._read_hash, self.files.get(ent.file), base + b,
                        plan.header + (k % self.nbuf) * self.slot + int(plan.seg[rows[0]]), n, rows))
            i = j
        if all(getattr(a[1], "sequential", False) for a in out):
            return [self.stream.submit(_in_order, out)]
        return [self.pool.submit(*a) for a in out]  # object stores: ranged GETs in parallel

    def _advance(self) -> None:
        """Publish this rank's finished rounds (in order) and start the reads whose buffer is
        free. Runs on the read threads as each read finishes (so a round is published, and the
        next read started, while this thread scatters) and on this thread while it waits."""
        with self.lock:  # re-entered when a read has finished before its callback is added: state is re-read
            try:
                while self.error is None and not self.closing:
                    if not self._publish() and not self._start_next():
                        return
            except BaseException as e:  # told to the node's ranks now; raised on this rank's thread
                self.error = e
                self.st.set(_FAIL, 1)

    def _publish(self) -> bool:
        k = self.published
        if not (k < self.submitted and all(f.done() for f in self.inflight[k])):
            return False
        got = [f.result() for f in self.inflight[k]]  # a read's error is raised here
        del self.inflight[k]
        for n, wrong in got:
            self.checked += n
            self.bad.update(wrong)
        self.published = k + 1
        self.st.set(_READ, k + 1)
        return True

    def _start_next(self) -> bool:
        # round a reuses the buffer of round a - nbuf: free once every rank scattered that
        a = self.submitted
        if a >= min(self.st.low(_USED) + self.nbuf, self.plan.rounds):
            return False
        reserved = int(self.st.w[0, _ALLOC])  # buffers the node's first rank has reserved so far
        if reserved == _NO_SPACE:
            self.alone = True  # /dev/shm ran out: no rank can finish the rounds
            return False
        if a % self.nbuf >= reserved:  # its buffer is not reserved yet (first pass only)
            return False
        self.inflight[a] = self._submit(a)
        self.submitted = a + 1
        for f in self.inflight[a]:
            f.add_done_callback(lambda _: self._advance())
        return True

    def _wait(self, ready: Callable[[], bool], what: str, behind: Callable[[int], bool]) -> str:
        """Until ``ready()`` ("ready"), a rank of the node failed ("failed") or /dev/shm ran out
        of space for the segment ("alone"); meanwhile this rank's reads go on. ``behind(i)``:
        node position ``i`` holds the wait up."""
        st, timeout = self.st, self.comm.timeout_s
        last, t_last, pause, poll = None, time.monotonic(), 0.0, 0.0
        while True:
            self._advance()
            if self.error is not None:
                raise self.error
            if st.failed():
                return "failed"
            if ready():
                return "ready"
            if self.alone:
                return "alone"
            now = time.monotonic()
            progress = st.w[:, (_READ, _USED, _DONE, _ALLOC)].tobytes()  # any progress by any rank of the node
            if progress != last:
                last, t_last = progress, now
            elif now - t_last > timeout:
                slow = [self.plan.ranks[i] for i in range(st.m) if behind(i)]
                raise DistributedError(f"load (node-shared reads): rank(s) {slow} did not {what} within "
                                       f"{timeout:g} s (a peer is hung, stopped or far slower; set "
                                       "timeout_s or UNICKPT_TIMEOUT_S if it was only slow)")
            if now - poll > 0.1:
                poll = now
                gone = st.dead(self.seen)
                if gone:
                    raise DistributedError(f"load (node-shared reads): rank(s) {[self.plan.ranks[i] for i in gone]} of "
                                           "this node exited during the reads")
            time.sleep(pause)
            pause = min(0.0005, pause * 2 or 0.00005)

    def _scatter(self, k: int) -> None:
        plan, seg = self.plan, self.seg
        sel = np.flatnonzero(plan.round == k)
        for t in np.unique(plan.tensor[sel]).tolist():
            if t not in self.by_tensor:
                continue
            rows = sel[plan.tensor[sel] == t]
            # stretches of ranges adjacent in the tensor and in the buffer
            cut = np.flatnonzero((plan.begin[rows[1:]] != plan.end[rows[:-1]])
                                 | (plan.seg[rows[1:]] != plan.seg[rows[:-1]] + plan.end[rows[:-1]] - plan.begin[rows[:-1]])) + 1
            for part in np.split(rows, cut):
                ub, ue = int(plan.begin[part[0]]), int(plan.end[part[-1]])
                at = plan.header + (k % self.nbuf) * self.slot + int(plan.seg[part[0]])
                for j in self.by_tensor[t]:
                    copy_window(seg.bytes[at : at + ue - ub], ub // j.isz, ue // j.isz, j.windows, j.dest, j.isz)
