"""The write transaction: a directory (checkpoint or exported folder) appears complete or
not at all, never replaces what it did not mean to, and leaves nothing a sweep can lose.

Call order (one :class:`Transaction` per destination; in a multi-rank save the
*coordinator* is the rank that manages the directory, every rank builds the object with the
same ``token`` to learn the temporary path):

=====================  ===========  ====================================================
call                   who          what holds when it returns
=====================  ===========  ====================================================
``begin()``            coordinator  the destination may be written (or
                                    :class:`CheckpointExistsError`); what it holds now is
                                    recorded; temporaries of dead owners are swept; the
                                    hidden ``.NAME.tmp-TOKEN`` exists with an owner record
``path(name)``         any          where file ``name`` goes; writers create, write and
                                    fsync their files themselves (``ExtentWriter.close``)
``put(name, data)``    coordinator  a small file (index, config) is written and fsynced
``commit(manifest)``   coordinator  under the parent's lock: the destination still holds
                                    what ``begin`` saw (else :class:`CheckpointExistsError`);
                                    the manifest is written last and fsynced, the owner
                                    record removed, the directory fsynced and renamed into
                                    place (never over another checkpoint), the parent
                                    fsynced: the new directory is durable and visible. A
                                    replaced one is gone only once the new one is in place
``abort()``            coordinator  the temporary is removed (never the destination)
=====================  ===========  ====================================================

The table is the protocol of stores with an atomic rename (:class:`RenamePublish`). On object
stores (:class:`MarkerPublish`) ``tmp`` is the final prefix, data files carry the write's
token in their names, side files are put once the write has won, and the commit is the
conditional put of the manifest. The transaction picks one of the two once, from
``storage.caps.atomic_rename``; everything that differs between them is behind
:class:`Publish`.

A directory is a *committed* checkpoint iff its name is final and it holds ``unickpt.json``
(:mod:`unickpt.io.catalog` lists them and picks the newest).

Sweeping (:func:`sweep_stale`, under the same lock as commits) removes a temporary only when
its owner is provably gone: the owner record names a process of this host that no longer
runs (the writer, or the trainer an asynchronous writer works for: such a writer outlives
its trainer only until its watchdog notices, and a resumed job's sweep must not race that),
or (another host, or no record) nothing in it changed for ``STALE_AFTER`` seconds. A
checkpoint moved aside by an overwrite that was interrupted between its two renames (stores
without an atomic exchange) is put back; the newest committed checkpoint is never deleted.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Protocol

from .. import liveness
from ..errors import CheckpointExistsError, CheckpointNotFoundError, InvalidArgumentError, StorageError, UnickptError
from ..liveness import record_alive
from ..manifest import INDEX_NAME, MANIFEST_NAME
from .catalog import check_destination, committed_steps, committed_under, is_committed, open_checkpoint, parse_checked, read_manifest_bytes, step_names, step_of_name
from .storage import MarkerStorage, RenameStorage, Storage


__all__ = ["Transaction", "Publish", "RenamePublish", "MarkerPublish", "sweep_stale", "retain", "retire"]

_TMP = re.compile(r"^\.(.+)\.(tmp|old|del)-([0-9a-f]{8,32})$")
OWNER = ".owner"
NO_OWNER_GRACE = 60.0
"""Seconds a temporary without an owner record is left alone (its owner may be between
creating it and recording itself, on another host whose lock this one does not see)."""
STALE_AFTER = 6 * 3600.0
"""Seconds without change after which a temporary whose owner cannot be checked (another
host, or no owner record) counts as abandoned."""


def new_token() -> str:
    return uuid.uuid4().hex[:16]


def tmp_name(final_name: str, token: str) -> str:
    return f".{final_name}.tmp-{token}"


def _aside_name(final_name: str, token: str) -> str:
    return f".{final_name}.old-{token}"


def _owner_alive(storage: Storage, tmp: str, now: float) -> bool:
    """False only when the temporary's owner is provably gone (see the module doc)."""
    try:
        rec = json.loads(storage.read_bytes(storage.join(tmp, OWNER), 4096))
    except Exception:  # no (readable) record: begin writes one at once and commit removes it
        # just before the rename, both under the lock this sweep holds; without one, the
        # owner died there (or wrote with another host's lock): gone after a short grace
        return now - storage.mtime(tmp) < NO_OWNER_GRACE
    return _record_alive(rec, storage.mtime(tmp), now)


def _record_alive(rec, mtime: float, now: float) -> bool:
    return record_alive(rec, mtime, now, grace=NO_OWNER_GRACE, stale=STALE_AFTER)


def sweep_stale(storage: Storage, root: str, final_name: str | None = None, timeout_s: float | None = None) -> list[str]:
    """Remove temporaries of interrupted writes under ``root`` (all, or those of one name)
    whose owner is provably gone, and put back checkpoints an interrupted overwrite moved
    aside. Returns the removed paths. Safe to call while other saves are in flight."""
    if not storage.caps.atomic_rename:
        removed = []
        for name in [final_name] if final_name is not None else storage.listdir(root):
            removed += _sweep_prefix(storage, storage.join(root, name))
        return removed
    return _sweep_dir(storage, root, final_name, timeout_s) if storage.isdir(root) else []


def _sweep_dir(storage: RenameStorage, root: str, final_name: str | None, timeout_s: float | None) -> list[str]:
    """Stores with an atomic rename: the temporaries (``.NAME.tmp-``, ``.old-``, ``.del-``)
    in directory ``root``, under its lock."""
    removed = []
    with storage.lock(root, timeout_s):
        now = time.time()
        names = storage.listdir(root)
        # a commit moves the old checkpoint aside under this lock: holding it, an .old- with a
        # temporary of the same token means that commit's process died between its renames
        asides = {m.group(3) for m in map(_TMP.match, names) if m and m.group(2) == "old"}
        for name in names:
            m = _TMP.match(name)
            if not m or (final_name is not None and m.group(1) != final_name):
                continue
            p = storage.join(root, name)
            final = storage.join(root, m.group(1))
            if m.group(2) == "old":  # an overwrite moved the old checkpoint here
                if not storage.exists(final):
                    if _restorable(storage, p, final):
                        storage.rename_dir(p, final)  # the new one never arrived: restore
                        from .._metrics import log

                        log.warning("restored %s from %s (an overwrite was interrupted)", final, p)
                    continue
                if not is_committed(storage, final):
                    continue  # keep it until a committed checkpoint is in place
            elif m.group(2) == "tmp" and m.group(3) not in asides and _owner_alive(storage, p, now):
                continue
            storage.remove_tree(p)
            removed.append(p)
    return removed


def _restorable(storage: RenameStorage, aside: str, final: str) -> bool:
    """An entry named like a checkpoint an overwrite moved aside is put back only if it is
    one: a real directory holding a committed checkpoint whose step its final name allows
    (a file, FIFO or a planted copy of another step is left where it is, with a warning)."""
    try:
        if is_committed(storage, aside):
            parse_checked(final, read_manifest_bytes(storage, aside))  # (a step-N name must hold step N)
            return True
        why = "not a committed checkpoint directory"
    except Exception as e:
        why = str(e)
    from .._metrics import log

    log.warning("not restoring %s as %s: %s", aside, final, why)
    return False


_OBJ_OWNER = re.compile(r"^\.owner-([0-9a-f]{8,32})$")
_OBJ_DATA = re.compile(r"^[a-z][a-z0-9_]{0,31}-\d{5,}-of-\d{5,}\.([0-9a-f]{16})\.safetensors$")
SIDE_FILES = (INDEX_NAME, "config.json", "generation_config.json")
"""Fixed-name files a checkpoint may hold beside its data (put after the commit on object stores)."""


def _token_of(name: str) -> str | None:
    m = _OBJ_OWNER.match(name) or _OBJ_DATA.match(name)
    return m.group(1) if m else None


def _referenced(storage: Storage, prefix: str) -> set[str] | None:
    """Names the committed manifest under ``prefix`` lists (empty: no manifest; None: a
    manifest that does not read, so nothing may be touched)."""
    from ..manifest import Manifest

    if not storage.isfile(storage.join(prefix, MANIFEST_NAME)):
        return set()
    try:
        man = Manifest.from_json(read_manifest_bytes(storage, prefix), storage.join(prefix, MANIFEST_NAME))
    except CheckpointNotFoundError:
        return set()
    except Exception:
        return None
    return {MANIFEST_NAME, *man.files, *man.aux}


def _sweep_prefix(storage: MarkerStorage, prefix: str) -> list[str]:
    """Object stores: delete the objects of dead writes under checkpoint prefix ``prefix``:
    data files named with a write's token, and owner records, that the committed manifest
    (if any) does not list and whose owner is provably gone. Nothing else is ever deleted,
    and nothing of a step a live reader lease names (a retired version still being read)."""
    from .leases import leased_steps

    step = step_of_name(storage.basename(prefix))
    if step is not None and step in leased_steps(storage, storage.parent(prefix)):
        return []
    objs = {m.key: m for m in storage.list_objects(prefix)}
    remains = step is not None and bool(objs) and all(n in SIDE_FILES for n in objs)  # (of a step-* prefix only)
    if not any(_token_of(n) for n in objs) and not remains:
        return []
    now = time.time()
    owners = {}
    for name, meta in objs.items():
        m = _OBJ_OWNER.match(name)
        if m:
            try:
                rec = json.loads(storage.read_bytes(storage.join(prefix, name), 1 << 16))
                alive = _record_alive(rec, meta.mtime, now)
            except CheckpointNotFoundError:  # listed, gone now: its write just committed or aborted
                alive = True
            except Exception:  # unreadable: its owner cannot be checked
                alive = now - meta.mtime < STALE_AFTER
            owners[m.group(1)] = alive
    # read the manifest after the owner records: a commit puts the manifest before it
    # deletes its record, so a write whose record vanished is listed by the manifest read here
    referenced = _referenced(storage, prefix)
    if referenced is None:  # a manifest that does not read: touch nothing (a reader reports it)
        return []
    doomed = []
    for name, meta in objs.items():
        tok = _token_of(name)
        if tok is None or name in referenced:
            continue
        if tok in owners:
            if owners[tok]:
                continue
        elif now - meta.mtime < NO_OWNER_GRACE:  # its owner may be about to record itself
            continue
        doomed.append(name)
    if not referenced and step is not None:  # no manifest: side files (put only after a commit) left alone
        rest = [n for n in objs if n not in doomed]  # are a retired checkpoint's remains (its retire was cut
        if rest and all(n in SIDE_FILES for n in rest):  # short, or waited for a reader's lease)
            doomed += rest
    doomed.sort(key=lambda n: (n.startswith(".owner-"), n))  # owner records last
    paths = [storage.join(prefix, n) for n in doomed]
    if paths:
        storage.remove_files(paths)
    return paths


def retire(storage: Storage, path: str, timeout_s: float | None = None, step: int | None = None) -> bool:
    """Delete a committed checkpoint without ever leaving half of it visible: it is renamed
    to a hidden ``.NAME.del-TOKEN`` first (atomic), then removed; a crash in between leaves
    a directory that any sweep removes. On object stores the manifest (the commit marker)
    is deleted first, then the rest: a half-deleted checkpoint is never committed. ``step``:
    kept (False returned) while a live reader lease names it (:mod:`.leases`, checked under
    the parent's commit lock, where readers take theirs)."""
    from .leases import leased_steps

    if not storage.caps.atomic_rename:
        storage.remove_file(storage.join(path, MANIFEST_NAME))  # no reader starts on it from here on
        # a reader writes its lease before it checks the manifest: one that saw the manifest
        # wrote its lease before the delete above, so this listing sees it (object stores list
        # what was written before); its files then stay until the leases are gone (sweep_stale)
        if step is not None and step in leased_steps(storage, storage.parent(path)):
            return False
        storage.remove_tree(path)
        return True

    parent, name = storage.parent(path), storage.basename(path)
    gone = storage.join(parent, f".{name}.del-{new_token()}")
    with storage.lock(parent, timeout_s):
        if step is not None and step in leased_steps(storage, parent, clear=True):
            return False
        storage.rename_dir(path, gone)
    _fsync_quietly(storage, parent)
    storage.remove_tree(gone)
    return True


def retain(storage: Storage, root: str, keep: int, node: str | None = None, timeout_s: float | None = None) -> list[str]:
    """Retire all but the newest ``keep`` committed ``step-*`` checkpoints under ``root``;
    return the retired paths. An old step whose directory holds another committed
    checkpoint (an export or copy put inside it) is kept, with a warning. ``node``: ``root``
    is that node's directory of node-local checkpoints, which holds the files written on the
    node and their copies, not all."""
    if type(keep) is not int or keep < 1:
        raise InvalidArgumentError(f"keep must be an integer of at least 1, got {keep!r}")
    steps = committed_steps(storage, root)
    from .files import open_files

    for _, kept in steps[-keep:]:  # delete older ones only behind checkpoints that read
        try:
            man = open_checkpoint(storage, kept)[2]
            held = [f for f, fe in man.files.items() if node is None or fe.node == node or node in fe.replicas]
            readers: dict = {}  # each a regular file of its recorded size, header intact, as a load opens it
            open_files(storage, kept, man, held, readers)
            for r in readers.values():
                r.close()
        except Exception as e:
            from .._metrics import log

            log.warning("retention skipped: %s does not read (%s); older checkpoints are kept", kept, e)
            return []
    out = []
    for step, old in steps[:-keep]:
        nested = committed_under(storage, old, below=True)
        if nested is not None:  # not superseded by the newer steps: nothing here may delete it
            from .._metrics import log

            log.warning("retention kept %s: it holds another committed checkpoint, %s (move that one out "
                        "to let %s go)", old, nested, old)
            continue
        if retire(storage, old, timeout_s, step):
            out.append(old)
        else:
            from .._metrics import log

            log.info("retention kept %s: a reader holds a lease on it", old)
    return out


class Publish(Protocol):
    """How a :class:`Transaction` publishes, chosen once from ``storage.caps.atomic_rename``:
    :class:`RenamePublish` (a temporary sibling directory renamed into place) or
    :class:`MarkerPublish` (objects under the final prefix, the manifest the commit marker).
    One instance per transaction, called by it alone; it keeps what only it needs, the
    transaction what both share (destination, token, what ``begin`` saw) and the call order."""

    marker: bool  # the manifest is the commit marker (``Transaction.marker``)

    def temporary(self, txn: Transaction) -> str: ...  # where the files go (``Transaction.tmp``)
    def owner_name(self, txn: Transaction) -> str: ...  # the owner record's name, in ``temporary``
    def file_name(self, txn: Transaction, name: str) -> str: ...  # ``Transaction.file_name``
    def state(self, txn: Transaction) -> tuple | None: ...  # what the destination holds now
    def check(self, txn: Transaction) -> None: ...  # what may stand there (after the shared checks)
    def begin(self, txn: Transaction) -> None: ...
    def put(self, txn: Transaction, name: str, data: bytes) -> None: ...
    def commit(self, txn: Transaction, manifest: bytes | None) -> None: ...
    def abort(self, txn: Transaction) -> None: ...  # only a write that began and did not commit


class Transaction:
    """One atomic write of directory ``final`` (see the module doc for the call order).

    ``folder=True``: the destination is not a checkpoint (an exported model folder), so any
    directory there may be replaced with ``overwrite``.
    """

    def __init__(self, storage: Storage, final: str, *, overwrite: bool = False, token: str | None = None,
                 folder: bool = False, step: int | None = None, timeout_s: float | None = None) -> None:
        if not folder:
            check_destination(final, step)  # (a step-N directory holding another step is refused by every reader)
        self.storage, self.final, self.overwrite, self.folder = storage, final, overwrite, folder
        self.timeout_s = timeout_s  # bounds the wait for the parent's commit lock (LockTimeoutError)
        self.token = token or new_token()
        self.parent, self.name = storage.parent(final), storage.basename(final)
        self.publish: Publish = RenamePublish() if storage.caps.atomic_rename else MarkerPublish()
        self.tmp = self.publish.temporary(self)
        self._owner = self.path(self.publish.owner_name(self))
        self._seen: tuple | None = None
        self._began = False
        self._committed = False

    @property
    def marker(self) -> bool:
        """Object stores (no atomic rename): objects go under the final prefix with names
        unique to this write; the manifest, written last, commits them."""
        return self.publish.marker

    def path(self, name: str) -> str:
        return self.storage.join(self.tmp, name)

    def file_name(self, name: str) -> str:
        """The name data file ``name`` is stored under: itself, or on object stores (unless
        an exported folder) ``STEM.TOKEN.safetensors``, so that a write never touches the
        objects of a committed checkpoint or of a concurrent write."""
        return self.publish.file_name(self, name)

    def _state(self) -> tuple | None:
        """What the destination holds now: None (nothing), or an identity of the checkpoint
        (its manifest) or folder there."""
        return self.publish.state(self)

    def _check_destination(self) -> None:
        s, final = self.storage, self.final
        step = None if self.folder else step_of_name(self.name)
        if step is not None:  # step-12 and step-00000012 are both step 12: one of them at most
            for other in set(step_names(step)) - {self.name}:
                if is_committed(s, s.join(self.parent, other)):
                    raise CheckpointExistsError(f"{final}: step {step} is already committed as {other} beside it; a "
                                                "root holds one checkpoint per step (save under that name, with "
                                                "overwrite=True to replace it)")
        self.publish.check(self)

    def _survey(self) -> None:
        """``begin``'s first steps: sweep dead writes of this name, check the destination,
        record what it holds."""
        sweep_stale(self.storage, self.parent, self.name, self.timeout_s)  # first: it may put back a checkpoint moved aside
        self._check_destination()
        self._seen = self._state()

    def _record_owner(self) -> None:
        self._began = True
        self.storage.write_bytes(self._owner, json.dumps(liveness.me()).encode())

    def _check_unchanged(self) -> None:
        if self._state() != self._seen:  # (what begin checked still holds when this does)
            raise CheckpointExistsError(f"{self.final}: another write committed here while this one was running; "
                                        "nothing of this one was published")

    def begin(self) -> None:
        self.publish.begin(self)

    def put(self, name: str, data: bytes) -> None:
        self.publish.put(self, name, data)

    def commit(self, manifest: bytes | None = None) -> None:
        self.publish.commit(self, manifest)

    def abort(self) -> None:
        """Remove what this write left, unless it committed (or may have: its objects are then
        left to sweeps, which delete them only if no committed manifest lists them)."""
        if not self._began or self._committed:
            return
        self.publish.abort(self)


class RenamePublish:
    """Stores with an atomic directory rename (POSIX): the files go into the hidden sibling
    ``.NAME.tmp-TOKEN``, published by a rename that never replaces another directory (or by
    an exchange, or aside-and-rename, under ``overwrite``), under the parent's lock."""

    marker = False

    def temporary(self, txn: Transaction) -> str:
        return txn.storage.join(txn.parent, tmp_name(txn.name, txn.token))

    def owner_name(self, txn: Transaction) -> str:
        return OWNER

    def file_name(self, txn: Transaction, name: str) -> str:
        return name

    def state(self, txn: Transaction) -> tuple | None:
        s = txn.storage
        if not s.exists(txn.final):
            return None
        if txn.folder or not is_committed(s, txn.final):
            return ("dir", s.identity(txn.final))
        return ("checkpoint", s.identity(s.join(txn.final, MANIFEST_NAME)))

    def check(self, txn: Transaction) -> None:
        s, final = txn.storage, txn.final
        if not s.exists(final):
            return
        if not s.isdir(final):
            raise CheckpointExistsError(f"{final}: exists and is not a directory")
        if txn.folder:
            found = committed_under(s, final)  # at any depth, under any name: a replaced folder goes whole
            if found is not None:
                what = "is a checkpoint" if found == final else f"holds a committed checkpoint ({found})"
                raise CheckpointExistsError(f"{final}: {what}; an export never replaces checkpoints (choose another "
                                            "destination)")
            if not txn.overwrite:
                raise CheckpointExistsError(f"{final}: already exists (use --overwrite / overwrite=True to replace it)")
            return
        if is_committed(s, final):
            if not txn.overwrite:
                raise CheckpointExistsError(
                    f"{final}: a committed checkpoint is already there (pass overwrite=True to replace it)")
            inner = committed_under(s, final, below=True)
            if inner is not None:  # replacing this one would delete that one, which nothing newer replaces
                raise CheckpointExistsError(f"{final}: holds another committed checkpoint ({inner}); refusing to "
                                            "replace it")
        elif s.listdir(final):
            raise CheckpointExistsError(f"{final}: exists, is not a checkpoint and is not empty; refusing to replace it")

    def begin(self, txn: Transaction) -> None:
        s = txn.storage
        try:
            if not s.isdir(txn.parent):
                s.makedirs(txn.parent)
            txn._survey()
            with s.lock(txn.parent, txn.timeout_s):  # a sweep never sees the temporary without its owner record
                s.makedirs(txn.tmp)
                txn._record_owner()
        except OSError as e:  # (a StorageError already names its path)
            if isinstance(e, UnickptError):
                raise
            raise StorageError(e.errno, f"cannot write {txn.final}: {e.strerror or e}", e.filename) from None

    def put(self, txn: Transaction, name: str, data: bytes) -> None:
        txn.storage.write_bytes(txn.path(name), data)

    def commit(self, txn: Transaction, manifest: bytes | None) -> None:
        s = txn.storage
        with s.lock(txn.parent, txn.timeout_s):
            txn._check_unchanged()
            if manifest is not None:
                s.write_bytes(txn.path(MANIFEST_NAME), manifest)
            s.remove_file(txn._owner)
            s.fsync_dir(txn.tmp)
            replaced = self._rename(txn)
            txn._committed = True
        if replaced is not None:  # the replaced directory, deleted outside the lock
            s.remove_tree(replaced)

    def _rename(self, txn: Transaction) -> str | None:
        """Rename the temporary into place; return where a replaced directory now is."""
        s, final, tmp = txn.storage, txn.final, txn.tmp
        replaced = None
        if not s.exists(final):
            s.rename_dir(tmp, final)
        elif not s.listdir(final) and not txn.folder:  # an empty directory stood there
            s.remove_tree(final)
            s.rename_dir(tmp, final)
        elif s.exchange_dirs(tmp, final):
            replaced = tmp  # now holds the replaced directory
        else:  # no atomic exchange: move the old one aside (a sweep puts it back if we die here)
            replaced = s.join(txn.parent, _aside_name(txn.name, txn.token))
            s.rename_dir(final, replaced)
            try:
                s.rename_dir(tmp, final)
            except BaseException:
                s.rename_dir(replaced, final)
                raise
        _fsync_quietly(s, txn.parent)
        return replaced

    def abort(self, txn: Transaction) -> None:
        txn.storage.remove_tree(txn.tmp)


class MarkerPublish:
    """Object stores (no rename): the objects go under the final prefix with names unique to
    this write (``file_name``; fixed-name side files only once it has won); the manifest,
    put last and conditionally, is the commit marker."""

    marker = True

    def __init__(self) -> None:
        self.old_files: set[str] = set()  # an overwrite: the replaced checkpoint's files, deleted after the commit
        self.side: dict[str, bytes] = {}  # side files, put after the commit
        self.attempted = False  # the commit marker was sent: this write may be committed

    def temporary(self, txn: Transaction) -> str:
        return txn.final

    def owner_name(self, txn: Transaction) -> str:
        return f".owner-{txn.token}"

    def file_name(self, txn: Transaction, name: str) -> str:
        if not txn.folder and name.endswith(".safetensors"):
            return f"{name[: -len('.safetensors')]}.{txn.token}.safetensors"
        return name

    def state(self, txn: Transaction) -> tuple | None:
        s = txn.storage  # only the manifest (the commit marker) counts
        ident = None if txn.folder else s.identity(s.join(txn.final, MANIFEST_NAME))
        return None if ident is None else ("checkpoint", ident)

    def check(self, txn: Transaction) -> None:
        """What may stand under the destination prefix."""
        s, final = txn.storage, txn.final
        objs = s.list_objects(final)
        if not objs:
            return
        committed = any(m.key == MANIFEST_NAME for m in objs)
        if txn.folder:
            if committed or any(m.key.endswith("/" + MANIFEST_NAME) for m in objs):
                raise CheckpointExistsError(f"{final}: is a checkpoint or holds committed checkpoints; an export "
                                            "never replaces them (choose another destination)")
            if not txn.overwrite:
                raise CheckpointExistsError(f"{final}: already exists (use --overwrite / overwrite=True to replace it)")
            s.remove_tree(final)  # (not atomic on an object store: docs/storage.md)
            return
        if committed:
            if not txn.overwrite:
                raise CheckpointExistsError(
                    f"{final}: a committed checkpoint is already there (pass overwrite=True to replace it)")
            return
        # side files may remain of a checkpoint whose deletion was interrupted; this write
        # replaces them after its commit
        foreign = [m.key for m in objs if _token_of(m.key) is None and m.key not in SIDE_FILES]
        if foreign:
            raise CheckpointExistsError(f"{final}: holds objects that are not a checkpoint (e.g. {foreign[0]!r}); "
                                        "refusing to write here")

    def begin(self, txn: Transaction) -> None:
        txn._survey()
        if txn._seen is not None and txn._seen[0] == "checkpoint":  # an overwrite: remember what to delete
            from ..manifest import Manifest

            try:
                old = Manifest.from_json(read_manifest_bytes(txn.storage, txn.final), txn.path(MANIFEST_NAME))
                self.old_files = set(old.files)
            except Exception:  # unreadable: its objects are left for a sweep (they are not ours)
                self.old_files = set()
        txn._record_owner()

    def put(self, txn: Transaction, name: str, data: bytes) -> None:
        if txn.folder:
            txn.storage.write_bytes(txn.path(name), data)
        else:  # fixed names: written only once this write has won
            self.side[name] = bytes(data)

    def commit(self, txn: Transaction, manifest: bytes | None) -> None:
        """The manifest is the commit marker, put only if the destination still holds what
        ``begin`` saw (a conditional put where the store has one)."""
        s = txn.storage
        txn._check_unchanged()
        if manifest is not None:
            seen = txn._seen
            etag = seen[1][1] if seen is not None and seen[0] == "checkpoint" else None
            self.attempted = True
            try:
                s.put_marker(txn.path(MANIFEST_NAME), manifest, if_absent=etag is None, if_match=etag)
            except BaseException as e:  # a lost answer, a retried put, a conflict: what is there now?
                self._resolve(txn, manifest, e)
        txn._committed = True
        self._after_commit(txn, manifest)

    def _after_commit(self, txn: Transaction, manifest: bytes | None) -> None:
        """Committed: the side files, then the owner record and the replaced checkpoint's
        data go (failures are logged: what is left is swept later)."""
        s = txn.storage
        try:
            for name, data in self.side.items():  # index, config.json: only the winner writes them
                s.write_bytes(txn.path(name), data)
        except Exception as e:
            from .._metrics import log

            log.warning("%s: committed, but writing %s failed (the checkpoint loads; verify and export will "
                        "report it missing): %s", txn.final, ", ".join(self.side), e)
        try:
            s.remove_file(txn._owner)
            if manifest is not None:  # the replaced checkpoint's data (never this write's: names differ by token)
                s.remove_files([txn.path(n) for n in sorted(self.old_files) if _token_of(n) != txn.token])
        except Exception as e:  # committed: what is left is swept later
            from .._metrics import log

            log.warning("%s: committed, but cleaning up after the commit failed: %s", txn.final, e)

    def _resolve(self, txn: Transaction, manifest: bytes, error: BaseException) -> None:
        """The conditional put of the manifest failed: committed if the manifest there now is
        this write's (its answer was lost and a retry found it); lost if it is another's;
        unknown if it cannot be read (then this write's objects are kept: ``abort`` leaves
        them to a sweep, which deletes them only if no manifest lists them)."""
        s = txn.storage
        try:
            now = s.read_bytes(txn.path(MANIFEST_NAME), max(len(manifest), 1) + 1)
        except CheckpointNotFoundError:
            now = None
        except Exception as e:
            raise StorageError(getattr(e, "errno", None) or 5,
                               f"the commit's outcome is unknown (putting the manifest failed: {error}; reading it "
                               f"back failed: {e}); check unickpt.latest() before relying on it",
                               txn.path(MANIFEST_NAME)) from error
        if now == manifest:
            from .._metrics import log

            log.warning("%s: the manifest put reported %s, but the manifest there is this write's: committed",
                        txn.final, type(error).__name__)
            return
        self.attempted = False  # another write's manifest, or none: this write is not committed
        raise error

    def abort(self, txn: Transaction) -> None:
        if self.attempted:  # it may have committed: its objects are left to sweeps
            return
        s = txn.storage
        mine = [m.key for m in s.list_objects(txn.final) if _token_of(m.key) == txn.token]
        s.remove_files([txn.path(n) for n in sorted(set(mine), key=lambda n: n.startswith(".owner-"))])


def _fsync_quietly(storage: RenameStorage, parent: str) -> None:
    """After the rename the checkpoint is committed: a failing directory fsync is logged, not raised."""
    try:
        storage.fsync_dir(parent)
    except OSError as e:
        from .._metrics import log

        log.warning("fsync of %s failed after commit: %s", parent, e)
