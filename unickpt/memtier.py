"""The in-memory tier: snapshots in node memory, replicated to peer nodes, and the choice of
the checkpoint to resume from across the memory and durable tiers.

A snapshot is an ordinary node-local checkpoint (``{node}`` in the path) whose directory is
host memory (a tmpfs such as ``/dev/shm``), saved asynchronously with ``replicas=R``: every
node holds its own files and copies of the files of the ``R`` nodes before it, and the
manifest lists who holds what. This module holds what is particular to the tier:

* :func:`plan_budget` / :func:`check_budget`: the host memory the tier takes per node,
  checked before training starts (:class:`~unickpt.errors.MemoryBudgetError`);
* :func:`candidates`: the steps to resume from, newest first, memory before durable at the
  same step; a memory step counts when the nodes alive now hold every one of its files
  (originals or copies) under one manifest;
* :func:`clean`: remove a node's snapshots (clean shutdown, or a dead job's leftovers:
  ``unickpt clean-memory DIR``), refusing while a live process of the job owns them.

docs/memory_tier.md has the design, the guarantees and how to run it on a cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from dataclasses import dataclass

from . import liveness
from ._metrics import human_bytes, log
from .errors import MemoryBudgetError, StorageError, UnickptError
from .io import catalog as _catalog
from .io.localfs import check_private_dir, owned_by_me, read_json_record, replace_file
from .io.storage import expand_node, join_path, per_node, storage_for
from .manifest import MANIFEST_NAME, data_file_name
from .transport import Comm, node_id


__all__ = ["Candidate", "Budget", "plan_budget", "check_budget", "candidates", "claim", "clean", "OWNER_FILE", "JOB_KEY"]

JOB_KEY = "memory_tier_job"
"""Key of a snapshot's manifest ``extra`` naming the job it belongs to (its durable directory)."""
OWNER_FILE = ".unickpt-memory-owner.json"
"""Written into a node's memory directory by the job using it (host and the pids of its ranks
on the node): :func:`clean` refuses while any of them runs."""


@dataclass(frozen=True)
class Candidate:
    tier: str  # "memory" or "durable"
    step: int
    path: str  # for unickpt.load (memory: with {node})


@dataclass(frozen=True)
class Budget:
    """Host memory the tier takes on one node (bytes)."""

    own: int  # one snapshot's files written on this node
    copies: int  # one snapshot's copies of other nodes' files held here
    snapshots: int  # kept + the one being written
    replicas: int
    staging: int  # shared-memory staging of the node's ranks (the async save's copy)

    @property
    def per_snapshot(self) -> int:
        """One snapshot on this node, with its headers, manifest and side files (1% + 1 MiB)."""
        return (self.own + self.copies) * 101 // 100 + (1 << 20)

    @property
    def total(self) -> int:
        return self.snapshots * self.per_snapshot + self.staging

    def describe(self) -> str:
        return (f"{self.snapshots} snapshots (keep + 1 in flight) x ({human_bytes(self.own)} written here + "
                f"{human_bytes(self.copies)} of copies from {self.replicas} other node(s), + headers) + "
                f"{human_bytes(self.staging)} staging = {human_bytes(self.total)}")


def plan_budget(node_bytes: dict[str, int], node: str, keep: int, replicas: int, staging_bytes: int) -> Budget:
    """The budget of ``node``: ``node_bytes`` = stored bytes each node writes per snapshot, in
    node order (writers are balanced over ranks: a node's share is its ranks' share); it holds
    copies of the ``replicas`` nodes before it (see :func:`unickpt.replicate.replica_nodes`)."""
    from .replicate import replica_nodes

    nodes = list(node_bytes)
    copies = sum(node_bytes[n] for n in nodes if n != node and node in replica_nodes(nodes, n, replicas))
    return Budget(node_bytes[node], copies, keep + 1, replicas, staging_bytes)


def _held_bytes(path: str) -> int:
    """Bytes of committed snapshots already in a node's memory directory (rotated out by the
    new ones, so they count as available)."""
    total = 0
    try:
        for name in os.listdir(path):
            d = os.path.join(path, name)
            if name.startswith("step-") and os.path.isdir(d) and not os.path.islink(d):
                total += sum(e.stat().st_size for e in os.scandir(d) if e.is_file(follow_symlinks=False))
    except OSError:
        pass
    return total


def check_budget(comm: Comm, memory_dir: str, budget: Budget, limit: int | None = None) -> None:
    """Collective: raise :class:`MemoryBudgetError` on every rank when the tier does not fit
    on some node: the node's memory directory (its file system's free space) and the host's
    available memory (psutil) must both hold ``budget.total``, counting snapshots already
    there as reclaimable; ``limit`` (bytes per node) caps it further."""
    import psutil

    err = None
    try:
        here = expand_node(memory_dir)
        os.makedirs(here, exist_ok=True)
        held = _held_bytes(here)
        fs_free = shutil.disk_usage(here).free + held
        ram = psutil.virtual_memory().available + held
        room = min(fs_free, ram, limit if limit is not None else fs_free)
        if budget.total > room:
            which = ("the memory budget given" if limit is not None and room == limit else
                     f"free space of {here}" if room == fs_free else "available host memory")
            err = MemoryBudgetError(
                f"memory tier on node {node_id()!r} needs {human_bytes(budget.total)}: {budget.describe()}; "
                f"{which} is {human_bytes(room)} (snapshots already there counted as free). Keep fewer snapshots "
                "(memory_keep), fewer replicas, a larger tmpfs, or more nodes")
    except OSError as e:
        err = StorageError(e.errno or 0, f"memory directory: {e}", expand_node(memory_dir))
    comm.agree(err, "memory tier (checking the memory budget)")


def _step_report(memory_dir: str) -> dict:
    """This node's committed snapshots: ``{step: {digest, files needed, files here}}``."""
    from .format import Hasher

    storage, root = storage_for(memory_dir)
    out = {}
    if check_private_dir(root, "memory directory") is None:
        return out
    for step, path in _catalog.committed_steps(storage, root):
        if not owned_by_me(path) or not owned_by_me(storage.join(path, MANIFEST_NAME)):
            log.warning("memory tier: %s belongs to another user: not a resume candidate", path)
            continue
        try:
            _, blob, man = _catalog.open_checkpoint(storage, path)  # (holds the step its name says)
            here = sorted(n for n in storage.file_sizes(path) if data_file_name(n))
            out[str(step)] = {"digest": Hasher.of128(blob), "needed": sorted(man.files), "here": here,
                              "job": man.extra.get(JOB_KEY)}
        except (UnickptError, OSError) as e:
            log.warning("memory tier: snapshot %s does not read (%s): not a resume candidate", path, e)
    return out


def candidates(comm: Comm, memory_dir: str | None, durable_dir: str | None, storage_options=None,
               job: str | None = None) -> list[Candidate]:
    """Collective: every resumable step, newest first (the same list on every rank). A memory
    step is listed when it belongs to ``job`` (recorded in its manifest), the nodes of this
    job hold all its files (counting copies on other nodes) and every node that has it holds
    the same manifest; durable steps are every committed ``step-*`` under ``durable_dir`` (a
    load verifies them)."""
    def listing() -> tuple[dict, list[int]]:
        mine: dict = {}
        steps: list[int] = []  # durable steps this rank sees (a node-local durable_dir: its node's)
        if memory_dir is not None:
            mine = _step_report(memory_dir)
        if durable_dir is not None and (comm.rank == 0 or per_node(durable_dir)):
            storage, root = storage_for(durable_dir, storage_options)
            if storage.isdir(root):
                steps = [s for s, _ in _catalog.committed_steps(storage, root)]
        return mine, steps

    mine, steps = comm.step("resume (listing checkpoints)", listing)
    reports = [json.loads(b) for b in comm.all_gather_bytes(
        json.dumps({"node": node_id(), "steps": mine, "durable": steps}).encode(), "resume (checkpoints to resume from)")]
    # a durable step as the caller names it ({node} kept: the load finds the node that holds it)
    durable = [[s, join_path(durable_dir, _catalog.step_dirname(s))] for s in sorted({s for r in reports for s in r["durable"]})]
    by_step: dict[int, list[dict]] = {}
    seen_nodes = set()
    for r in reports:
        if r["node"] in seen_nodes:  # ranks of one node report the same directory
            continue
        seen_nodes.add(r["node"])
        for step, rec in r["steps"].items():
            by_step.setdefault(int(step), []).append(rec)
    out: list[Candidate] = []
    for step, recs in by_step.items():
        if len({r["digest"] for r in recs}) != 1:
            log.warning("memory tier: nodes hold different snapshots named step %d: not a resume candidate", step)
            continue
        if job is not None and recs[0].get("job") != job:
            log.warning("memory tier: step %d belongs to another job (%s): not a resume candidate", step, recs[0].get("job"))
            continue
        here = set().union(*(r["here"] for r in recs))
        missing = set(recs[0]["needed"]) - here
        if missing:
            log.info("memory tier: step %d is incomplete on the nodes alive (%d file(s) lost with their nodes)",
                     step, len(missing))
            continue
        out.append(Candidate("memory", step, os.path.join(memory_dir, _catalog.step_dirname(step))))
    out += [Candidate("durable", int(s), p) for s, p in durable]
    return sorted(out, key=lambda c: (-c.step, c.tier != "memory"))


def write_owner(memory_dir: str, pids: list[int], job: str | None = None) -> None:
    """Record the job and its ranks on this node (for :func:`claim` and :func:`clean`): host,
    each rank's pid and start time (pids repeat across PID namespaces). Written by rename
    inside the directory, never through a link (:func:`~unickpt.io.localfs.replace_file`)."""
    here = expand_node(memory_dir)
    os.makedirs(here, mode=0o700, exist_ok=True)
    check_private_dir(here, "memory directory")
    rec = {**liveness.group_record(pids), "job": job}  # (the format of earlier versions: they read it, it reads theirs)
    replace_file(here, OWNER_FILE, json.dumps(rec).encode())


def _owner(here: str) -> dict | None:
    """The owner record, read as a regular file without blocking or following a link (a FIFO
    or link planted under its name is no record), or None. One that another user owns (in a
    sticky shared directory) is refused (:class:`~unickpt.errors.InvalidArgumentError`): it
    could name any job and pids."""
    from .errors import InvalidArgumentError

    path = os.path.join(here, OWNER_FILE)
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return None
    if uid != os.geteuid():
        raise InvalidArgumentError(f"{path}: the memory tier's owner record belongs to another user (uid {uid}); "
                                   "give this job a memory directory of its own")
    return read_json_record(path)


def _live_owner(here: str, rec: dict | None = None) -> list[int]:
    """The pids of the record's job that still run on this host (the same processes: pid and
    start time; a record without start times is judged by pid: :func:`unickpt.liveness.group_alive`)."""
    return liveness.group_alive(rec if rec is not None else _owner(here))


def _snapshots(here: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(here) if n.startswith(("step-", ".step-")))
    except OSError:
        return []


def claim(memory_dir: str, job: str, pids: list[int]) -> None:
    """This node's memory directory for ``job`` (its first rank calls this at start): refused
    (:class:`~unickpt.errors.InvalidArgumentError`) when it is a link, when another job's
    snapshots are in it, or when other processes of a job still run on it; then the owner
    record names ``job`` and ``pids``."""
    from .errors import InvalidArgumentError

    here = expand_node(memory_dir)
    check_private_dir(here, "memory directory")  # (a link, another user's, or writable by others)
    rec = _owner(here)
    live = [p for p in _live_owner(here, rec) if p not in set(pids)]
    if live:
        raise InvalidArgumentError(f"{here}: in use by a running job (pids {live} on this host): one memory directory "
                                   "per job")
    if rec is not None and rec.get("job") != job and _snapshots(here):
        raise InvalidArgumentError(
            f"{here}: holds snapshots of another job ({rec.get('job')!r}); this job is {job!r}. Free them with "
            f"`unickpt clean-memory {here}` or give this job its own memory_dir")
    if rec is None and any(n.startswith("step-") for n in _snapshots(here)):
        raise InvalidArgumentError(f"{here}: holds step-* directories but no memory-tier owner record: not a memory "
                                   "directory of this job (another job's, or a durable checkpoint root?)")
    write_owner(memory_dir, pids, job)


def clean(memory_dir: str, *, force: bool = False, owner_pids: list[int] | None = None) -> list[str]:
    """Remove every snapshot (committed or not) from a node's memory directory, then the
    directory if it is left empty; returns what was removed. ``{node}`` in ``memory_dir``
    matches every node directory there whose owner record names this host (an epilog does
    not know the node id the job had). Refuses (:class:`~unickpt.errors.InvalidArgumentError`)
    a link, a directory without the tier's owner record (a durable checkpoint root, say), and
    one whose owning job still has a process on this host; ``force`` overrides the last two.
    ``owner_pids``: the caller's own job (a clean shutdown), never counted as live."""
    import glob

    from .errors import InvalidArgumentError

    p = os.fspath(memory_dir)
    if per_node(p):
        host = socket.gethostname()
        dirs = [d for d in sorted(glob.glob(glob.escape(p).replace(glob.escape("{node}"), "*")))
                if os.path.isdir(d) and owned_by_me(d) and (_owner(d) or {}).get("host") == host]
        return [x for d in dirs for x in clean(d, force=force, owner_pids=owner_pids)]
    here = p
    if check_private_dir(here, "memory directory") is None:
        return []
    rec = _owner(here)
    if rec is None and not force:
        raise InvalidArgumentError(f"{here}: no memory-tier owner record ({OWNER_FILE}): not a memory directory "
                                   "(a durable checkpoint root?); nothing removed (--force to remove its step-* anyway)")
    live = [x for x in _live_owner(here, rec) if x not in set(owner_pids or ())]
    if live and not force:
        raise InvalidArgumentError(f"{here}: snapshots of a running job (pids {live} on this host); stop it first, "
                                   "or pass force")
    removed = []
    # through a descriptor of the directory checked: nothing swapped in after the checks is removed
    dfd = os.open(here, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        checked, now = os.lstat(here), os.fstat(dfd)
        if (checked.st_dev, checked.st_ino) != (now.st_dev, now.st_ino) or now.st_uid != os.geteuid():
            raise InvalidArgumentError(f"{here}: the memory directory changed while it was being checked; nothing removed")
        for name in sorted(os.listdir(dfd)):
            st = os.lstat(name, dir_fd=dfd)
            if name.startswith(("step-", ".step-")) and stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)  # (fd-based: links inside are not followed)
                removed.append(os.path.join(here, name))
            elif name == OWNER_FILE or name.startswith(f".{OWNER_FILE}."):
                os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        os.rmdir(here)
    except OSError:
        pass
    return removed
