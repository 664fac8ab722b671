"""What a storage backend can do (a leaf: the backends, local and object stores, and the code
that reads the flags depend on it, not on each other)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a storage backend can do; the planner and the commit read these instead of
    assuming POSIX (docs/storage.md has the table per backend)."""

    atomic_rename: bool
    """A directory is renamed atomically and never over another one: the commit publishes the
    temporary directory by a rename. False: data objects go under the final prefix with
    unique names and the manifest, written last, is the commit marker."""
    shared_writes: bool
    """Several ranks may write disjoint ranges of one pre-sized file (holders write their
    pieces in place). False: every file has exactly one writer; pieces are gathered to it."""
    direct_io: bool
    """O_DIRECT writes (page cache bypassed)."""
    ranged_reads: bool
    """Reads of any byte range without reading the rest of the file."""
    multipart: bool
    """Large files are uploaded as parts, from memory (object stores)."""
    conditional_put: bool
    """Put-if-absent / put-if-unchanged enforced by the store: two commits to one path are
    decided by the store, across hosts (without it, and without ``locks``, the check before
    the put and the put are two steps)."""
    locks: bool
    """``lock(dir)`` serialises commits and sweeps of one directory between processes of one
    machine."""
    process_local: bool = False
    """The store exists in this process only (``memory://``): another process (a rank, the
    async writer) cannot see what this one writes, so saves and loads across processes are
    refused."""
