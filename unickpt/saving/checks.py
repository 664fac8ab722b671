"""What a save refuses before it writes a byte, agreed by every rank: JSON state that differs
between ranks (outside ``per_rank``), ties that differ, replicated copies whose values differ,
and JSON state its manifest could not hold."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from .._copy import as_bytes
from ..errors import StateDictError
from ..format import dtype_name
from ..manifest import DENSE_ALLOWANCE, density_problem
from ..plan import SavePlan
from ..state import PER_RANK_KEY, RANK_VALUE_KEY, Entry, from_json
from ..transport import Comm


if TYPE_CHECKING:
    from .options import SaveOptions
    from .writer import StagedBytes

__all__ = ["check_density", "check_replicas", "gather_json", "gather_rank_state"]


def check_density(json_state: dict[str, Any], opts: SaveOptions, names: list[str]) -> None:
    """Refuse JSON state (with ``extra``, ``strategy`` and the tensor names, which the
    manifest writes more than once) that its manifest could not hold: more objects and arrays
    than a manifest reader parses for its size (:func:`unickpt.manifest.density_problem`),
    before anything is written. Half the allowance, leaving the other half to the manifest's
    own entries (the same on every rank: the plan and the gathered state are)."""
    text = json.dumps([json_state, opts.extra, opts.strategy], separators=(",", ":"), ensure_ascii=False).encode()
    brackets = sum(n.count("{") + n.count("[") for n in names)
    why = density_problem(text, DENSE_ALLOWANCE // 2, (brackets * 3, sum(len(n) + 3 for n in names) * 3))
    if why:
        raise StateDictError(f"the JSON state and tensor names hold {why}: more than a checkpoint's manifest may hold "
                             "for its size (it bounds what loads parse). Store long lists of small lists or dicts (seen "
                             "sample ids, token counts...) in a tensor")


def gather_rank_state(comm: Comm, entries: list[Entry], json_state: dict[str, Any]):
    """Every rank's tied-weight aliases and per-rank keys (merged), and the JSON state with
    each :func:`~unickpt.per_rank` value replaced by the list of every rank's value. One
    exchange of small JSON; the result is the same on every rank."""
    mine_al = sorted([e.role, a, e.name] for e in entries for a in e.aliases)
    mine_pr = sorted([e.role, e.name, list(e.layout.shape[1:]), dtype_name(e.local.dtype)] for e in entries if e.per_rank)
    values: list = []
    _rank_values(json_state, values.append)
    common = _rank_values(json_state, None, lambda v: None)  # what must be the same on every rank
    digest = xxhash.xxh3_64_hexdigest(json.dumps(common, sort_keys=True, separators=(",", ":")).encode())
    everyone = gather_json(comm, {"al": mine_al, "pr": mine_pr, "v": values, "h": digest}, "save (per-rank values)")
    if len({x["h"] for x in everyone}) > 1:  # JSON values differ between ranks: find one to name
        states = gather_json(comm, common, "save (per-rank values differ)")
        path, r, absent, lens = _first_difference([from_json(x) for x in states])
        if lens is not None:
            raise StateDictError(
                f"the JSON list {path!r} holds {lens[0]} item(s) on rank 0 and {lens[1]} on rank {r}: JSON values are "
                "saved once for all ranks, so every rank passes the same structure (the same number of param_groups, "
                "say); wrap values that differ per rank in unickpt.per_rank(...)")
        if absent is not None:  # one rank holds a value the other has no place for: structure, not values
            has = 0 if absent == r else r
            raise StateDictError(
                f"rank {has} holds the JSON value {path!r} and rank {absent} does not: every rank passes the same "
                "structure, with its own pieces of the tensors. A state dict only rank 0 fills (get_state_dict with "
                "full_state_dict=True and cpu_offload=True gives the others {}) is saved by rank 0 alone: "
                "unickpt.save(..., group=\"local\") there; or save the sharded state dict from every rank")
        raise StateDictError(
            f"the JSON value {path!r} differs between ranks (rank 0 and rank {r}): JSON values are saved once for all "
            "ranks. Wrap values that differ per rank (data positions, per-rank counters) in unickpt.per_rank(...), or "
            "make the ranks agree before saving")
    aliases: dict[tuple[str, str], str] = {}
    for r, x in enumerate(everyone):
        for role, alias, name in x["al"]:
            if aliases.setdefault((role, alias), name) != name:
                raise StateDictError(f"tensor {alias!r} (role {role}) is tied to {aliases[(role, alias)]!r} on one rank "
                                     f"and to {name!r} on rank {r}: every rank must tie the same weights")
    seen: dict[tuple[str, str], tuple[int, list, str]] = {}
    for r, x in enumerate(everyone):
        for role, name, shape, dt in x["pr"]:
            first = seen.setdefault((role, name), (r, shape, dt))
            if (first[1], first[2]) != (shape, dt):
                raise StateDictError(
                    f"per_rank tensor {name!r} (role {role}) must have the same shape and dtype on every rank: rank "
                    f"{first[0]} has {first[2]} {first[1]}, rank {r} has {dt} {shape} (pad it to one shape, or store "
                    "the value as JSON)")
    per_rank_keys = set(seen)
    counts = {len(x["v"]) for x in everyone}
    if len(counts) > 1:
        raise StateDictError(f"the ranks hold different numbers of per_rank() values ({sorted(counts)}): every rank "
                             "must pass the same state dict structure")
    if values:
        it = iter(range(len(values)))

        def gathered(_v):
            i = next(it)
            return {PER_RANK_KEY: [x["v"][i] for x in everyone]}

        json_state = _rank_values(json_state, None, gathered)
    return aliases, per_rank_keys, json_state


def _first_difference(states: list) -> tuple[str, int, int | None, tuple[int, int] | None]:
    """The first path (dotted) where a rank's JSON state differs from rank 0's, that rank,
    the rank whose state lacks the path (None: both hold something there), and the lengths
    of two lists that differ in length there (None: not that)."""
    found: dict = {}

    def diff(a, b, where: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if k not in a or k not in b:
                    found["absent"] = 0 if k not in a else -1
                    return f"{where}.{k}" if where else k
                d = diff(a[k], b[k], f"{where}.{k}" if where else k)
                if d is not None:
                    return d
            return None
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                found["lens"] = (len(a), len(b))
                return where or "<state>"
            for i, (x, y) in enumerate(zip(a, b)):
                d = diff(x, y, f"{where}.{i}" if where else str(i))
                if d is not None:
                    return d
            return None
        if isinstance(a, float) and isinstance(b, float):  # as stored: NaN is NaN, -0.0 is not 0.0
            same = (a == b and math.copysign(1, a) == math.copysign(1, b)) or (a != a and b != b)
        else:
            same = a == b and type(a) is type(b)
        return None if same else (where or "<state>")

    for r, st in enumerate(states[1:], 1):
        found.clear()
        d = diff(states[0], st, "")
        if d is not None:
            absent = found.get("absent")
            return d, r, (r if absent == -1 else absent), found.get("lens")
    return "<state>", 1, None, None


def _rank_values(obj: Any, visit=None, replace=None) -> Any:
    """Walk JSON state in a fixed order: ``visit(value)`` each per-rank value, or return a
    copy with each ``{RANK_VALUE_KEY: v}`` replaced by ``replace(v)``."""
    if isinstance(obj, dict):
        if RANK_VALUE_KEY in obj and len(obj) == 1:
            if visit is not None:
                visit(obj[RANK_VALUE_KEY])
            return replace(obj[RANK_VALUE_KEY]) if replace is not None else obj
        return {k: _rank_values(v, visit, replace) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rank_values(v, visit, replace) for v in obj]
    return obj


def _on_device(t: torch.Tensor) -> bool:
    """Whether :func:`_fingerprint` takes ``t``'s fingerprint where it is, as a weighted sum
    (a tensor on an accelerator) rather than with xxh3 on the host."""
    return t.device.type != "cpu"


def _fingerprint(t: torch.Tensor, weighted: bool = False) -> int:
    """A 62-bit fingerprint of a tensor's bytes: xxh3 on the host; on an accelerator (or with
    ``weighted``, on the host too) a position-weighted sum computed where the tensor is (no
    copy of it to the host). The two differ: compare fingerprints of one kind only."""
    if not weighted and not _on_device(t):
        return xxhash.xxh3_64_intdigest(as_bytes(t.detach().contiguous()).numpy()) & ((1 << 62) - 1)
    x = t.detach().contiguous().view(-1)
    b = x.view(torch.uint8)
    if b.numel() % 4 == 0:
        if b.storage_offset() % 4:  # (a view at an odd offset: the same bytes, aligned)
            b = b.clone()
        words = b.view(torch.int32)
    else:
        words = b
    h = torch.zeros((), dtype=torch.int64, device=t.device)
    step = 1 << 24
    for i in range(0, words.numel(), step):
        w = words[i:i + step].to(torch.int64)
        pos = torch.arange(i, i + w.numel(), device=t.device, dtype=torch.int64)
        h = h + (w * (pos * 2654435761 % 4294967291 + 1)).sum() + (w ^ pos).sum()
    return int(h.item()) & ((1 << 62) - 1)


def check_replicas(comm: Comm, plan: SavePlan, entries: list[Entry], staged: "StagedBytes | None" = None) -> None:
    """Refuse a save where ranks that each present a block as the saved copy (replica 0)
    hold different values in it: one rank's copy would be stored, which one changing from
    run to run. Such blocks are plain tensors (full on every rank) and the blocks the plan
    made copies of (:attr:`~unickpt.plan.TensorPlan.copies`: DTensors on a sub-mesh under
    DDP). A fingerprint of each, with one all-reduce; the error is raised on every rank.
    Copies marked ``replica > 0`` by their layout are the caller's word and not compared.

    Each holder fingerprints its block where it lies (:func:`_fingerprint`: xxh3 on the host,
    a weighted sum on an accelerator). The same all-reduce tells whether the holders of a block
    have it on the host and on accelerators both; only those blocks take a second round, every
    holder using the weighted sum."""
    groups = _replica_groups(plan)
    if not groups or comm.world == 1:
        return
    by_key: dict[tuple[str, str], list[Entry]] = {}
    for e in entries:
        by_key.setdefault(e.key, []).append(e)
    hi = 1 << 62
    n = len(groups)
    # per group: the fingerprint, its negation (max over holders as min(-v)), the device kind
    # (0 host, 1 accelerator) and its negation; hi for ranks that do not hold the block
    words = torch.full((4, n), hi, dtype=torch.int64)
    mine: dict[int, Entry] = {}
    err: BaseException | None = None
    try:
        for i, (k, box, ranks) in enumerate(groups):
            if box is None:
                held = [e for e in by_key.get(k, ()) if e.layout.replica == 0 and e.layout.is_full]
            else:  # (the plan marked all but the first a copy; the entry keeps the rank's own word)
                held = [e for e in by_key.get(k, ()) if comm.rank in ranks
                        and (e.layout.offsets, e.layout.sizes, e.layout.flat) == box]
            for e in held[:1]:
                if staged is not None:
                    staged.wait(e.key, e.local.numel() * e.local.element_size())
                mine[i] = e
                dev = int(_on_device(e.local))
                v = _fingerprint(e.local, weighted=bool(dev))
                words[:, i] = torch.tensor([v, -v, dev, -dev])
    except Exception as ex:  # (staging failed) after the collective, on every rank
        err = ex
    lo, _ = comm.min_max(words.reshape(-1), "save (comparing replicated tensors)")
    comm.agree(err, "save (staging)" if staged is not None else "save (comparing replicated tensors)")
    lo = lo.reshape(4, n)
    vals = words[0]
    mixed = [i for i in range(n) if int(lo[2, i]) != -int(lo[3, i])]  # held on the host and on accelerators
    same = [int(lo[0, i]) == -int(lo[1, i]) for i in range(n)]
    if mixed:  # (the same list on every rank: it comes from the all-reduce)
        again = torch.full((2, len(mixed)), hi, dtype=torch.int64)
        try:
            for j, i in enumerate(mixed):
                if i in mine:
                    v = _fingerprint(mine[i].local, weighted=True)
                    again[:, j] = torch.tensor([v, -v])
        except Exception as ex:
            err = ex
        lo2, _ = comm.min_max(again.reshape(-1), "save (comparing replicated tensors on host and accelerators)")
        comm.agree(err, "save (comparing replicated tensors on host and accelerators)")
        lo2 = lo2.reshape(2, len(mixed))
        for j, i in enumerate(mixed):
            same[i] = int(lo2[0, j]) == -int(lo2[1, j])
            vals[i] = again[0, j]
    differ = [i for i in range(n) if not same[i]]
    if differ:
        i = differ[0]
        (role, name), box, _ = groups[i]
        # which rank holds which value (every rank is here: the all-reduce above decided it)
        fps = [int(x) for x in comm.all_gather_bytes(str(int(vals[i])).encode(), "save (naming the differing copies)")]
        by_value: dict[int, list[int]] = {}
        for r, fp in enumerate(fps):
            if fp != hi:
                by_value.setdefault(fp, []).append(r)
        sides = ", ".join(f"{f'ranks {rs} hold' if len(rs) > 1 else f'rank {rs[0]} holds'} one value" if k == 0 else
                          f"{f'ranks {rs}' if len(rs) > 1 else f'rank {rs[0]}'} another"
                          for k, rs in enumerate(sorted(by_value.values())))
        more = f" ({len(differ) - 1} more differ: {[f'{groups[j][0][0]}/{groups[j][0][1]}' for j in differ[1:4]]})" \
            if len(differ) > 1 else ""
        if box is None:
            raise StateDictError(
                f"tensor {name!r} (role {role}) is held whole as the saved copy by several ranks (a plain tensor, or a "
                f"DTensor replicated over its mesh) with different values: {sides}{more}. It is saved once for all "
                "ranks. Wrap values that differ per rank (RNG states, data positions) in unickpt.per_rank(...), "
                "describe shards with unickpt.shard(...) or a DTensor, or make the ranks agree (broadcast) before saving")
        raise StateDictError(
            f"tensor {name!r} (role {role}): the block at offsets {list(box[0])} (sizes {list(box[1])}"
            f"{f', flat range {list(box[2])}' if box[2] else ''}) is held as the saved copy (replica 0) by several "
            f"ranks with different values: {sides}{more}. One copy is saved for all of them. Make the copies agree "
            "before saving, or describe blocks that are not copies with their own offsets")


def _replica_groups(plan: SavePlan) -> list[tuple[tuple[str, str], tuple | None, list[int] | None]]:
    """What :func:`check_replicas` compares, in plan order (the same on every rank):
    ``(key, None, None)`` for a tensor several ranks hold whole as replica 0, ``(key, (offsets,
    sizes, flat), ranks)`` for each block the plan made copies of. Computed once per plan (a
    cached plan serves every save of a training run)."""
    if plan._replica_groups is None:
        groups = [(k, None, None) for k, t in plan.tensors.items() if len(t.full_holders) > 1 and t.numel
                  and sum(1 for _, lay in t.full_pieces() if lay.replica == 0) > 1]
        groups += [(k, (offsets, sizes, flat), ranks) for k, t in plan.tensors.items()
                   for offsets, sizes, flat, ranks in t.copies]
        plan._replica_groups = groups
    return plan._replica_groups


def gather_json(comm: Comm, obj, what: str) -> list:
    return [json.loads(b) for b in comm.all_gather_bytes(json.dumps(obj).encode(), what)]

