"""What the format reserves: the names a stored tensor may have, and the JSON keys that
stand for values strict JSON cannot hold in the manifest's state (per-rank values, floats
JSON cannot hold, bytes). A leaf module: the manifest (which reads them) and the state
(which writes them) both depend on it, not on each other."""

from __future__ import annotations

import math
import re

RESERVED = "::"  # separates a coded tensor's name from its part in safetensors keys
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f]")
NAME_LIMIT = 4096


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a stored tensor, or None: empty, ``__metadata__``, contains
    the reserved separator ``::`` or control characters, or longer than NAME_LIMIT."""
    if not name or name == "__metadata__":
        return f"{name!r} is reserved by safetensors"
    if RESERVED in name:
        return f"{name!r} contains '{RESERVED}', which unickpt reserves for the parts of coded tensors"
    if _BAD_NAME.search(name):
        return f"{name!r} contains control characters"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return f"{name!r} is not valid Unicode text (it holds a lone surrogate)"
    if len(name) > NAME_LIMIT:
        return f"a name of {len(name)} characters is longer than the {NAME_LIMIT} allowed"
    return None


PER_RANK_KEY = "__unickpt_per_rank__"
"""In the manifest's JSON state, ``{PER_RANK_KEY: [value of rank 0, value of rank 1, ...]}``
stands for a :func:`per_rank` JSON value."""
RANK_VALUE_KEY = "__unickpt_rank_value__"
"""``{RANK_VALUE_KEY: value}``: one rank's :func:`per_rank` JSON value before the save gathers
every rank's (never in a manifest)."""
FLOAT_KEY = "__unickpt_float__"
"""``{FLOAT_KEY: "inf" | "-inf" | "nan"}`` stands for a float that strict JSON cannot hold
(``ReduceLROnPlateau``'s ``best`` starts at ``inf``): :func:`to_json`, :func:`from_json`."""
BYTES_KEY = "__unickpt_bytes__"
"""``{BYTES_KEY: "<base64>"}`` stands for a ``bytes`` value (a data loader's pickled state,
which the caller unpickles itself: unickpt stores the bytes verbatim, inside the checksummed
manifest, and never unpickles them)."""
MAX_BYTES = 4 << 20
"""Bytes a ``bytes`` value (each) may hold: they live in the manifest; larger binary state
belongs in a uint8 tensor."""
_RESERVED = (PER_RANK_KEY, RANK_VALUE_KEY, FLOAT_KEY, BYTES_KEY)
FLOAT_NAMES = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
MAX_DEPTH = 100
"""Levels of nesting a state dict may have (roles, dicts, lists): saves refuse deeper ones
and manifests are refused with a few levels more (per-rank values add two), so the
recursive code on both sides stays far from Python's recursion limit."""
