"""The catalog of a checkpoint root: which ``step-*`` directories are committed checkpoints,
which one is the newest, and whether a checkpoint holds the step its name says.

A directory is a *committed* checkpoint iff its name is final and it holds ``unickpt.json``
(on object stores: the manifest object exists under the prefix). "The newest" is found by
scanning ``step-*`` names, never through a pointer file that could run ahead of durable data.

Every way of picking a checkpoint by its name goes through :func:`open_checkpoint`: ``load``,
``read_manifest``, ``latest``, the DCP reader, retention, the trainer's resume and the CLI.
It reads the manifest (capped by the data the checkpoint holds), parses it and refuses a
``step-N`` directory whose manifest says another step: a copy of step 2 put under the name
``step-00000013`` is never taken as step 13, whether it was found under a root or named
outright (a :class:`~unickpt.errors.FormatError`; the trainer's resume logs it and takes the
next step, retention then deletes nothing).
"""

from __future__ import annotations

import os
import re
import stat

from ..errors import CheckpointNotFoundError, FormatError, InvalidArgumentError
from ..manifest import MANIFEST_NAME, Manifest, data_file_name, manifest_cap
from .storage import Storage


__all__ = ["step_dirname", "step_names", "step_of_name", "is_committed", "committed_under", "committed_steps", "check_step_name",
           "check_destination", "resolve", "read_manifest_bytes", "open_checkpoint", "newest"]

_STEP = re.compile(r"^step-([0-9]+)$")  # ASCII digits; the two spellings of a step checked below


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def step_names(step: int) -> tuple[str, ...]:
    """The names of step ``step``'s directory: unickpt's ``step-%08d`` and torchtitan's
    ``step-%d`` (one name from step 10^7 on)."""
    return tuple(dict.fromkeys((step_dirname(step), f"step-{step}")))


def step_of_name(name: str) -> int | None:
    """The step a checkpoint directory's name gives: unickpt's ``step-00000012`` or
    torchtitan's ``step-12`` (both 12); None for any other spelling (``step-013``,
    ``step-0000000013``), so that a step has at most two names."""
    m = _STEP.match(name)
    if m is None or len(m.group(1)) > 20:
        return None
    n = int(m.group(1))
    return n if name in step_names(n) else None


def is_committed(storage: Storage, path: str) -> bool:
    """``path`` is a directory holding a manifest that is a regular file (a link, FIFO or
    directory named ``unickpt.json`` is refused by every reader, so it commits nothing).
    On object stores: the manifest object exists under the prefix."""
    if not storage.caps.atomic_rename:
        return storage.isfile(storage.join(path, MANIFEST_NAME))
    return storage.isdir(path) and storage.isfile(storage.join(path, MANIFEST_NAME))


def committed_under(storage: Storage, path: str, *, below: bool = False) -> str | None:
    """The first committed checkpoint at ``path`` or anywhere under it (``below``: under it
    only), or None. Real directories only: links are not followed, as no reader follows them.
    Object stores: one recursive listing (a walk would list every prefix, one request each)."""
    if not storage.caps.atomic_rename:
        for key in sorted(m.key for m in storage.list_objects(path)):  # type: ignore[attr-defined]
            if key == MANIFEST_NAME and not below:
                return path
            if key.endswith("/" + MANIFEST_NAME):
                return storage.join(path, key[: -len(MANIFEST_NAME) - 1])
        return None
    stack = [path]
    while stack:
        p = stack.pop()
        if (p != path or not below) and is_committed(storage, p):
            return p
        stack.extend(q for q in (storage.join(p, n) for n in storage.listdir(p)) if storage.isdir(q))
    return None


def committed_steps(storage: Storage, root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of committed ``step-*`` checkpoints under ``root``, oldest first
    (links are not followed: a checkpoint is a real directory under its root). Names only:
    :func:`open_checkpoint` checks that one holds the step its name says."""
    out: dict[int, str] = {}
    for name in storage.listdir(root):
        step = step_of_name(name)
        if step is not None:
            p = storage.join(root, name)
            if is_committed(storage, p):
                if step in out:  # step-12 and step-00000012: which one is step 12 is not for us to guess
                    raise FormatError(f"{root}: two committed checkpoints name step {step}: "
                                      f"{os.path.basename(out[step].rstrip('/'))} and {name}; remove or rename one")
                out[step] = p
    return sorted(out.items())


def check_step_name(path: str, saved: int | None) -> None:
    """A checkpoint whose directory is named ``step-N`` must hold step N (a copy of an older
    step put under a newer name would pass for the newest: loads would take it and retention
    delete the real newest behind it): FormatError otherwise. Directories with other names
    pass; so do manifests without a step, which every save now records for a step-N name
    (older ones: with a warning that they cannot be checked)."""
    named = step_of_name(os.path.basename(os.fspath(path).rstrip("/")))
    if named is not None and saved is not None and saved != named:
        raise FormatError(f"{path}: named step {named}, but its manifest says step {saved} (a copy or a rename?): "
                          f"not taken as step {named}")
    if named is not None and saved is None:  # saved before saves recorded the step of a step-N name
        from .._metrics import log

        log.warning("%s: its manifest records no step (saved without step= by unickpt before it recorded the step "
                    "of a step-N name): cannot check that it holds step %d", path, named)


def check_destination(path: str, step: int | None) -> None:
    """A save of ``step`` into ``path`` must not commit a checkpoint that every reader
    refuses: a ``step-N`` directory holding another step (InvalidArgumentError, before
    anything is written)."""
    named = step_of_name(os.path.basename(os.fspath(path).rstrip("/")))
    if named is not None and step is not None and step != named:
        raise InvalidArgumentError(f"{os.fspath(path)}: saving step {step} into a directory named for step {named}; "
                                   f"name it {step_dirname(step)} (loads refuse a step-N directory holding another step)")


def resolve(storage: Storage, path: str) -> str:
    """A committed checkpoint directory: ``path`` itself, or the newest committed
    ``step-*`` checkpoint under it (by name; :func:`open_checkpoint` checks it)."""
    if _committed_or_link(storage, path):
        return path
    steps = committed_steps(storage, path)
    if steps:
        return steps[-1][1]
    if storage.exists(storage.join(path, MANIFEST_NAME)):  # there, but not a regular file: say what it is
        storage.read_bytes(storage.join(path, MANIFEST_NAME), 0)
    if (storage.isdir(path) if not storage.caps.atomic_rename else _is_dir_link(path)):
        raise CheckpointNotFoundError(
            f"{path}: no committed checkpoint here ({MANIFEST_NAME} missing) and no committed step-* checkpoint below"
        )
    if storage.caps.atomic_rename and os.path.lexists(path):  # a file, FIFO, device...: say which (never opened)
        from .localfs import kind_of

        st = os.stat(path) if os.path.exists(path) else os.lstat(path)  # (stat never opens: a FIFO cannot block it)
        kind = "a file" if stat.S_ISREG(st.st_mode) else kind_of(st.st_mode)
        raise CheckpointNotFoundError(f"{path}: is {kind}, not a checkpoint directory")
    raise CheckpointNotFoundError(f"{path}: no such checkpoint directory")


def read_manifest_bytes(storage: Storage, ckpt: str) -> bytes:
    """The manifest's bytes, refused beyond what a checkpoint of this size can need
    (:func:`~unickpt.manifest.manifest_cap` of the disk space its data files take: other
    files and sparse sizes do not count), so a crafted manifest cannot exhaust memory."""
    total = sum(n for name, n in storage.file_sizes(ckpt).items() if data_file_name(name))
    return storage.read_bytes(storage.join(ckpt, MANIFEST_NAME), manifest_cap(total))


def parse_checked(ckpt: str, blob: bytes, where: str | None = None) -> Manifest:
    """The manifest ``blob`` of checkpoint ``ckpt``, parsed, and holding the step its name says."""
    man = Manifest.from_json(blob, where or os.path.join(ckpt, MANIFEST_NAME))
    check_step_name(ckpt, man.step)
    return man


def open_checkpoint(storage: Storage, path: str) -> tuple[str, bytes, Manifest]:
    """``(checkpoint, manifest bytes, manifest)`` for ``path``: ``path`` itself if it is a
    committed checkpoint, else the newest committed ``step-*`` under it. The one way the
    library picks a checkpoint: its manifest is read (capped), parsed and must hold the step
    its ``step-N`` name says (FormatError otherwise, whether found under a root or named)."""
    ckpt = resolve(storage, path)
    blob = read_manifest_bytes(storage, ckpt)
    return ckpt, blob, parse_checked(ckpt, blob, storage.join(ckpt, MANIFEST_NAME))


def newest(storage: Storage, root: str) -> str | None:
    """The newest committed ``step-*`` checkpoint under ``root`` (None if there is none),
    checked as :func:`open_checkpoint` checks it: a newest step whose manifest does not read,
    or says another step, raises (typed) rather than pass an older or forged step off as it."""
    steps = committed_steps(storage, root)
    if not steps:
        return None
    try:
        return open_checkpoint(storage, steps[-1][1])[0]
    except Exception as e:
        note_older(e, storage, root, steps[-1][1])
        raise


def note_older(e: BaseException, storage: Storage, root: str, ckpt: str) -> None:
    """Add to ``e`` (the failure of checkpoint ``ckpt``, the newest under ``root``) a note
    naming the older committed steps, which nothing but the trainer's resume falls back to
    by itself (a load loads what it was asked for, or fails)."""
    try:
        older = [storage.basename(c) for _, c in committed_steps(storage, root) if c != ckpt]
    except Exception:  # (a note only: the error itself is what matters)
        return
    if older:
        e.add_note(f"{storage.basename(ckpt)} is the newest committed checkpoint under {root}; older committed ones: "
                   f"{', '.join(older[-3:][::-1])}{' ...' if len(older) > 3 else ''} (load one by its path)")


def _is_dir_link(path: str) -> bool:
    """A directory, or a link to one (the path a user names is followed once)."""
    try:
        return os.path.isdir(path)
    except (OSError, ValueError):
        return False


def _committed_or_link(storage: Storage, path: str) -> bool:
    """The path a user names may itself be a link to a checkpoint (their choice); what is
    inside it is never followed through links."""
    if not storage.caps.atomic_rename:  # object stores: prefixes, no links
        return storage.isfile(storage.join(path, MANIFEST_NAME))
    return _is_dir_link(path) and storage.isfile(storage.join(path, MANIFEST_NAME))
