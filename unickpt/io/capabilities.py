"""What a storage backend can do (a leaf: the backends, local and object stores, and the code
that reads the flags depend on it, not on each other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a storage backend can do; the planner, the commit and the catalog read these
    instead of assuming POSIX (docs/storage.md has the table per backend). Only flags that
    code reads belong here: what a backend does on its own (O_DIRECT, multipart uploads,
    conditional puts, locks) is its own business, behind the ``Storage`` methods."""

    atomic_rename: bool
    """A directory is renamed atomically and never over another one: the commit publishes the
    temporary directory by a rename. False: data objects go under the final prefix with
    unique names and the manifest, written last, is the commit marker. Read by the write
    transaction and its sweep and retirement (``commit``), the catalog (what a committed
    checkpoint is, links), ``offline`` (aborting a write) and ``replicate`` (refused on
    object stores)."""
    shared_writes: bool
    """Several ranks may write disjoint ranges of one pre-sized file (holders write their
    pieces in place). False: every file has exactly one writer; pieces are gathered to it.
    Read by the save's planner (:mod:`unickpt.saving.pipeline`)."""
    process_local: bool = False
    """The store exists in this process only (``memory://``): another process (a rank, the
    async writer) cannot see what this one writes, so saves and loads across processes are
    refused. Read by :mod:`unickpt.loading.pipeline` (a load on several ranks) and ``api`` (a save on several ranks or
    asynchronous)."""
