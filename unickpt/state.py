"""Flattening of nested state dicts into named entries, and back for JSON leaves.

Rules (see docs/format.md):
* A top-level key whose value is a mapping is a *role* (``model``, ``master``,
  ``optimizer``, ...): its tensor leaves are stored in ``{role}-*.safetensors`` files under
  their path joined with ``.`` (so ``{"model": {"lm_head.weight": t}}`` stores
  ``lm_head.weight``, a Hugging Face name).
* Top-level tensor leaves go to the role ``other`` under their key.
* Leaves that are ``None``, bool, int, float, str (or lists of them) are JSON state, kept
  from rank 0 in the manifest and written back into the target dict on load.
* :func:`per_rank` values are stored once per rank: a tensor as the slice ``[rank]`` of a
  tensor of shape ``(world, *shape)``, a JSON value as the list of every rank's value (see
  :data:`PER_RANK_KEY`). They are restored to the same rank when the world size matches.
* Tensors of one role that are the same memory (tied weights: GPT-2's ``wte`` and
  ``lm_head``) are stored once, under the first name; the others are *aliases* of it
  (:attr:`Entry.aliases`), restored from the stored tensor on load.
* Anything else is refused: nothing is pickled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import StateDictError
from .names import (_RESERVED, BYTES_KEY, FLOAT_KEY, FLOAT_NAMES, MAX_BYTES, MAX_DEPTH, PER_RANK_KEY,  # noqa: F401
                    RANK_VALUE_KEY, name_problem)
from .layout import Layout, ShardedTensor, _is_dtensor, layout_of

__all__ = ["Entry", "PerRank", "per_rank", "flatten", "tie", "apply_json_state", "PER_RANK_KEY", "RANK_VALUE_KEY",
           "BYTES_KEY"]

_ROLE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
OTHER_ROLE = "other"
_JSON_SCALARS = (type(None), bool, int, float, str)
_MAX_INT_BITS = 13_000
"""Larger integers (about 3,900 digits) are refused: Python's JSON reader stops at 4,300 digits."""


def is_stateful(v: Any) -> bool:
    """True for values whose state unickpt saves through ``state_dict()``."""
    if isinstance(v, (Mapping, torch.Tensor)):
        return False
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))


class PerRank:
    """A value that differs between ranks (RNG states, data-loader positions): see
    :func:`per_rank`. Loading fills it in place: a tensor is copied into, any other value
    replaced (read it back from :attr:`value`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        if isinstance(value, PerRank):
            value = value.value
        if not (isinstance(value, torch.Tensor) and not _is_dtensor(value)) and not is_state_value(value) \
                and not is_stateful(value):
            raise StateDictError(
                f"per_rank() takes a plain tensor, a JSON value (None, bool, int, float, str, bytes, lists and dicts of "
                f"them) or, at the top level of a state dict, an object with state_dict() and load_state_dict() "
                f"(a data loader), got {type(value).__name__}")
        self.value = value

    def __repr__(self) -> str:
        v = self.value
        return f"per_rank({f'tensor {list(v.shape)} {v.dtype}' if isinstance(v, torch.Tensor) else repr(v)[:60]})"


def per_rank(value: Any) -> PerRank:
    """Store ``value`` once per rank instead of once for all ranks.

    Plain tensors in a state dict are taken to be the same on every rank (one copy is
    stored, and a save refuses tensors that differ). Wrap what legitimately differs, such as
    each rank's RNG state or data position::

        sd = {"model": ..., "rng": unickpt.per_rank(torch.get_rng_state()),
              "data": unickpt.per_rank({"epoch": 3, "index": loader_pos})}
        unickpt.save(sd, path)
        ...
        res = unickpt.load(sd, path)            # the same structure
        torch.set_rng_state(sd["rng"].value)    # this rank's own value

    On load, each rank gets back the value its rank saved when the world size is the one that
    saved; on another world size the value is left as it is and listed in
    :attr:`~unickpt.LoadResult.skipped`. Tensors must have the same shape and dtype on every
    rank (an RNG state does). A top-level stateful object (a data loader with
    ``state_dict()``/``load_state_dict()``) is saved as its state dict, per rank, and given
    back through ``load_state_dict`` (on another world size: not called).
    """
    return PerRank(value)


@dataclass(slots=True)
class Entry:
    """One tensor leaf of a state dict."""

    role: str
    name: str
    local: torch.Tensor
    layout: Layout
    aliases: tuple[str, ...] = ()
    """Other names of this role whose tensor is the same memory (tied weights)."""
    per_rank: bool = False
    """A :func:`per_rank` tensor: ``layout`` is row ``rank`` of a ``(world, *shape)`` tensor."""
    reshaped: bool = False
    """A mapping's piece (:mod:`unickpt.mapping`): ``layout.shape`` views the stored tensor in
    another shape of the same elements (row-major, the same bytes)."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.name)


def _is_tensor_leaf(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, ShardedTensor)) or _is_dtensor(v) or (
        isinstance(v, PerRank) and isinstance(v.value, torch.Tensor))


def _is_json(v: Any, finite: bool = True, depth: int = 0, blobs: bool = False) -> bool:
    """A JSON value: None, bool, int, float, str, lists, tuples and str-keyed dicts of them;
    ``finite``: no NaN or infinity (strict JSON; state values take them: :func:`to_json`);
    ``blobs``: ``bytes`` too (state values). Deeper than :data:`MAX_DEPTH` it answers True
    without looking further: :func:`to_json` (which every stored value goes through) then
    refuses it by name."""
    if isinstance(v, _JSON_SCALARS):
        return not (finite and isinstance(v, float) and not math.isfinite(v))
    if blobs and isinstance(v, (bytes, bytearray)):
        return True
    if depth > MAX_DEPTH:
        return isinstance(v, (list, tuple, Mapping))
    if isinstance(v, (list, tuple)):
        return all(_is_json(x, finite, depth + 1, blobs) for x in v)
    if isinstance(v, Mapping):
        return all(isinstance(k, str) and _is_json(x, finite, depth + 1, blobs) for k, x in v.items())
    return False


def _short(where: str) -> str:
    """A path for a message: its start and end when long (a deep one repeats itself)."""
    return where if len(where) <= 80 else f"{where[:40]}...{where[-30:]}"


def _text_problem(v: str) -> str | None:
    """Why ``v`` cannot be stored as JSON text, or None."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return (f"the string {v[:40]!r}{'...' if len(v) > 40 else ''} is not valid Unicode text (it holds a lone "
                "surrogate, as os.listdir gives for file names that are not UTF-8): store os.fsencode(...) bytes "
                "in a tensor, or decode them with errors='replace'")
    return None


def is_state_value(v: Any) -> bool:
    """A value the JSON state holds: JSON, NaN and infinities included, and ``bytes``."""
    return _is_json(v, finite=False, blobs=True)


def to_json(v: Any, where: str = "", depth: int = 0) -> Any:
    """A state value as the manifest stores it: tuples become lists, keys strings, and floats
    that strict JSON cannot hold ``{FLOAT_KEY: "inf" | "-inf" | "nan"}``. A
    :class:`StateDictError` names what cannot be stored: a key unickpt reserves, anywhere in it
    (it would read back as something else), text that is not valid Unicode, an integer too
    large for a JSON reader, nesting deeper than :data:`MAX_DEPTH` (``depth``: the levels
    above ``v``)."""
    if isinstance(v, float) and not math.isfinite(v):
        return {FLOAT_KEY: "nan" if v != v else ("inf" if v > 0 else "-inf")}
    if isinstance(v, (bytes, bytearray)):
        if len(v) > MAX_BYTES:
            raise StateDictError(f"{where!r}: {len(v)} bytes; a bytes value may hold {MAX_BYTES} (it is stored in the "
                                 "manifest): store larger binary state as a uint8 tensor")
        import base64

        return {BYTES_KEY: base64.b64encode(bytes(v)).decode("ascii")}
    if isinstance(v, str):
        why = _text_problem(v)
        if why:
            raise StateDictError(f"{where!r}: {why}")
        return v
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > _MAX_INT_BITS:
        raise StateDictError(f"{where!r}: an integer of {v.bit_length()} bits is too large to store as JSON "
                             f"(at most {_MAX_INT_BITS}); store it as a string or in a tensor")
    if isinstance(v, (list, tuple, Mapping)) and depth >= MAX_DEPTH:
        raise StateDictError(f"{_short(where)!r}: nested deeper than {MAX_DEPTH} levels (lists and dicts in the state "
                                 "dict)")
    if isinstance(v, (list, tuple)):
        return [to_json(x, f"{where}.{i}" if where else str(i), depth + 1) for i, x in enumerate(v)]
    if isinstance(v, Mapping):
        for k in v:
            _check_key(k, where)
        return {str(k): to_json(x, f"{where}.{k}" if where else str(k), depth + 1) for k, x in v.items()}
    return v


def _check_key(k: Any, where: str) -> None:
    """A key of a mapping at ``where`` that the manifest cannot store as it is (a reserved
    key, text that is not valid Unicode, an integer too large to write): StateDictError."""
    if isinstance(k, int) and k.bit_length() > _MAX_INT_BITS:
        raise StateDictError(f"{where!r}: an integer key of {k.bit_length()} bits is too large to store")
    if k in _RESERVED:
        raise StateDictError(f"{where!r}: the key {k!r} is reserved by unickpt")
    why = _text_problem(k) if isinstance(k, str) else None
    if why:
        raise StateDictError(f"{where!r}: a key: {why}")


def _float_code(v: Any) -> bool:
    return isinstance(v, dict) and len(v) == 1 and isinstance(v.get(FLOAT_KEY), str) and v[FLOAT_KEY] in FLOAT_NAMES


def from_json(v: Any) -> Any:
    """:func:`to_json` undone on a state the manifest checked (tuples stay lists:
    :func:`like_target` gives them back; bytes come back as ``bytes``)."""
    if isinstance(v, dict):
        if _float_code(v):
            return FLOAT_NAMES[v[FLOAT_KEY]]
        if len(v) == 1 and isinstance(v.get(BYTES_KEY), str):
            import base64

            return base64.b64decode(v[BYTES_KEY], validate=True)
        return {k: from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_json(x) for x in v]
    return v


def _memory_id(local: torch.Tensor, layout: Layout) -> tuple | None:
    """What makes two leaves the same memory (tied weights); None for empty tensors (they
    share no bytes, and may all sit at address 0)."""
    if local.numel() == 0:
        return None
    try:
        ptr = local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, fake): never tied
        return None
    return (local.device, ptr, local.storage_offset(), tuple(local.shape), tuple(local.stride()), local.dtype, layout)


def tie(entries: list[Entry]) -> list[Entry]:
    """Entries of one role that are the same memory (tied weights) folded into the first
    one's :attr:`Entry.aliases`: stored once, restored under every name."""
    first: dict[tuple[str, Any], Entry] = {}
    out: list[Entry] = []
    for e in entries:
        mid = None if e.per_rank else _memory_id(e.local, e.layout)
        owner = first.get((e.role, mid)) if mid is not None else None
        if owner is not None:
            owner.aliases = (*owner.aliases, e.name, *e.aliases)
            continue
        if mid is not None:
            first[(e.role, mid)] = e
        out.append(e)
    return out


def flatten(state_dict: Mapping[str, Any], rank: int = 0, world: int = 1) -> tuple[list[Entry], dict[str, Any]]:
    """Split a state dict into tensor entries and a nested dict of its JSON leaves.

    ``rank``/``world``: where :func:`per_rank` tensors sit in their ``(world, ...)`` tensor.
    A :func:`per_rank` JSON value appears in the JSON dict as ``{RANK_VALUE_KEY: value}``
    (the save gathers every rank's)."""
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    entries: list[Entry] = []
    seen: dict[tuple[str, str], str] = {}
    json_state: dict[str, Any] = {}

    def add(role: str, name: str, value: Any, where: str) -> None:
        why = name_problem(name)
        if why:
            raise StateDictError(f"{where!r}: cannot store a tensor under this name: {why}")
        key = (role, name)
        if key in seen:
            raise StateDictError(
                f"state dict entries {seen[key]!r} and {where!r} both map to tensor {name!r} of role {role!r}"
            )
        seen[key] = where
        if isinstance(value, PerRank):
            t = value.value
            if not t.is_contiguous():
                raise StateDictError(f"{where!r}: a per_rank tensor must be contiguous")
            layout = Layout((world, *t.shape), (rank,) + (0,) * t.dim(), (1, *t.shape))
            entries.append(Entry(role, name, t.unsqueeze(0), layout, per_rank=True))
            return
        local, layout = layout_of(value)
        entries.append(Entry(role, name, local, layout))

    def walk(role: str, prefix: str, value: Any, where: str, depth: int) -> Any:
        """Collect tensors below ``value`` (``depth`` levels below the state dict); return its
        JSON-only skeleton (or _SKIP)."""
        if _is_tensor_leaf(value):
            add(role, prefix, value, where)
            return _SKIP
        if isinstance(value, PerRank):  # a JSON value (tensors are leaves, above)
            return {RANK_VALUE_KEY: to_json(value.value, where, depth)}
        if isinstance(value, (Mapping, list, tuple)) and depth >= MAX_DEPTH:
            raise StateDictError(f"{_short(where)!r}: nested deeper than {MAX_DEPTH} levels (lists and dicts in the state "
                                 "dict)")
        if isinstance(value, Mapping):
            out = {}
            names: dict[str, Any] = {}  # stored key -> the key it came from
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise StateDictError(f"key {k!r} at {where!r} must be a str or int")
                _check_key(k, where)
                if str(k) in names:  # (1 and "1": one stored name, one value lost)
                    raise StateDictError(f"keys {names[str(k)]!r} and {k!r} at {where!r} are both stored as "
                                         f"{str(k)!r}: rename one")
                names[str(k)] = k
                sub = walk(role, f"{prefix}.{k}" if prefix else str(k), v, f"{where}.{k}", depth + 1)
                if sub is not _SKIP:
                    out[str(k)] = sub
            return out if out else _SKIP
        if isinstance(value, (list, tuple)) and any(_contains_tensor(x) for x in value):
            # tensors under their index; the JSON rest keeps the list's shape (an optimizer's
            # param_groups with a tensor lr), None standing for elements that are all tensors
            subs = [walk(role, f"{prefix}.{i}" if prefix else str(i), v, f"{where}.{i}", depth + 1)
                    for i, v in enumerate(value)]
            if all(sub is _SKIP for sub in subs):
                return _SKIP
            return [None if sub is _SKIP else sub for sub in subs]
        if is_state_value(value):
            return to_json(value, where, depth)
        raise StateDictError(
            f"{where!r} holds a {type(value).__name__}, which unickpt cannot store: use tensors or "
            "JSON values (None, bool, int, float, str, lists and dicts of them)"
        )

    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise StateDictError(f"top-level key {k!r} must be a str")
        if k in _RESERVED:
            raise StateDictError(f"the top-level key {k!r} is reserved by unickpt")
        why = _text_problem(k)
        if why:
            raise StateDictError(f"a top-level key: {why}")
        if isinstance(v, Mapping):
            if not _ROLE.match(k):
                raise StateDictError(
                    f"top-level key {k!r} names a role (file prefix): use lowercase letters, digits, '_' "
                    "(at most 32, starting with a letter)"
                )
            sub = walk(k, "", v, k, 1)
        elif _is_tensor_leaf(v):
            add(OTHER_ROLE, k, v, k)
            sub = _SKIP
        else:
            sub = walk(OTHER_ROLE, k, v, k, 1)
        if sub is not _SKIP:
            json_state[k] = sub
    return tie(entries), json_state


class _Skip:
    pass


_SKIP = _Skip()


def _contains_tensor(v: Any, depth: int = 0) -> bool:
    """Whether a tensor lies below ``v``; not looked for deeper than :data:`MAX_DEPTH` (the
    walk refuses such nesting by name)."""
    if _is_tensor_leaf(v):
        return True
    if depth > MAX_DEPTH:
        return False
    if isinstance(v, Mapping):
        return any(_contains_tensor(x, depth + 1) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_contains_tensor(x, depth + 1) for x in v)
    return False


def apply_json_state(target: Any, saved: Any, rank: int = 0, world: int = 1,
                     skipped: list[str] | None = None, where: str = "", top_level: bool = False) -> None:
    """Write saved JSON leaves into ``target`` in place, where the target has the same path.

    A saved per-rank value (``{PER_RANK_KEY: [...]}``) gives this rank its own value when the
    world size is the one that saved; otherwise the target keeps its value and the path is
    appended to ``skipped`` with the reason. Saved values the target has no place for are
    appended to ``skipped`` too: below the roles the target names, and at the top level
    (``top_level``: the target has top-level values of its own) those outside any role. A
    tuple that holds tensors (restored in place) is rebuilt around its restored values."""
    if isinstance(target, MutableMapping) and isinstance(saved, Mapping):
        items = []
        for k, v in saved.items():
            key: Any = k
            if key not in target:
                try:
                    ik = int(k)
                except ValueError:
                    ik = None
                if ik is None or ik not in target:
                    outside_roles = not isinstance(v, Mapping) or PER_RANK_KEY in v  # (else a role's JSON)
                    if skipped is not None and (where or (outside_roles and top_level)):
                        skipped.append(f"{where}.{k}: saved, not in the target" if where else
                                       f"{k}: saved, not in the target")
                    continue
                key = ik
            items.append((key, k, v))
    elif isinstance(target, MutableSequence) and isinstance(saved, list):
        items = [(i, str(i), v) for i, v in enumerate(saved[: len(target)])]
        if len(saved) > len(target) and skipped is not None:  # (no tensor targets to put them in)
            skipped.append(f"{where or '(top level)'}: {len(saved) - len(target)} saved items beyond the target's "
                           f"{len(target)} not restored (the target list holds dicts or tensors, so it is filled "
                           "item by item)")
    else:
        return
    for key, k, v in items:
        cur = target[key]
        path = f"{where}.{k}" if where else k
        if isinstance(v, Mapping) and PER_RANK_KEY in v:
            values = v[PER_RANK_KEY]
            if not isinstance(values, list) or len(values) != world:
                if skipped is not None:
                    n = len(values) if isinstance(values, list) else "?"
                    skipped.append(f"{path}: per-rank value saved by {n} ranks, not restored on {world}")
                continue
            if isinstance(cur, PerRank):
                if not isinstance(cur.value, torch.Tensor):
                    cur.value = like_target(cur.value, values[rank])
            elif not _contains_tensor(cur):
                target[key] = like_target(cur, values[rank])
        elif isinstance(cur, PerRank):  # saved as one value for all ranks: that value
            if not isinstance(cur.value, torch.Tensor):
                cur.value = like_target(cur.value, v)
        elif isinstance(cur, (Mapping, MutableSequence)) and isinstance(v, (Mapping, list)) and not _is_leaf_list(cur):
            apply_json_state(cur, v, rank, world, skipped, path)
        elif isinstance(cur, tuple) and isinstance(v, list) and _contains_tensor(cur):
            parts = list(cur)  # its tensors are loaded in place; its other values are rebuilt
            apply_json_state(parts, v, rank, world, skipped, path)
            target[key] = type(cur)(*parts) if hasattr(cur, "_fields") else type(cur)(parts)
        elif not _contains_tensor(cur):  # JSON has no tuples: the target's tuples stay tuples (betas)
            target[key] = like_target(cur, v)


def like_target(cur: Any, v: Any) -> Any:
    """JSON value ``v`` (decoded: :func:`from_json`) in the kinds of the target's value
    ``cur`` it replaces: JSON has no tuples, so a list stands where the target holds a tuple
    (``betas``), a namedtuple, or tuples nested in lists and dicts; each becomes the target's
    kind again. Elsewhere ``v`` as it is."""
    if isinstance(v, list) and isinstance(cur, (tuple, list)) and len(cur) == len(v):
        items = [like_target(c, x) for c, x in zip(cur, v)]
        if not isinstance(cur, tuple):
            return items
        if hasattr(cur, "_fields"):  # a namedtuple
            return type(cur)(*items)
        try:
            return type(cur)(items)
        except Exception:  # a tuple subclass that will not take them: a tuple
            return tuple(items)
    if isinstance(v, list) and isinstance(cur, tuple):  # another length: still a tuple
        return tuple(v)
    if isinstance(v, dict) and isinstance(cur, Mapping):
        return {k: like_target(cur.get(k), x) for k, x in v.items()}
    return v


def set_json_path(root: dict, path: tuple, value: Any, error: type[Exception] = StateDictError) -> None:
    """Put ``value`` at ``path`` below ``root`` (str parts: dict keys, int parts: list
    indices), creating the dicts and lists on the way; ``error`` (naming the path) when the
    path crosses a value of another kind."""
    cur: Any = root
    for k, nxt in zip(path[:-1], path[1:]):
        make = list if isinstance(nxt, int) else dict
        if isinstance(cur, list):
            if not isinstance(k, int):
                raise error(f"the path {list(path)} indexes a list with {k!r}")
            cur.extend([None] * (k + 1 - len(cur)))
            if cur[k] is None:
                cur[k] = make()
            cur = cur[k]
        else:
            cur = cur.setdefault(k, make())
        if not isinstance(cur, make):
            raise error(f"the path {list(path)} crosses a value that is not a {make.__name__}")
    last = path[-1]
    if isinstance(cur, list):
        if not isinstance(last, int):
            raise error(f"the path {list(path)} indexes a list with {last!r}")
        cur.extend([None] * (last + 1 - len(cur)))
    elif isinstance(last, int):
        raise error(f"the path {list(path)} indexes a dict with {last!r}")
    cur[last] = value


_ABSENT = _Skip()  # (json_missing: the checkpoint holds nothing at this path)


def json_missing(target: Any, saved: Any, where: str = "") -> list[str]:
    """Dotted paths of the target's JSON leaves (and :func:`per_rank` JSON values) that the
    saved JSON state does not hold: values a load leaves as they are."""
    out: list[str] = []
    if isinstance(target, PerRank) or _is_tensor_leaf(target):
        return out
    if saved is not _ABSENT and not _contains_tensor(target) and not (
            isinstance(target, Mapping) and isinstance(saved, Mapping)) and not (
            isinstance(target, list) and isinstance(saved, list) and not _is_leaf_list(target)):
        return out  # the saved value replaces it whole (apply_json_state)
    if isinstance(target, Mapping) and not (isinstance(saved, Mapping) and PER_RANK_KEY in saved):
        for k, v in target.items():
            path = f"{where}.{k}" if where else str(k)
            if _contains_tensor(v) and not isinstance(v, (Mapping, list, tuple)):
                continue
            if not isinstance(saved, Mapping) or str(k) not in saved:
                if not _contains_tensor(v) and _has_json_leaf(v):
                    out.append(path)
                elif isinstance(v, (Mapping, list, tuple)):
                    out += json_missing(v, _ABSENT, path)
                continue
            out += json_missing(v, saved[str(k)], path)
    elif isinstance(target, (list, tuple)) and not _is_leaf_list(target) and (
            isinstance(saved, list) or saved is _ABSENT):
        if saved is _ABSENT:
            saved = []
        for i, v in enumerate(target):
            path = f"{where}.{i}" if where else str(i)
            if i >= len(saved):
                if not _contains_tensor(v) and _has_json_leaf(v):
                    out.append(path)
                continue
            out += json_missing(v, saved[i], path)
    return out


def _has_json_leaf(v: Any) -> bool:
    """``v`` holds a value, not only empty containers (``[{}]``: a scheduler's ``lr_lambdas``;
    DCP's flattening, and so a checkpoint written through it, keeps no trace of them)."""
    if isinstance(v, Mapping):
        return any(_has_json_leaf(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_json_leaf(x) for x in v)
    return True


def _is_leaf_list(v: Any) -> bool:
    """A list of JSON scalars, or of such lists at any depth: loaded whole (the saved list,
    whatever its length), as a plain value is."""
    return isinstance(v, list) and all(isinstance(x, _JSON_SCALARS) or _is_leaf_list(x) for x in v)
