"""The target of a load matched to the checkpoint before any byte is read (:func:`match_target`):
every tensor found, of the right shape and dtype (or cast), layouts that do not overlap; what
is missing and unexpected."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..errors import DtypeMismatchError, ShapeMismatchError, StateDictError, TensorMissingError, UnexpectedTensorError
from ..format import dtype_name, torch_dtype
from ..manifest import Manifest
from ..state import Entry, flatten, from_json, json_missing
from ..stateful import for_load, is_stateful
from ..transport import Comm


@dataclass
class Target:
    """The target of a load matched to its checkpoint (the validate stage's outcome)."""

    state_dict: Any  # stateful objects replaced by their state dicts
    saved_state: Any  # the manifest's JSON state (NaN and infinities as floats)
    finish: Callable[[], None]  # hands the loaded state to the stateful objects
    entries: list[Entry]  # tensors to read
    missing: list[str]
    skipped: list[str]
    covered: set[tuple[str, str]]  # (role, name) the targets ask for
    casts: list[tuple[torch.Tensor, torch.Tensor, str]]
    roles: set[str]
    objects: set[str]  # top-level keys holding stateful objects
    unexpected: list[str] = field(default_factory=list)  # checkpoint tensors of its roles it does not ask for


def match_target(state_dict, man: Manifest, ckpt: str, comm: Comm, cast: bool, mapping=None) -> Target:
    objects = {k for k, v in state_dict.items() if is_stateful(v)} if isinstance(state_dict, Mapping) else set()
    saved_state = from_json(man.state)
    state_dict, finish = for_load(state_dict, {r for r, _ in man.tensors}, saved_state)
    entries, _ = flatten(state_dict, comm.rank, comm.world)
    if mapping is not None:  # mapped targets become views of themselves read from boxes of their sources
        from ..mapping import expand

        def stored_shape(role: str, name: str):
            t = man.entry(role, name)
            return None if t is None else tuple(t.shape)

        entries = expand(entries, mapping, stored_shape)
    entries, missing, skipped, covered, casts = validate(entries, man, ckpt, comm.world, cast)
    missing += json_missing(state_dict, saved_state)  # JSON values the checkpoint does not hold
    return Target(state_dict, saved_state, finish, entries, missing, skipped, covered, casts, roles_of(state_dict), objects)


def roles_of(state_dict: Mapping[str, Any]) -> set[str]:
    """The roles a target state dict names: its top-level mappings, and ``other`` when it
    has top-level tensors (leaves, or in top-level lists and tuples)."""
    from ..state import OTHER_ROLE, _contains_tensor

    out = {k for k, v in state_dict.items() if isinstance(v, Mapping)}
    if any(not isinstance(v, Mapping) and _contains_tensor(v) for v in state_dict.values()):
        out.add(OTHER_ROLE)
    return out


def validate(entries: list[Entry], man: Manifest, ckpt: str, world: int = 1, cast: bool = False
              ) -> tuple[list[Entry], list[str], list[str], set[tuple[str, str]], list]:
    """Match targets to stored tensors (aliases of tied weights resolved to the stored
    name). Returns ``(entries to read, missing, skipped, keys the targets cover, casts)``;
    ``cast``: a floating target of another floating dtype is read into a buffer of the
    stored dtype, listed in ``casts`` as ``(target, buffer, label)`` (copied after the reads)."""
    keep, missing, skipped = [], [], []
    casts: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    covered: set[tuple[str, str]] = set()
    for e in entries:
        _check_target(e)
        covered.update([e.key, *((e.role, a) for a in e.aliases)])
        key = e.key
        if key not in man.tensors and key in man.aliases:  # tied when saved: read the stored name
            key = (e.role, man.aliases[key])
        stored = man.tensors.get(key)
        if stored is None:
            missing.append(f"{e.role}/{e.name}")
            continue
        for a in e.aliases:  # tied in the target, stored apart: only the first name's values load
            ak = (e.role, a)
            if ak in man.tensors or man.aliases.get(ak, key[1]) != key[1]:
                skipped.append(f"{e.role}/{a}: the target ties it to {e.role}/{e.name}, the checkpoint stores it "
                               "on its own: its stored values were not loaded")
        if e.per_rank or key in man.per_rank:
            if not (e.per_rank and key in man.per_rank):
                raise ShapeMismatchError(
                    f"{ckpt}/{stored.file}: tensor {e.name!r} (role {e.role}) was saved "
                    + ("once per rank (unickpt.per_rank): wrap the target in unickpt.per_rank() as well" if key in man.per_rank
                       else "as one value for all ranks: the target wraps it in unickpt.per_rank(); unwrap it"))
            if stored.shape[0] != world and tuple(stored.shape[1:]) == tuple(e.layout.shape[1:]):
                skipped.append(f"{e.role}/{e.name}: per-rank value saved by {stored.shape[0]} ranks, not restored on {world}")
                continue
        if tuple(e.layout.shape) != stored.shape and not (e.reshaped and math.prod(e.layout.shape) == math.prod(stored.shape)):
            raise ShapeMismatchError(
                f"{ckpt}/{stored.file}: tensor {e.name!r} (role {e.role}) is stored with shape {list(stored.shape)}, "
                f"the target has global shape {list(e.layout.shape)}"
            )
        tdt = dtype_name(e.local.dtype)
        local = e.local
        if tdt != stored.dtype:
            if not (cast and e.local.is_floating_point() and torch_dtype(stored.dtype).is_floating_point):
                raise DtypeMismatchError(
                    f"{ckpt}/{stored.file}: tensor {e.name!r} (role {e.role}) is stored as {stored.dtype}, the target is "
                    f"{tdt}" + (" (cast=True converts floating dtypes on load)" if not cast else ""))
            local = torch.empty(e.local.shape, dtype=torch_dtype(stored.dtype), device=e.local.device)
            casts.append((e.local, local, f"{e.role}/{e.name}: {stored.dtype} -> {tdt}"))
        if key != e.key:
            e = Entry(e.role, key[1], local, e.layout, reshaped=e.reshaped)
        elif local is not e.local:
            e = Entry(e.role, e.name, local, e.layout, e.aliases, e.per_rank, e.reshaped)
        keep.append(e)
    _check_overlaps(keep)
    return keep, missing, skipped, covered, casts


def _check_target(e: Entry) -> None:
    """A target tensor must be memory a load can fill: not on the meta device (a copy into
    it does nothing), not an expanded view (one element standing for several)."""
    t = e.local
    if t.device.type == "meta":
        raise StateDictError(f"target {e.role}/{e.name} is on the meta device, which holds no values: materialize "
                             "it first (e.g. module.to_empty(device='cpu'))")
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise StateDictError(f"target {e.role}/{e.name} is an expanded view (stride 0 in dimension "
                             f"{[i for i, (st, n) in enumerate(zip(t.stride(), t.shape)) if st == 0 and n > 1][0]}): "
                             "it cannot hold one value per element; pass a tensor of its own (.clone())")


def _check_overlaps(entries: list[Entry]) -> None:
    """Distinct targets that share memory would overwrite each other (and their checksums
    would fail on an intact checkpoint): refused. Contiguous targets are checked exactly;
    strided views of one buffer (column blocks) may interleave without sharing elements,
    so they are left out. The same view under two roles is allowed (tie() folds it within
    one role)."""
    spans: dict[tuple, list[tuple[int, int, Entry]]] = {}
    for e in entries:
        t = e.local
        if t.numel() == 0 or not t.is_contiguous():
            continue
        try:
            base = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        lo = base + t.storage_offset() * t.element_size()
        spans.setdefault((t.device, base), []).append((lo, lo + t.numel() * t.element_size(), e))
    for group in spans.values():
        group.sort(key=lambda x: x[0])
        for (a0, a1, ea), (b0, b1, eb) in zip(group, group[1:]):
            if (a0, a1) == (b0, b1) and ea.local.dtype == eb.local.dtype:
                continue  # one view under two roles (an fp32 model that is its own master): both load it
            if b0 < a1:
                raise StateDictError(f"targets {ea.role}/{ea.name} and {eb.role}/{eb.name} share memory "
                                     f"({min(a1, b1) - b0} bytes): each needs its own (tied weights are one tensor "
                                     "under two names, not overlapping views)")


def agree_on_target(comm: Comm, ckpt: str, man: Manifest, t: Target | None, on_missing: str,
                    on_unexpected: str) -> None:
    """Collective, the validate stage's agreement: sets ``t.unexpected`` (``role/name`` of
    stored tensors, and aliases, under a role some rank's target names that no rank's target
    covers: ranks hold different parts of a model, ZeRO-3 or pipeline stages) and raises on
    every rank when any rank's target is refused. One all-reduce of a value per stored name
    and two flags (this rank misses targets and refuses that; it refuses unexpected
    tensors), whose header also settles a match that failed on any rank (deferred, ``t``
    None there); only when some rank refuses, one agreement more, so every rank raises with
    the refusing rank's reason."""
    if t is None:  # a deferred failure here: the header below raises it everywhere
        comm.min_max(torch.zeros(0, dtype=torch.int64), "load (matching the targets to the checkpoint)")
        raise AssertionError("a deferred failure was not raised")  # (not reached)
    keys = sorted((*man.tensors, *man.aliases))
    val = torch.tensor([2 if k in t.covered else 1 if k[0] in t.roles else 0 for k in keys]
                       + [int(bool(t.missing) and on_missing == "error"), int(on_unexpected == "error")],
                       dtype=torch.int64)
    _, top = comm.min_max(val, "load (matching the targets to the checkpoint)")
    top = top.tolist()
    t.unexpected = [f"{r}/{n}" for (r, n), v in zip(keys, top) if v == 1]
    if top[-2] or (t.unexpected and top[-1]):  # some rank refuses (every rank sees the same flags)
        def refuse() -> None:
            if (t.missing and on_missing == "error") or (t.unexpected and on_unexpected == "error"):
                raise mismatch(ckpt, man, t.missing if on_missing == "error" else [],
                               t.unexpected if on_unexpected == "error" else [], t.objects)

        comm.step("load (matching the target to the checkpoint)", refuse)


def mismatch(ckpt: str, man: Manifest, missing: list[str], unexpected: list[str],
              objects: set[str] = frozenset()) -> TensorMissingError:
    """The strict load's error, naming both directions of the mismatch. ``objects``: roles
    whose target was a stateful object (the hint about optimizer objects is not for them)."""
    def some(keys: list[str]) -> str:
        return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

    parts = []
    if len(missing) == 1 and "/" in missing[0]:
        role, name = missing[0].split("/", 1)
        parts.append(f"tensor {name!r} (role {role}) is not in the checkpoint "
                     f"({sum(1 for r, _ in man.tensors if r == role)} tensors of that role are)")
    elif missing:
        parts.append(f"{len(missing)} target value(s) are not in the checkpoint: {some(missing)}")
    if unexpected:
        hint = (" (an optimizer whose state does not exist yet? pass the optimizer object itself: unickpt creates "
                "its state)") if any(u.split("/", 1)[1].startswith("state.") and u.split("/", 1)[0] not in objects
                                     for u in unexpected) else ""
        parts.append(f"{len(unexpected)} tensor(s) of the checkpoint under the target's roles are not in the target: "
                     f"{some(unexpected)}{hint}")
    cls = TensorMissingError if missing else UnexpectedTensorError
    return cls(f"{ckpt}: " + "; ".join(parts) + " (missing='warn' / unexpected='ignore' load the rest and list them "
               "in the LoadResult)",
               missing, unexpected)

