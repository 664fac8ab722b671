"""Flattening of nested state dicts into named entries, and back for JSON leaves.

Rules (see docs/format.md):
* A top-level key whose value is a mapping is a *role* (``model``, ``master``,
  ``optimizer``, ...): its tensor leaves are stored in ``{role}-*.safetensors`` files under
  their path joined with ``.`` (so ``{"model": {"lm_head.weight": t}}`` stores
  ``lm_head.weight``, a Hugging Face name).
* Top-level tensor leaves go to the role ``other`` under their key.
* Leaves that are ``None``, bool, int, float, str (or lists of them) are JSON state, kept
  from rank 0 in the manifest and written back into the target dict on load.
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
from .manifest import name_problem
from .layout import Layout, ShardedTensor, _is_dtensor, layout_of

__all__ = ["Entry", "flatten", "apply_json_state"]

_ROLE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
OTHER_ROLE = "other"
_JSON_SCALARS = (type(None), bool, int, float, str)


@dataclass(slots=True)
class Entry:
    """One tensor leaf of a state dict."""

    role: str
    name: str
    local: torch.Tensor
    layout: Layout

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.name)


def _is_tensor_leaf(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, ShardedTensor)) or _is_dtensor(v)


def _is_json(v: Any) -> bool:
    if isinstance(v, _JSON_SCALARS):
        return not (isinstance(v, float) and not math.isfinite(v))  # strict JSON: no NaN/inf
    if isinstance(v, (list, tuple)):
        return all(_is_json(x) for x in v)
    if isinstance(v, Mapping):
        return all(isinstance(k, str) and _is_json(x) for k, x in v.items())
    return False


def flatten(state_dict: Mapping[str, Any]) -> tuple[list[Entry], dict[str, Any]]:
    """Split a state dict into tensor entries and a nested dict of its JSON leaves."""
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
    entries: list[Entry] = []
    seen: dict[tuple[str, str], str] = {}
    json_state: dict[str, Any] = {}

    def add(role: str, name: str, value: Any, where: str) -> None:
        why = name_problem(name)
        if why:
            raise StateDictError(f"{where!r}: cannot store a tensor under this name: {why}")
        local, layout = layout_of(value)
        key = (role, name)
        if key in seen:
            raise StateDictError(
                f"state dict entries {seen[key]!r} and {where!r} both map to tensor {name!r} of role {role!r}"
            )
        seen[key] = where
        entries.append(Entry(role, name, local, layout))

    def walk(role: str, prefix: str, value: Any, where: str) -> Any:
        """Collect tensors below ``value``; return its JSON-only skeleton (or _SKIP)."""
        if _is_tensor_leaf(value):
            add(role, prefix, value, where)
            return _SKIP
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, (str, int)):
                    raise StateDictError(f"key {k!r} at {where!r} must be a str or int")
                sub = walk(role, f"{prefix}.{k}" if prefix else str(k), v, f"{where}.{k}")
                if sub is not _SKIP:
                    out[str(k)] = sub
            return out if out else _SKIP
        if isinstance(value, (list, tuple)) and any(_contains_tensor(x) for x in value):
            for i, v in enumerate(value):
                sub = walk(role, f"{prefix}.{i}" if prefix else str(i), v, f"{where}.{i}")
                if sub is not _SKIP:
                    raise StateDictError(f"{where}.{i}: lists mixing tensors and other values are not supported")
            return _SKIP
        if _is_json(value):
            return list(value) if isinstance(value, tuple) else value
        raise StateDictError(
            f"{where!r} holds a {type(value).__name__}, which unickpt cannot store: use tensors or "
            "JSON values (None, bool, int, float, str, lists and dicts of them)"
        )

    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise StateDictError(f"top-level key {k!r} must be a str")
        if isinstance(v, Mapping):
            if not _ROLE.match(k):
                raise StateDictError(
                    f"top-level key {k!r} names a role (file prefix): use lowercase letters, digits, '_' "
                    "(at most 32, starting with a letter)"
                )
            sub = walk(k, "", v, k)
        elif _is_tensor_leaf(v):
            add(OTHER_ROLE, k, v, k)
            sub = _SKIP
        else:
            sub = walk(OTHER_ROLE, k, v, k)
        if sub is not _SKIP:
            json_state[k] = sub
    return entries, json_state


class _Skip:
    pass


_SKIP = _Skip()


def _contains_tensor(v: Any) -> bool:
    if _is_tensor_leaf(v):
        return True
    if isinstance(v, Mapping):
        return any(_contains_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_contains_tensor(x) for x in v)
    return False


def apply_json_state(target: Any, saved: Any) -> None:
    """Write saved JSON leaves into ``target`` in place, where the target has the same path."""
    if isinstance(target, MutableMapping) and isinstance(saved, Mapping):
        for k, v in saved.items():
            key: Any = k
            if key not in target:
                try:
                    ik = int(k)
                except ValueError:
                    continue
                if ik not in target:
                    continue
                key = ik
            cur = target[key]
            if isinstance(cur, (Mapping, MutableSequence)) and isinstance(v, (Mapping, list)) and not _is_leaf_list(cur):
                apply_json_state(cur, v)
            elif not _contains_tensor(cur):
                target[key] = v
    elif isinstance(target, MutableSequence) and isinstance(saved, list):
        for i, v in enumerate(saved[: len(target)]):
            cur = target[i]
            if isinstance(cur, (Mapping, MutableSequence)) and isinstance(v, (Mapping, list)) and not _is_leaf_list(cur):
                apply_json_state(cur, v)
            elif not _contains_tensor(cur):
                target[i] = v


def _is_leaf_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, _JSON_SCALARS) for x in v)
