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
from dataclasses import dataclass

from . import commit as _commit
from ._metrics import human_bytes, log
from .errors import MemoryBudgetError, StorageError, UnickptError
from .manifest import MANIFEST_NAME, Manifest, data_file_name
from .storage import expand_node, per_node, storage_for
from .transport import Comm, node_id

__all__ = ["Candidate", "Budget", "plan_budget", "check_budget", "candidates", "clean", "OWNER_FILE"]

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

    node_share: int  # the node's share of one checkpoint (stored bytes / nodes)
    snapshots: int  # kept + the one being written
    replicas: int
    staging: int  # shared-memory staging of the node's ranks (the async save's copy)

    @property
    def total(self) -> int:
        return self.snapshots * (1 + self.replicas) * self.node_share + self.staging

    def describe(self) -> str:
        return (f"{self.snapshots} snapshots (keep + 1 in flight) x (1 + {self.replicas} replica(s)) x "
                f"{human_bytes(self.node_share)} (this node's share) + {human_bytes(self.staging)} staging = "
                f"{human_bytes(self.total)}")


def plan_budget(stored_bytes: int, nodes: int, keep: int, replicas: int, staging_bytes: int) -> Budget:
    return Budget(-(-stored_bytes // max(nodes, 1)), keep + 1, replicas, staging_bytes)


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
    from .loader import read_manifest_bytes
    from .format import Hasher

    storage, root = storage_for(memory_dir)
    out = {}
    if not storage.isdir(root):
        return out
    for step, path in _commit.committed_steps(storage, root):
        try:
            blob = read_manifest_bytes(storage, path)
            man = Manifest.from_json(blob, storage.join(path, MANIFEST_NAME))
            here = sorted(n for n in storage.file_sizes(path) if data_file_name(n))
            out[str(step)] = {"digest": Hasher.of128(blob), "needed": sorted(man.files), "here": here}
        except (UnickptError, OSError) as e:
            log.warning("memory tier: snapshot %s does not read (%s): not a resume candidate", path, e)
    return out


def candidates(comm: Comm, memory_dir: str | None, durable_dir: str | None, storage_options=None) -> list[Candidate]:
    """Collective: every resumable step, newest first (the same list on every rank). A memory
    step is listed when the nodes of this job hold all its files (counting copies on other
    nodes) and every node that has it holds the same manifest; durable steps are every
    committed ``step-*`` under ``durable_dir`` (a load verifies them)."""
    err = None
    mine: dict = {}
    durable: list = []
    try:
        if memory_dir is not None:
            mine = _step_report(memory_dir)
        if durable_dir is not None and comm.rank == 0:
            storage, root = storage_for(durable_dir, storage_options)
            if storage.isdir(root):
                durable = [[s, p] for s, p in _commit.committed_steps(storage, root)]
    except (UnickptError, OSError) as e:
        err = e
    comm.agree(err, "resume (listing checkpoints)")
    reports = [json.loads(b) for b in comm.all_gather_bytes(json.dumps({"node": node_id(), "steps": mine}).encode())]
    durable = json.loads(comm.broadcast_bytes(json.dumps(durable).encode() if comm.rank == 0 else None))
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
        here = set().union(*(r["here"] for r in recs))
        missing = set(recs[0]["needed"]) - here
        if missing:
            log.info("memory tier: step %d is incomplete on the nodes alive (%d file(s) lost with their nodes)",
                     step, len(missing))
            continue
        out.append(Candidate("memory", step, os.path.join(memory_dir, _commit.step_dirname(step))))
    out += [Candidate("durable", int(s), p) for s, p in durable]
    return sorted(out, key=lambda c: (-c.step, c.tier != "memory"))


def write_owner(memory_dir: str, pids: list[int]) -> None:
    """Record the job's ranks on this node (for :func:`clean` of a dead job)."""
    here = expand_node(memory_dir)
    os.makedirs(here, exist_ok=True)
    tmp = os.path.join(here, f".{OWNER_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"host": socket.gethostname(), "pids": sorted(pids)}, f)
    os.replace(tmp, os.path.join(here, OWNER_FILE))


def _live_owner(here: str) -> list[int]:
    try:
        with open(os.path.join(here, OWNER_FILE)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return []
    if rec.get("host") != socket.gethostname():
        return []
    live = []
    for pid in rec.get("pids", []):
        if isinstance(pid, int) and pid != os.getpid():
            try:
                os.kill(pid, 0)
                live.append(pid)
            except ProcessLookupError:
                pass
            except OSError:
                live.append(pid)
    return live


def clean(memory_dir: str, *, force: bool = False, owner_pids: list[int] | None = None) -> list[str]:
    """Remove every snapshot (committed or not) from this node's memory directory
    (``{node}`` expanded), then the directory if it is left empty; returns what was removed.
    Refuses (:class:`~unickpt.errors.InvalidArgumentError`) while a process of the job that
    owns the directory still runs on this host, unless ``force``; ``owner_pids``: the
    caller's own job (a clean shutdown), never counted as live."""
    from .errors import InvalidArgumentError

    here = expand_node(memory_dir) if per_node(memory_dir) else os.fspath(memory_dir)
    if not os.path.isdir(here):
        return []
    live = [p for p in _live_owner(here) if p not in set(owner_pids or ())]
    if live and not force:
        raise InvalidArgumentError(f"{here}: snapshots of a running job (pids {live} on this host); stop it first, "
                                   "or pass force")
    removed = []
    for name in sorted(os.listdir(here)):
        p = os.path.join(here, name)
        if name.startswith(("step-", ".step-")) and os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        elif name == OWNER_FILE or name.startswith(f".{OWNER_FILE}."):
            os.unlink(p)
    try:
        os.rmdir(here)
    except OSError:
        pass
    return removed
