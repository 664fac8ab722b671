"""The summary of one rank: explicit rows and rule claims, encoded compactly; heads and payloads
exchanged, assembled into every rank's summaries."""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass

import xxhash
import zstandard

from ..errors import LayoutError
from ..layout import FlatUnit, Layout
from ..rules import Unit
from ..state import Entry
from .model import gc_paused


def summary_digest(summary: bytes) -> bytes:
    return xxhash.xxh3_128_digest(summary)


def decode_summary(data: bytes) -> dict:
    return json.loads(zstandard.ZstdDecompressor().decompress(data))


def _digest(obj) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(obj, separators=(",", ":")).encode())


def _rows(entries, dtypes, tags):
    return [[e.role, e.name, dt, list(e.layout.shape), *e.layout.to_json(), tags.get(e.key)]
            for e, dt in zip(entries, dtypes)]


@dataclass
class LocalSummary:
    """One rank's description of its entries: explicit rows for what fits no rule, and
    claims ``(set id, member index)`` on sets of rule units. :meth:`head` travels first
    (digest and claims: who sends which rule body), then :meth:`payload`."""

    node: str
    rows: list  # explicit rows
    claims: list[tuple[str, int]]  # (set id, index)
    sets: dict[str, list[str]]  # set id -> unit digests
    units: dict[str, dict]  # digest -> body
    fallback: dict[str, list]  # set id -> the rows of its pieces (sent if the claim is ambiguous)

    def digest(self) -> bytes:
        # a set id is the digest of its units' digests, a unit's digest that of its body
        return xxhash.xxh3_128_digest(json.dumps([self.node, self.rows, self.claims], separators=(",", ":")).encode())

    def head(self) -> bytes:
        return json.dumps([self.digest().hex(), self.claims], separators=(",", ":")).encode()

    def payload(self, heads: list[bytes], rank: int, owners: tuple | None = None) -> bytes:
        """``owners``: :func:`_claim_owners` of ``heads`` when already computed."""
        lowest, ambiguous = owners if owners is not None else _claim_owners(heads)
        rows = list(self.rows)
        sets, units = {}, {}
        for sid, i in self.claims:
            if (sid, i) in ambiguous:
                rows += self.fallback[sid]
            elif lowest.get(sid) == rank:
                sets[sid] = self.sets[sid]
                for d in self.sets[sid]:
                    units[d] = self.units[d]
        raw = json.dumps({"node": self.node, "t": rows, "s": sets, "u": _pack_units(units)},
                         separators=(",", ":")).encode()
        return zstandard.ZstdCompressor(level=3).compress(raw)


def _template(body: dict) -> tuple[dict, list[str]]:
    """A rule body without its tensor names, and the names. Units of one template (a
    model's layers) share their geometry, and travel as the template and lists of names."""
    tmpl = dict(body)
    tmpl["t"] = [t[1:] for t in body["t"]]
    return tmpl, [t[0] for t in body["t"]]


def _pack_units(units: dict[str, dict]) -> list:
    """``[[template, [[digest, names], ...]], ...]``: each template once."""
    groups: dict[str, list] = {}
    for d, body in units.items():
        tmpl, names = _template(body)
        groups.setdefault(json.dumps(tmpl, separators=(",", ":")), [tmpl, []])[1].append([d, names])
    return list(groups.values())


def _unpack_units(packed: list) -> dict[str, tuple[dict, list[str]]]:
    """Digest -> ``(template, names)``; units of one template share the template object."""
    return {d: (tmpl, names) for tmpl, members in packed for d, names in members}


def _claim_owners(heads: list[bytes], claims: list[list] | None = None) -> tuple[dict[str, int], set]:
    """From every rank's head: the lowest claimant of each set (it sends the set's body) and
    the claims ``(set, index)`` made by more than one rank (those ranks send rows instead).
    ``claims``: the heads' claims, when already parsed."""
    if claims is None:
        claims = [json.loads(h)[1] for h in heads]
    lowest: dict[str, int] = {}
    seen: dict[tuple[str, int], int] = {}
    ambiguous = set()
    for rank, cs in enumerate(claims):
        for sid, i in cs:
            k = (sid, int(i))
            if k in seen:
                ambiguous.add(k)
            seen[k] = rank
    for rank, cs in enumerate(claims):
        for sid, i in cs:
            if (sid, int(i)) not in ambiguous and sid not in lowest:
                lowest[sid] = rank
    return lowest, ambiguous


def assemble(heads: list[bytes], payloads: list[bytes]) -> tuple[list[dict], dict]:
    """``make_plan``'s ``summaries`` and ``rules`` from every rank's head and payload."""
    with gc_paused():
        return _assemble(heads, payloads)


def _assemble(heads: list[bytes], payloads: list[bytes]) -> tuple[list[dict], dict]:
    claims = [json.loads(h)[1] for h in heads]
    _, ambiguous = _claim_owners(heads, claims)
    summaries, sets, units = [], {}, {}
    unzip = zstandard.ZstdDecompressor()
    for cs, p in zip(claims, payloads):
        d = json.loads(unzip.decompress(p))
        sets.update(d["s"])
        units.update(_unpack_units(d["u"]))
        c = [[sid, int(i)] for sid, i in cs if (sid, int(i)) not in ambiguous]
        summaries.append({"node": d["node"], "t": d["t"], "c": c})
    return summaries, {"sets": sets, "units": units}


def summarize(entries: list[Entry], dtypes: list[str], node: str, tags: dict | None = None) -> LocalSummary:
    """This rank's :class:`LocalSummary`. A layout's hint (:func:`~unickpt.layout.partition_flat`
    with names, a DTensor) proposes a rule; the rank claims it only when its own entries are
    exactly the rule's pieces at its index (every piece the rule gives it, each equal to its
    layout, same role, dtype and codec tag throughout); anything else is an explicit row."""
    with gc_paused():
        return _summarize(entries, dtypes, node, tags or {})


def _summarize(entries: list[Entry], dtypes: list[str], node: str, tags: dict) -> LocalSummary:
    explicit: list[int] = []
    flat: dict[tuple, list[int]] = {}
    grid: dict[int, tuple[dict, int]] = {}
    for k, (e, dt) in enumerate(zip(entries, dtypes)):
        h = e.layout.hint
        if isinstance(h, tuple) and len(h) == 3 and isinstance(h[0], FlatUnit) and not e.per_rank:
            flat.setdefault((h[0], h[1], e.role, dt, json.dumps(tags.get(e.key))), []).append(k)
        elif isinstance(h, tuple) and len(h) in (4, 5) and h[0] == "grid" and not e.per_rank and math.prod(e.layout.shape) > 0:
            try:  # (a hint that is no sequence of the right kinds is no rule: explicit rows; Unit checks the rest)
                body = {"k": "grid", "n": math.prod(h[1]), "mesh": list(h[1]), "pl": list(h[2]),
                        "t": [[e.name, list(e.layout.shape)]], "role": e.role, "dtype": dt, "tag": tags.get(e.key)}
                if len(h) == 5 and h[4] is not None:  # the mesh dimensions cut in another order (FSDP2 over TP)
                    body["order"] = list(h[4])
                grid[k] = (body, operator.index(h[3]))
            except TypeError:
                explicit.append(k)
        else:
            explicit.append(k)
    by_index: dict[int, list[tuple[str, dict, list[int]]]] = {}
    for (unit, index, role, dt, tag), ks in flat.items():
        body = {"k": "flat", "n": unit.world, "total": unit.total, "role": role, "dtype": dt, "tag": json.loads(tag),
                "t": [[n, list(sh), list(b[0]), list(b[1]), b[2]] for n, sh, b in zip(unit.names, unit.shapes, unit.boxes)]}
        if _claim_ok(body, index, [entries[k] for k in ks]):
            by_index.setdefault(index, []).append((_digest(body), body, ks))
        else:
            explicit += ks
    # per tensor, by what its grid rule shares with the model's other layers: its piece depends
    # on mesh, placements, shape and index only, its body's JSON on the name besides
    pieces: dict[tuple, Layout | None] = {}
    texts: dict[tuple, tuple[str, str] | None] = {}
    for k, (body, index) in grid.items():
        geo = (tuple(body["mesh"]), repr((body["pl"], body.get("order"))), tuple(body["t"][0][1]))
        if geo + (index,) not in pieces:  # (a grid rule has one tensor: its piece, if any)
            pieces[geo + (index,)] = next(iter((_pieces_at(body, index) or {}).values()), None)
        want = pieces[geo + (index,)]
        if want is None or entries[k].layout != want:
            explicit.append(k)
            continue
        key = geo + (body["role"], body["dtype"], repr(body["tag"]))
        if key not in texts:
            texts[key] = _around_name(body)
        around = texts[key]
        digest = (xxhash.xxh3_128_hexdigest((around[0] + json.dumps(body["t"][0][0]) + around[1]).encode())
                  if around is not None else _digest(body))
        by_index.setdefault(index, []).append((digest, body, [k]))
    rows = _rows([entries[k] for k in sorted(explicit)], [dtypes[k] for k in sorted(explicit)], tags)
    claims, sets, units, fallback = [], {}, {}, {}
    for index in sorted(by_index):
        us = sorted(by_index[index], key=lambda x: x[0])
        digests = [d for d, _, _ in us]
        sid = _digest(digests)  # ranks holding the same units share it (one body sent)
        claims.append((sid, index))
        sets[sid] = digests
        units.update({d: b for d, b, _ in us})
        ks = sorted(k for _, _, ks in us for k in ks)
        fallback[sid] = _rows([entries[k] for k in ks], [dtypes[k] for k in ks], tags)
    return LocalSummary(node, rows, claims, sets, units, fallback)


_NAME_MARK = "\u0000unickpt tensor name\u0000"


def _around_name(body: dict) -> tuple[str, str] | None:
    """The text of a one-tensor rule body's JSON (as :func:`_digest` writes it) before and
    after the tensor's name, so the body of another tensor of the same geometry, role, dtype
    and tag is ``before + json.dumps(name) + after``: :func:`_digest`'s text, without
    encoding the whole body again (9,003 DTensors of a 1,000-layer model in one summary)."""
    text = json.dumps(dict(body, t=[[_NAME_MARK, *body["t"][0][1:]]]), separators=(",", ":"))
    parts = text.split(json.dumps(_NAME_MARK))
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _pieces_at(body: dict, index: int) -> dict[str, Layout] | None:
    """The pieces rule ``body`` gives member ``index``, by tensor name (None: the rule is
    malformed, or has no such member)."""
    try:
        u = Unit(*_template(body))
    except LayoutError:
        return None
    if not 0 <= index < u.n:
        return None
    out = {}
    for j in u.slots_of(index):
        lay = u.piece(j, index)
        if lay is not None:
            out[u.slots[j][0]] = lay
    return out


def _claim_ok(body: dict, index: int, mine: list[Entry]) -> bool:
    want = _pieces_at(body, index)
    have = {e.name: e.layout for e in mine}
    return want is not None and len(have) == len(mine) and have == want


def encode_summary(entries: list[Entry], dtypes: list[str], node: str, tags: dict | None = None) -> bytes:
    """Explicit rows only (one per entry): the summary before rules, kept for tools/tests."""
    raw = json.dumps({"node": node, "t": _rows(entries, dtypes, tags or {})}, separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=3).compress(raw)

