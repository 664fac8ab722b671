"""Every use of torch.distributed in unickpt lives here.

:class:`Comm` wraps a process group (or no group at all: a single process) and offers the
few operations save and load need: exchange of small byte strings, agreement on success or
failure, and batched point-to-point transfers of host tensors. Pieces always travel as host
(CPU) tensors: with an NCCL group a gloo side group over the same ranks carries them, and
device tensors are copied to host in bounded chunks by the caller.

Every wait is bounded: each collective and transfer carries a timeout (``timeout_s``, else
``UNICKPT_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`) down to gloo, so a rank that hangs
(stopped, stuck in I/O) fails its peers with :class:`~unickpt.errors.DistributedError`
("rank(s) did not answer within N s") instead of torch's 30-minute default. Gloo then closes
the group's connections: the hung rank fails at its next operation rather than pairing with
an abandoned one. A peer that dies (connection reset or closed) fails the others at once.
Errors of torch.distributed itself always surface as :class:`DistributedError`.

Every collective carries a tag of its call (the operation and its ``what``, see
:func:`_tag`): ranks that reached different calls (one saving while another loads, one rank
calling ``start_async_writer`` alone) raise :class:`DistributedError` on every rank at
once, naming each rank's call, rather than reading each other's bytes as their own; every
rank made the same collectives, so the group still works. Every call starts with the same
collective (an all-gather of a fixed-size header: see :meth:`Comm._gather`), so calls of
different kinds (a broadcast against an all-reduce) meet there too. Only
:meth:`Comm.exchange` (point to point) and :meth:`Comm.barrier` carry no tag, and so do the
collectives of torch itself (``torch.distributed.checkpoint``'s, also when it runs
unickpt's DCP reader or writer): a unickpt call on one rank against a DCP call on another
is a mismatch of torch collectives, which gloo may answer by aborting a process. An
agreement can also compare arguments that every rank must give alike (``same``: a save's
path and options, a load's path), in the same collective.

A step whose failure need not stop the ranks before their next collective (nothing is written
in between, and the next call's arguments do not depend on it) may *defer* its agreement
(:meth:`Comm.deferred`): the failure rides in the header of the rank's next call, and every
rank, seeing it there, raises before that call does anything else. A load so matches its
target in one all-reduce where it made two agreements around it, and a failure still reaches
every rank in the same bounded time.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
import weakref
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist
import xxhash
from torch._C import _distributed_c10d as _c10d

from .errors import DistributedError, InvalidArgumentError, UnickptError, as_typed

_T = TypeVar("_T")

__all__ = ["Comm", "node_id", "LOCAL", "DEFAULT_TIMEOUT_S", "resolve_timeout"]

DEFAULT_TIMEOUT_S = 600.0
"""Seconds a rank waits for its peers in one collective or transfer before giving up."""

LOCAL = "local"
"""Pass as ``group`` to load in this process alone, even under torch.distributed."""

_SIDE_GROUPS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
"""A NCCL group's gloo twin, kept with the group (weakly: it goes with it; never by ``id()``,
which a later group may reuse)."""


def node_id() -> str:
    """Identity of the node this process runs on: ``UNICKPT_NODE_ID``, else the host name.

    Node-local memory and disks belong to the host, so the host name is what finds them
    again: a launcher's node rank (torchrun's ``GROUP_RANK``, SLURM's ``SLURM_NODEID``) is
    reassigned when an elastic job restarts on fewer or other nodes, and a process started
    outside the launcher (an epilog, a single-process resume) has none."""
    v = os.environ.get("UNICKPT_NODE_ID")
    if v:
        return v
    return socket.gethostname()


def resolve_timeout(timeout_s: float | None = None) -> float:
    """``timeout_s`` if given, else ``UNICKPT_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`."""
    src = "timeout_s"
    if timeout_s is None:
        env = os.environ.get("UNICKPT_TIMEOUT_S", "").strip()
        if not env:
            return DEFAULT_TIMEOUT_S
        src = "UNICKPT_TIMEOUT_S"
        try:
            timeout_s = float(env)
        except ValueError:
            raise InvalidArgumentError(f"UNICKPT_TIMEOUT_S must be a number of seconds, got {env!r}") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e8:
        raise InvalidArgumentError(f"{src} must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def _fingerprint(text: str) -> int:
    """A fingerprint (< 2**61, an int64 that negation keeps in range) of ``text``; 0 for none."""
    return xxhash.xxh64_intdigest(text.encode()) >> 3 if text else 0


def _tag(op: str, what: str) -> int:
    """The fingerprint of a collective call: which operation, for which step (``what``).
    Every call carries it, so ranks that reached different calls (some in a save, others in
    a load, or in different steps) fail at once with a typed error naming each rank's call,
    instead of exchanging each other's bytes."""
    return _fingerprint(f"{op}\0{what}")


def _same_json(same: Mapping[str, Any] | None) -> str:
    return json.dumps(same, sort_keys=True, default=str) if same is not None else ""


def _ranks_by(values: list[str]) -> dict[str, list[int]]:
    """The ranks that gave each value (``values`` by rank), in order of first appearance."""
    out: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return out


def _first_line(msg: str) -> str:
    line = msg.strip().splitlines()[0] if msg.strip() else msg
    return line[:500]


class Comm:
    """A process group, or a single process when torch.distributed is not initialised.

    ``timeout_s`` bounds every wait for the other ranks (see the module doc).
    """

    def __init__(self, group=None, timeout_s: float | None = None) -> None:
        self.timeout_s = resolve_timeout(timeout_s)
        self._after = ""  # the last agreement passed, named in errors
        self._pending: tuple[BaseException, str] | None = None  # a deferred failure (see deferred())
        # group="local": this process alone, even when torch.distributed is initialised
        self.active = group != "local" and dist.is_available() and dist.is_initialized()
        if group == "local":
            group = None
        if not self.active:
            if group is not None:
                raise DistributedError("a group was given but torch.distributed is not initialised")
            self.group = None
            self.rank, self.world = 0, 1
            self.p2p_group = None
            return
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.rank < 0:
            raise DistributedError("this process is not a member of the given group")
        backend = str(dist.get_backend(self.group)).lower()
        if "gloo" in backend:
            self.p2p_group = self.group
        else:  # NCCL & co: host tensors travel on a gloo group over the same ranks
            side = _SIDE_GROUPS.get(self.group)
            if side is None:  # only the group's members call this: local synchronization
                ranks = dist.get_process_group_ranks(self.group)
                side = _SIDE_GROUPS[self.group] = dist.new_group(ranks=ranks, backend="gloo",
                                                                  use_local_synchronization=True)
            self.p2p_group = side

    # -- small collectives ---------------------------------------------------------------

    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def _failed(self, op: str, what: str | None, e: BaseException) -> DistributedError:
        """The typed error for a failed operation of torch.distributed."""
        where = f" ({what})" if what else (f" (after {self._after})" if self._after else "")
        msg = str(e)
        low = msg.lower()
        if "pair closure" in low:
            text = (f"{op}{where}: the process group was closed after an earlier operation timed out "
                    f"(rank(s) did not answer within {self.timeout_s:g} s)")
        elif "timed out" in low or "timeout" in low:
            text = (f"{op}{where}: rank(s) did not answer within {self.timeout_s:g} s (a peer is hung, stopped or "
                    "far slower; set timeout_s or UNICKPT_TIMEOUT_S if it was only slow)")
        else:
            text = f"{op}{where} failed: a peer rank died or its connection broke"
        return DistributedError(f"{text} [{type(e).__name__}: {_first_line(msg)}]")

    def _run(self, op: str, what: str, post):
        """Post a collective (``post()`` returns its work) and wait for it; typed errors."""
        try:
            work = post()
            work.wait()
        except RuntimeError as e:  # gloo/c10d errors: DistBackendError, DistNetworkError, timeouts
            raise self._failed(op, what, e) from e

    def _gather(self, op: str, what: str, data: bytes = b"", aux: int = 0, tagged: bool = True,
                same: str = "") -> tuple[list[list[int]], list[bytes] | None]:
        """The first collective of every call: an all-gather of ``[len(data), aux, tag,
        failed, same]`` per rank (the same shape for every call, so ranks in different calls
        meet here and compare tags; see :func:`_tag`), then, unless every rank's ``data`` is
        empty, an all-gather of ``data`` padded to the longest. Returns every rank's header
        and data (None when all were empty). A deferred failure of any rank (``failed``,
        see :meth:`deferred`) raises on every rank first; then tags that differ
        (``tagged=False``: no tag, no check). ``same`` (arguments as JSON) travels
        fingerprinted: the caller compares (:meth:`_check_same`) when its call allows."""
        g = self.p2p_group
        opts = _c10d.AllgatherOptions()
        opts.timeout = self._timeout()
        head = torch.tensor([len(data), aux, _tag(op, what) if tagged else 0, int(self._pending is not None),
                             _fingerprint(same)], dtype=torch.int64)
        heads_t = [torch.zeros(5, dtype=torch.int64) for _ in range(self.world)]
        self._run("all_gather", what, lambda: g.allgather([heads_t], [head], opts))
        heads = [h.tolist() for h in heads_t]
        if any(h[3] for h in heads):  # every rank sees the same headers
            self._settle()
        if tagged and len({h[2] for h in heads}) > 1:
            self._mismatch(op, what)
        m = max(h[0] for h in heads)
        if m == 0:
            return heads, None
        buf = torch.zeros(m, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty_like(buf) for _ in range(self.world)]
        self._run("all_gather", what, lambda: g.allgather([outs], [buf], opts))
        return heads, [bytes(o[: h[0]].numpy().tobytes()) for o, h in zip(outs, heads)]

    def _check_same(self, heads: list[list[int]], what: str, same: str) -> None:
        if len({h[4] for h in heads}) > 1:  # (every rank sees it)
            self._differ(what, same)

    def deferred(self, what: str, fn: Callable[[], _T]) -> _T | None:
        """Run step ``what`` (``fn``) on this rank and leave its failure to this rank's next
        collective call, which every rank makes next and which raises on every rank before
        doing anything else (the failing rank its own exception, the others
        :class:`DistributedError` quoting it). Returns ``fn()``'s result, or None when it
        failed or when an earlier deferred step failed here (``fn`` is then not run: it
        would build on what failed). The caller's code up to that next call must run on
        every rank whatever ``fn`` returned, and write nothing. A single process raises at
        once."""
        if self._pending is not None:
            return None
        try:
            return fn()
        except Exception as e:
            self.defer(e, what)
            return None

    def defer(self, error: BaseException | None, what: str) -> None:
        """Leave ``error`` (of step ``what``; None: nothing failed) to this rank's next
        collective call, as :meth:`deferred` does; the first deferred failure is the one
        said. A single process raises it at once."""
        if error is None:
            return
        if not self.active or self.world == 1:
            raise error
        if self._pending is None:
            self._pending = (as_typed(error), what)

    def _settle(self) -> None:
        """Collective, when every rank has seen that some rank carries a deferred failure:
        say it (one untagged all-gather every rank makes) and raise on every rank."""
        pending, self._pending = self._pending, None
        msg = b""
        if pending is not None:
            err, what = pending
            msg = f"{what}\0{type(err).__name__}: {err}".encode()[:4000]
        _, said = self._gather("all_gather", "a deferred failure", msg, tagged=False)
        if pending is not None:
            self._after = pending[1]
            raise pending[0]
        for r, m in enumerate(said or ()):
            if m:
                what, _, text = m.decode(errors="replace").partition("\0")
                raise DistributedError(f"{what} failed on rank {r}: {text}")
        raise DistributedError("a rank flagged a deferred failure but said none")  # (not reached)

    def _mismatch(self, op: str, what: str) -> None:
        """Collective, when every rank has seen that the ranks' tags differ: each says which
        call it is in (one more all-gather, untagged: every rank saw the same tags, so every
        rank makes it) and every rank raises :class:`DistributedError`. The group stays
        usable: every rank made the same collectives."""
        calls = self._each(f"{what} [{op}]", "comparing the ranks' calls")
        said = "; ".join(f"rank(s) {rs} in {c!r}" for c, rs in _ranks_by(calls).items())
        raise DistributedError(f"the ranks reached different collective calls ({said}): every rank of the group must "
                               "make the same unickpt calls (save, load, start_async_writer, ...) in the same order")

    def all_gather_int(self, value: int, what: str, same: Mapping[str, Any] | None = None) -> list[int]:
        """Every rank's integer (``|value| < 2**62``), on every rank: one all-gather, the call's
        tag in the same message (a flag or a count, where :meth:`all_gather_bytes` takes two).
        ``same``: arguments every rank must have given alike (as in :meth:`agree`)."""
        if not self.active or self.world == 1:
            return [int(value)]
        args = _same_json(same)
        heads, _ = self._gather("all_gather", what, aux=int(value), same=args)
        self._check_same(heads, what, args)
        return [h[1] for h in heads]

    def all_gather_bytes(self, data: bytes, what: str) -> list[bytes]:
        """Every rank's byte string, on every rank (two collectives: lengths with the call's
        tag, then padded data; one when every string is empty, as in :meth:`agree` when no
        rank failed: every rank sees the same lengths, so every rank skips the second).
        Ranks in different calls (see :func:`_tag`) raise DistributedError."""
        if not self.active or self.world == 1:
            return [bytes(data)]
        _, out = self._gather("all_gather", what, data)
        return out if out is not None else [b""] * self.world

    def broadcast_bytes(self, data: bytes | None, src: int = 0, *, what: str,
                        same: Mapping[str, Any] | None = None) -> bytes:
        """Rank ``src``'s byte string on every rank (its length and every rank's tag in one
        all-gather, then the bytes). Ranks in different calls raise DistributedError.
        ``same``: arguments every rank must have given alike (as in :meth:`agree`)."""
        if not self.active or self.world == 1:
            assert data is not None
            return bytes(data)
        g = self.p2p_group
        args = _same_json(same)
        heads, _ = self._gather("broadcast", what, aux=len(data or b"") if self.rank == src else 0, same=args)
        self._check_same(heads, what, args)
        opts = _c10d.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = src, 0, self._timeout()
        n = heads[src][1]
        buf = torch.empty(max(n, 1), dtype=torch.uint8)
        if self.rank == src and data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._run("broadcast", what, lambda: g.broadcast([buf], opts))
        return bytes(buf[:n].numpy().tobytes())

    def min_max(self, values: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Element-wise minimum and maximum over the ranks of a 1-D int64 tensor whose values
        lie in ``[-2**62, 2**62]`` (the call's tag and every rank's length in one all-gather,
        then one all-reduce)."""
        if not self.active or self.world == 1:
            return values.clone(), values.clone()
        g = self.p2p_group
        heads, _ = self._gather("all_reduce", what, aux=values.numel())
        if len({h[1] for h in heads}) > 1:  # (every rank sees it) an all-reduce of unequal lengths aborts gloo
            raise DistributedError(f"{what}: the ranks hold different numbers of values "
                                   f"({[h[1] for h in heads]})")
        opts = _c10d.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        opts.timeout = self._timeout()
        both = torch.cat([values, -values]).to(torch.int64)
        self._run("all_reduce", what, lambda: g.allreduce([both], opts))
        n = values.numel()
        return both[:n], -both[n:]

    def step(self, what: str, fn: Callable[[], _T], same: Mapping[str, Any] | None = None) -> _T:
        """Collective: run ``fn`` on this rank, then agree on its outcome (DCP's
        ``_DistWrapper`` idea): its result when no rank failed; else every rank raises (see
        :meth:`agree`). ``fn`` may do nothing on some ranks (return None there)."""
        out: Any = None
        err: Exception | None = None
        try:
            out = fn()
        except Exception as e:  # agreed below: no rank goes on alone into the next collective
            err = e
        self.agree(err, what, same=same)
        return out

    def agree(self, error: BaseException | None, what: str, same: Mapping[str, Any] | None = None) -> None:
        """Collective: raise on every rank if any rank failed.

        The failing rank re-raises its own exception; the others raise
        :class:`DistributedError` quoting the first failure, so no rank goes on alone into a
        later collective and hangs. ``same``: the arguments of the call that every rank must
        have given alike (JSON-able; a fingerprint travels in the same collective): when they
        differ, every rank raises DistributedError naming each rank's differing values.
        """
        if error is not None:
            error = as_typed(error)
        if not self.active or self.world == 1:
            if error is not None:
                raise error
            return
        msg = b""
        if error is not None:
            msg = f"{type(error).__name__}: {error}".encode()[:4000] or b"error"
        args = _same_json(same)
        try:
            heads, msgs = self._gather("all_gather", what, msg, same=args)
        except DistributedError:
            if error is not None:  # our own failure is the one to report (the peers may be gone)
                raise error
            raise
        self._after = what
        if error is not None:
            raise error
        for r, m in enumerate(msgs or ()):
            if m:
                raise DistributedError(f"{what} failed on rank {r}: {m.decode(errors='replace')}")
        self._check_same(heads, what, args)

    def _differ(self, what: str, args: str) -> None:
        """Collective, when every rank has seen that the ranks' arguments differ: gather them
        (untagged) and raise DistributedError naming the keys that differ, per rank."""
        each = []
        for text in self._each(args, "comparing the ranks' arguments"):
            try:
                each.append(json.loads(text) if text else {})
            except ValueError:
                each.append({})
        keys = sorted({k for d in each for k in d if len({json.dumps(e.get(k), sort_keys=True) for e in each}) > 1})
        differ = _ranks_by([json.dumps({k: d.get(k) for k in keys}, sort_keys=True)[:600] for d in each])
        said = "; ".join(f"rank(s) {rs}: {v}" for v, rs in differ.items())
        raise DistributedError(f"{what}: the ranks were called with different arguments ({said}): every rank of "
                               "the group must pass the same")

    def _each(self, text: str, what: str) -> list[str]:
        """Every rank's ``text``, after a mismatch every rank has seen (untagged: every rank
        makes this all-gather)."""
        _, said = self._gather("all_gather", what, text.encode(), tagged=False)
        return [b.decode(errors="replace") for b in said or [b""] * self.world]

    def barrier(self, what: str) -> None:
        """Every rank reached this call (one tagged all-gather of headers)."""
        if self.active and self.world > 1:
            self._gather("barrier", what)

    # -- point to point --------------------------------------------------------------------

    def exchange(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        """Post every send and receive at once, then wait for all of them.

        Peers are group ranks. Messages between one pair of ranks match in the order they are
        listed, so both sides must list them in the same deterministic order.
        """
        if self._pending is not None:  # (a caller's bug: a deferred failure must meet a collective first)
            raise DistributedError(f"{self._pending[1]} failed here and was never agreed on: "
                                   f"{self._pending[0]}") from self._pending[0]
        if not sends and not recvs:
            return
        if not self.active:
            raise DistributedError("point-to-point transfer without an initialised process group")
        ops = []
        for peer, t in recvs:
            ops.append(dist.P2POp(dist.irecv, t, group=self.p2p_group, group_peer=peer))
        for peer, t in sends:
            ops.append(dist.P2POp(dist.isend, t, group=self.p2p_group, group_peer=peer))
        deadline = time.monotonic() + self.timeout_s
        try:
            for work in dist.batch_isend_irecv(ops):
                # a timed-out gloo wait closes the group's connections: nothing arrives later
                # into a buffer that was given up
                work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError as e:
            peers = sorted({p for p, _ in sends} | {p for p, _ in recvs})
            raise self._failed(f"transfer with rank(s) {peers}", None, e) from e


def describe(exc: BaseException) -> str:
    """One-line description of an exception, with its origin for unexpected ones."""
    if isinstance(exc, UnickptError):
        return str(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"
