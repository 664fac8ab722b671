"""Name and layout mappings in the load plan: a target tensor made of boxes of stored tensors.

A :class:`Mapping` says, for each target tensor (by name), which boxes of which stored tensors
of the same role make it: a renamed tensor is one box (the whole source); a fused serving
weight (``qkv_proj`` = q, k and v; ``gate_up_proj`` = gate and up) is several boxes side by
side along its output dimension, each cut for the serving rank's tensor-parallel shard;
stacked experts are one box per expert. The load plan then reads, for each target, only the
byte ranges of those boxes (verified like any load) straight into views of the target: no
converter, no full copy of the source on any rank.

Boxes are in the coordinates of the target as the load sees it: a plain tensor's own shape,
or the global shape of a DTensor or :func:`unickpt.shard` target. A rule answers
``pieces(name, shape, source_shapes)``; every mapping is checked before a byte is read: its
sources exist, their boxes lie inside them, and the boxes tile the target exactly (a TP
degree that does not divide the heads, a source of another size: refused with
:class:`~unickpt.errors.MappingError`).

Built in (each tested against ``transformers`` models built from configs, tests/test_mapping.py):

* :meth:`Mapping.fused` (Hugging Face Llama / Qwen2 / Mistral names -> the fused serving
  layout of vLLM-style engines, for one TP rank: ``qkv_proj`` and ``gate_up_proj``
  column-parallel, ``o_proj`` and ``down_proj`` row-parallel, embeddings and ``lm_head``
  vocab-parallel, norms replicated);
* :meth:`Mapping.stacked_experts` (per-expert keys -> one ``[E, ...]`` tensor), and
  :meth:`Mapping.mixtral_experts` (the Hub's Mixtral files -> ``transformers`` 5's stacked
  experts);
* the inverses :meth:`Mapping.unfused` (a whole fused layout -> Hugging Face's names) and
  :meth:`Mapping.hub_from_stacked_experts` (stacked experts -> the Hub's per-expert keys);
* :meth:`Mapping.hf_from_torchtitan` / :meth:`Mapping.torchtitan_from_hf` (Llama names both
  ways; ``wq``/``wk`` rows permuted between the rotary layouts, into whole tensors or any
  box of them: strided views of the target or boxes of the source viewed as
  ``(heads, hd/2, 2, cols)``);
* :meth:`Mapping.transpose` (dimensions permuted; any box of the target);
* :meth:`Mapping.rename` (regular expressions).

:meth:`Mapping.targets` lists what a mapping makes from a checkpoint's names (each rule's
replacement run backwards): what ``load_for_inference``, ``export_hf`` and the DCP reader
load with a mapping. Flat (ZeRO) targets are read as the boxes that tile their range. A
dtype cast is the load's own ``cast=True``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping as TMapping, Sequence

from .errors import MappingError, TensorMissingError
from .layout import Layout

__all__ = ["Mapping", "Piece", "Rule", "MappedTarget", "mapped_targets"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """A box of the target (``offsets``, ``sizes`` in the target's coordinates) filled from
    the box of stored tensor ``source`` starting at ``source_offsets``. ``squeeze``: target
    dimensions (of size 1 in the box) the source does not have (an expert's index in a
    stacked tensor)."""

    offsets: Shape
    sizes: Shape
    source: str
    source_offsets: Shape
    squeeze: tuple[int, ...] = ()
    target_view: Shape | None = None
    """The target read as this shape (same elements, row-major) before the box is taken."""
    source_view: Shape | None = None
    """The source read as this shape (same elements, row-major): boxes of it are the rows a
    permutation picks (the rotary layouts)."""
    src_sizes: Shape | None = None
    """The source box's sizes where views make them differ from the target box's."""
    perm: Shape | None = None
    """A transpose: the target's dimension ``d`` is the source's dimension ``perm[d]``
    (``source_offsets`` in the source's order)."""

    def source_sizes(self) -> Shape:
        if self.src_sizes is not None:
            return self.src_sizes
        if self.perm is not None:
            return tuple(self.sizes[self.perm.index(j)] for j in range(len(self.perm)))
        return tuple(s for d, s in enumerate(self.sizes) if d not in self.squeeze)


class Rule:
    """One rule of a mapping: which target names it takes and the pieces of each."""

    def match(self, name: str) -> bool:
        raise NotImplementedError

    def pieces(self, name: str, shape: Shape, source_shape: Callable[[str], Shape | None]) -> list[Piece]:
        raise NotImplementedError

    def targets(self, stored: TMapping[str, Shape]) -> dict[str, Shape]:
        """The target names (and shapes) this rule makes from the stored tensors ``stored``
        (name -> shape): what a load that enumerates its targets (``load_for_inference``,
        ``export_hf``, the DCP reader) asks for."""
        raise NotImplementedError(f"mapping: {type(self).__name__} cannot list the targets it makes from a checkpoint's "
                                  "names; define targets() on the rule, or load into targets you name (unickpt.load)")


class _Pattern(Rule):
    """A rule for the target names its regular expression ``pattern`` matches whole."""

    pattern: re.Pattern

    def _repl(self) -> str:
        """The replacement that names the first source of a target (for :meth:`targets`)."""
        raise NotImplementedError

    def _shape(self, name: str, stored: TMapping[str, Shape], experts: int) -> Shape:
        """Target ``name``'s shape from its sources' (``experts``: how many, when stacked)."""
        raise NotImplementedError

    def targets(self, stored):
        """Each stored name the first source's replacement could give is run backwards
        through it (:func:`_inverse`); a candidate counts when the pattern takes it and the
        replacement gives that stored name back."""
        inv = _inverse(self.pattern, self._repl())
        if inv is None:
            raise MappingError(f"mapping: the targets of pattern {self.pattern.pattern!r} cannot be listed from the "
                               f"checkpoint's names (only literal text and groups can be written back from "
                               f"{self._repl()!r}); load into targets you name with unickpt.load")
        regex, fill = inv
        found: dict[str, set[int]] = {}
        for s in stored:
            m = regex.fullmatch(s)
            if m is None:
                continue
            t = fill(m)
            repl = self._repl()
            e = m.groupdict().get("e")
            if e is not None:
                repl = repl.replace("{e}", e)
            if t is None or self.pattern.fullmatch(t) is None or self._sub(repl, t) != s:
                continue
            found.setdefault(t, set())
            if e is not None:
                found[t].add(int(e))
        return {t: self._shape(t, stored, max(es) + 1 if es else 0) for t, es in sorted(found.items())}

    def match(self, name: str) -> bool:
        return self.pattern.fullmatch(name) is not None

    def _sub(self, repl: str, name: str) -> str:
        """The stored name replacement ``repl`` gives for target ``name`` (a bad group
        reference: refused, typed)."""
        try:
            return self.pattern.sub(repl, name)
        except re.error as e:
            raise MappingError(f"mapping: replacement {repl!r} for {self.pattern.pattern!r}: {e}") from None

    def source(self, name: str, repl: str, source_shape, what: str = "") -> tuple[str, Shape]:
        """The stored name ``repl`` gives for ``name``, and its shape (missing: refused)."""
        src = self._sub(repl, name)
        sshape = source_shape(src)
        if sshape is None:
            raise TensorMissingError(f"mapping: target {name!r} needs {src!r}{what}, which the checkpoint does not hold")
        return src, tuple(sshape)


@dataclass(frozen=True)
class _Rename(_Pattern):
    pattern: re.Pattern
    repl: str

    def _repl(self):
        return self.repl

    def _shape(self, name, stored, experts):
        return self.source(name, self.repl, stored.get)[1]

    def pieces(self, name, shape, source_shape):
        return [Piece((0,) * len(shape), tuple(shape), self._sub(self.repl, name), (0,) * len(shape))]


def _tp_block(n: int, units: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """``(start, length)`` of TP rank ``rank``'s part of ``n`` rows made of ``units`` equal
    units (heads): ``units / size`` units each, or, with fewer units than ranks, one unit
    shared by ``size / units`` consecutive ranks (vLLM's replicated KV heads)."""
    if units <= 0 or n % units:
        raise MappingError(f"{what}: {n} rows do not split into {units} equal parts (heads, or one per TP rank)")
    per = n // units
    if units % size == 0:
        k = units // size
        return rank * k * per, k * per
    if size % units == 0:
        return (rank // (size // units)) * per, per
    raise MappingError(f"{what}: tensor parallelism of {size} ranks does not divide its {units} heads "
                       f"(nor do they divide it): no rank's share is whole heads")


@dataclass(frozen=True)
class _Fuse(_Pattern):
    """Target ``pattern`` = its sources (``repls``, one per part) side by side along ``dim``;
    with ``tp`` (rank, size), each source contributes TP rank ``rank``'s block of its rows
    along ``dim`` (``units[i]`` heads: KV heads may be replicated)."""

    pattern: re.Pattern
    repls: tuple[str, ...]
    dim: int = 0
    tp: tuple[int, int] | None = None
    units: tuple[int, ...] | None = None

    def _repl(self):
        return self.repls[0]

    def _shape(self, name, stored, experts):
        rows, first = 0, None
        for i, r in enumerate(self.repls):
            src, sshape = self.source(name, r, stored.get)
            first = first or sshape
            if len(sshape) <= self.dim:
                raise MappingError(f"mapping: target {name!r}: its source {src!r} {list(sshape)} has no dimension "
                                   f"{self.dim} to put side by side")
            n = sshape[self.dim]
            if self.tp is not None:
                units = self.units[i] if self.units else self.tp[1]
                n = _tp_block(n, units, self.tp[0], self.tp[1], f"mapping {src!r} -> {name!r}")[1]
            rows += n
        return first[:self.dim] + (rows,) + first[self.dim + 1:]

    def pieces(self, name, shape, source_shape):
        out, at, per_unit = [], 0, set()
        for i, r in enumerate(self.repls):
            src, sshape = self.source(name, r, source_shape)
            if self.units and len(sshape) > self.dim and sshape[self.dim] % self.units[i] == 0:
                per_unit.add(sshape[self.dim] // self.units[i])
            if len(per_unit) > 1:  # q, k and v heads of one size, or the config's head counts are not the checkpoint's
                raise MappingError(f"mapping: target {name!r}: its sources' rows per head differ ({sorted(per_unit)}) "
                                   f"with {self.units} heads: the heads given do not match the checkpoint")
            if len(sshape) != len(shape):
                raise MappingError(f"mapping: target {name!r} has {len(shape)} dimensions, its source {src!r} "
                                   f"{len(sshape)}")
            start, n = 0, sshape[self.dim]
            if self.tp is not None:
                units = self.units[i] if self.units else self.tp[1]
                start, n = _tp_block(sshape[self.dim], units, self.tp[0], self.tp[1], f"mapping {src!r} -> {name!r}")
            offs = [0] * len(shape)
            offs[self.dim] = at
            sizes = list(shape)
            sizes[self.dim] = n
            soffs = [0] * len(shape)
            soffs[self.dim] = start
            for d, (a, b) in enumerate(zip(shape, sshape)):
                if d != self.dim and a != b:
                    raise MappingError(f"mapping: target {name!r} has size {a} in dimension {d}, its source {src!r} "
                                       f"{b}")
            out.append(Piece(tuple(offs), tuple(sizes), src, tuple(soffs)))
            at += n
        if at != shape[self.dim]:
            raise MappingError(f"mapping: target {name!r} has {shape[self.dim]} rows along dimension {self.dim}, its "
                               f"sources give {at} ({', '.join(self.pattern.sub(r, name) for r in self.repls)}"
                               + (f", TP rank {self.tp[0]} of {self.tp[1]}" if self.tp else "") + ")")
        return out


@dataclass(frozen=True)
class _Split(_Pattern):
    """Target ``pattern`` = TP rank ``rank``'s block of source ``repl`` along ``dim``
    (row-parallel weights: ``dim=1``; vocab-parallel embeddings: ``dim=0``)."""

    pattern: re.Pattern
    repl: str
    dim: int
    tp: tuple[int, int]

    def _repl(self):
        return self.repl

    def _shape(self, name, stored, experts):
        src, sshape = self.source(name, self.repl, stored.get)
        if len(sshape) <= self.dim:
            return sshape
        start, n = _tp_block(sshape[self.dim], self.tp[1], self.tp[0], self.tp[1], f"mapping {src!r} -> {name!r}")
        return sshape[:self.dim] + (n,) + sshape[self.dim + 1:]

    def pieces(self, name, shape, source_shape):
        src, sshape = self.source(name, self.repl, source_shape)
        if len(sshape) <= self.dim:
            return _Rename(self.pattern, self.repl).pieces(name, shape, source_shape)
        start, n = _tp_block(sshape[self.dim], self.tp[1], self.tp[0], self.tp[1], f"mapping {src!r} -> {name!r}")
        share = list(sshape)
        share[self.dim] = n
        if tuple(shape) != tuple(share):  # (a box of the target's own size would read a neighbour's share)
            raise MappingError(f"mapping: target {name!r} has shape {list(shape)}; TP rank {self.tp[0]} of "
                               f"{self.tp[1]}'s share of {src!r} {list(sshape)} is {share}")
        soffs = [0] * len(shape)
        soffs[self.dim] = start
        return [Piece((0,) * len(shape), tuple(shape), src, tuple(soffs))]


@dataclass(frozen=True)
class _Stack(_Pattern):
    """Target ``pattern`` (``[E, ...]``): row ``e`` is the sources ``repls`` (``{e}`` replaced
    by the expert index) side by side along the row's dimension ``dim``."""

    pattern: re.Pattern
    repls: tuple[str, ...]
    dim: int = 0

    def _repl(self):
        return self.repls[0]

    def _shape(self, name, stored, experts):
        row = None
        for r in self.repls:
            src, sshape = self.source(name, r.replace("{e}", "0"), stored.get, " (expert 0)")
            if len(sshape) <= self.dim:
                raise MappingError(f"mapping: expert 0 of target {name!r}: its source {src!r} {list(sshape)} has no "
                                   f"dimension {self.dim}")
            if row is None:
                row = list(sshape)
            else:
                row[self.dim] += sshape[self.dim]
        return (experts, *row)

    def pieces(self, name, shape, source_shape):
        if len(shape) < 2 or self.dim >= len(shape) - 1:
            raise MappingError(f"mapping: stacked target {name!r} has shape {list(shape)}: one row per expert needs "
                               f"at least two dimensions, and the row a dimension {self.dim}")
        out = []
        row = shape[1:]
        for e in range(shape[0]):
            at = 0
            for r in self.repls:
                src, sshape = self.source(name, r.replace("{e}", str(e)), source_shape, f" (expert {e})")
                if len(sshape) != len(row) or any(a != b for d, (a, b) in enumerate(zip(row, sshape)) if d != self.dim):
                    raise MappingError(f"mapping: expert {e} of target {name!r} has shape {list(row)}, its source "
                                       f"{src!r} {list(sshape)}")
                offs = [e] + [0] * len(row)
                offs[1 + self.dim] = at
                sizes = [1, *row]
                sizes[1 + self.dim] = sshape[self.dim]
                out.append(Piece(tuple(offs), tuple(sizes), src, (0,) * len(row), (0,)))
                at += sshape[self.dim]
        return out


def _part(n: int, units: tuple[int, ...], k: int, what: str) -> tuple[int, int]:
    """``(start, size)`` of part ``k`` of ``n`` rows cut in proportion to ``units`` (q, k and v
    heads: ``(nh, nkv, nkv)``; gate and up: ``(1, 1)``)."""
    total = sum(units)
    if n % total:
        raise MappingError(f"{what}: {n} rows do not split in the proportion {list(units)}")
    per = n // total
    return sum(units[:k]) * per, units[k] * per


@dataclass(frozen=True)
class _Slice(_Pattern):
    """Target ``pattern`` = part ``k`` of source ``repl``'s rows cut in proportion to
    ``units`` (a fused serving tensor read back as the training layout's own tensors)."""

    pattern: re.Pattern
    repl: str
    units: tuple[int, ...]
    k: int

    def _repl(self):
        return self.repl

    def _shape(self, name, stored, experts):
        src, sshape = self.source(name, self.repl, stored.get)
        return (_part(sshape[0], self.units, self.k, f"mapping {src!r} -> {name!r}")[1], *sshape[1:])

    def pieces(self, name, shape, source_shape):
        src, sshape = self.source(name, self.repl, source_shape)
        start, n = _part(sshape[0], self.units, self.k, f"mapping {src!r} -> {name!r}")
        if tuple(shape) != (n, *sshape[1:]):
            raise MappingError(f"mapping: target {name!r} has shape {list(shape)}; its part of {src!r} "
                               f"{list(sshape)} is {[n, *sshape[1:]]}")
        return [Piece((0,) * len(shape), tuple(shape), src, (start,) + (0,) * (len(shape) - 1))]


@dataclass(frozen=True)
class _Unstack(_Pattern):
    """Target ``pattern`` (its group ``e``: the expert index) = part ``k`` (rows in
    proportion to ``units``) of expert ``e``'s row of the stacked source ``repl``
    (``[E, R, ...]``): a box of the source viewed as ``[E * R, ...]``."""

    pattern: re.Pattern
    repl: str
    units: tuple[int, ...] = (1,)
    k: int = 0

    def _repl(self):
        return self.repl

    def _row(self, name, source_shape):
        src, sshape = self.source(name, self.repl, source_shape)
        if len(sshape) < 2:
            raise MappingError(f"mapping: {src!r} {list(sshape)} is not a stack of experts")
        start, n = _part(sshape[1], self.units, self.k, f"mapping {src!r} -> {name!r}")
        return src, sshape, start, n

    def _shape(self, name, stored, experts):
        _, sshape, _, n = self._row(name, stored.get)
        return (n, *sshape[2:])

    def targets(self, stored):
        """Each stored stack the replacement could name, run backwards (:func:`_repl_regex`),
        gives one target per expert (the group ``e`` filled with its index)."""
        got = _repl_regex(self.pattern, self.repl)
        e_group = self.pattern.groupindex.get("e")
        if got is None or got[2] is None or e_group is None:
            raise MappingError(f"mapping: the targets of pattern {self.pattern.pattern!r} cannot be listed (literal "
                               "text and groups, one of them (?P<e>...) the expert index)")
        regex, _, template = got
        out = {}
        for s, sshape in stored.items():
            m = regex.fullmatch(s)
            if m is None or len(sshape) < 2:
                continue
            vals = {int(g[1:]): v for g, v in m.groupdict().items() if g[1:].isdigit()}
            for e in range(sshape[0]):
                vals[e_group] = str(e)
                if any(isinstance(x, int) and x not in vals for x in template):
                    break
                t = "".join(x if isinstance(x, str) else vals[x] for x in template)
                if self.pattern.fullmatch(t) is None or self._sub(self.repl, t) != s:
                    break
                out[t] = self._shape(t, stored, 0)
        return dict(sorted(out.items()))

    def pieces(self, name, shape, source_shape):
        src, sshape, start, n = self._row(name, source_shape)
        e = int(self.pattern.fullmatch(name).group("e"))
        if not e < sshape[0] or tuple(shape) != (n, *sshape[2:]):
            raise MappingError(f"mapping: target {name!r} {list(shape)} is not a part of expert {e} of {src!r} "
                               f"{list(sshape)}")
        view = (sshape[0] * sshape[1], *sshape[2:])
        return [Piece((0,) * len(shape), tuple(shape), src, (e * sshape[1] + start,) + (0,) * (len(shape) - 1),
                      source_view=view, src_sizes=tuple(shape))]


@dataclass(frozen=True)
class _Transpose(_Pattern):
    """Target ``pattern`` = source ``repl`` with its dimensions permuted: the target's
    dimension ``d`` is the source's ``perm[d]`` (``(1, 0)``: a transposed matrix, as GPT-2's
    ``Conv1D`` weights are to ``nn.Linear``'s)."""

    pattern: re.Pattern
    repl: str
    perm: tuple[int, ...]

    def _repl(self):
        return self.repl

    def _shape(self, name, stored, experts):
        src, sshape = self.source(name, self.repl, stored.get)
        if len(sshape) != len(self.perm):
            raise MappingError(f"mapping: target {name!r} permutes {len(self.perm)} dimensions, its source {src!r} has "
                               f"{len(sshape)} ({list(sshape)})")
        return tuple(sshape[p] for p in self.perm)

    def pieces(self, name, shape, source_shape):
        src, sshape = self.source(name, self.repl, source_shape)
        if len(sshape) != len(self.perm) or tuple(shape) != tuple(sshape[p] for p in self.perm):
            raise MappingError(f"mapping: target {name!r} has shape {list(shape)}; {src!r} {list(sshape)} with its "
                               f"dimensions in the order {list(self.perm)} is {[sshape[p] for p in self.perm]}")
        return [Piece((0,) * len(shape), tuple(shape), src, (0,) * len(shape), perm=self.perm)]


@dataclass(frozen=True)
class _Rotary(_Pattern):
    """Target ``pattern`` = source ``repl`` with each head's rows permuted between the two
    rotary layouts of Llama's q/k weights: Meta's and torchtitan's (the rotary pairs
    interleaved, rows ``2b + a`` of a head) and Hugging Face's (the halves, rows
    ``a * hd/2 + b``), as Hugging Face's conversion script permutes them. ``to_hf``: the
    target is in Hugging Face's layout. Two pieces per head (``a`` = 0, 1), each a box of
    the source or target viewed as ``(heads, hd/2, 2, cols)``."""

    pattern: re.Pattern
    repl: str
    heads: int
    to_hf: bool
    head_dim: int | None = None

    def _repl(self):
        return self.repl

    def _shape(self, name, stored, experts):
        return self.source(name, self.repl, stored.get)[1]

    def pieces(self, name, shape, source_shape):
        src, sshape = self.source(name, self.repl, source_shape)
        if len(shape) != 2 or tuple(sshape) != tuple(shape) or shape[0] % (2 * self.heads) or (
                self.head_dim is not None and shape[0] != self.heads * self.head_dim):
            raise MappingError(f"mapping: target {name!r} {list(shape)} is not {src!r} {list(sshape)} as {self.heads} "
                               "heads of an even number of rows" + (f" ({self.head_dim} each)" if self.head_dim else ""))
        hd, cols = shape[0] // self.heads, shape[1]
        view = (self.heads, hd // 2, 2, cols)
        out = []
        for h in range(self.heads):
            for a in range(2):
                rows = (h * hd + a * (hd // 2), 0)
                if self.to_hf:  # the target's contiguous half-head <- the source's strided rows
                    out.append(Piece(rows, (hd // 2, cols), src, (h, 0, a, 0), source_view=view,
                                     src_sizes=(1, hd // 2, 1, cols)))
                else:  # the target's strided rows <- the source's contiguous half-head
                    out.append(Piece((h, 0, a, 0), (1, hd // 2, 1, cols), src, rows, squeeze=(0, 2), target_view=view,
                                     src_sizes=(hd // 2, cols)))
        return out


class Mapping:
    """Target names -> boxes of stored tensors (module doc). Rules are tried in order; a
    target no rule takes is read under its own name."""

    def __init__(self, rules: Sequence[Rule] = ()) -> None:
        self.rules = list(rules)
        self._memo: dict = {}  # (name, shape) -> (pieces, {source: shape}): built-in rules, checked pieces

    def __add__(self, other: "Mapping") -> "Mapping":
        if not isinstance(other, Mapping):
            return NotImplemented
        return Mapping(self.rules + other.rules)

    def __repr__(self) -> str:
        return f"Mapping({len(self.rules)} rules)"

    def rule_for(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.match(name)), None)

    # -- built-ins ---------------------------------------------------------------------------

    @staticmethod
    def rename(pairs: Sequence[tuple[str, str]] | TMapping[str, str]) -> "Mapping":
        r"""Targets named by regular expressions (``re.fullmatch``) read from the names their
        replacements give (``re.sub`` syntax: ``\1``)."""
        items = list(pairs.items() if isinstance(pairs, TMapping) else pairs)
        rules = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) for x in item)):
                raise MappingError(f"Mapping.rename takes (pattern, replacement) pairs of strings, got {item!r}")
            rules.append(_Rename(_compile(item[0]), item[1]))
        return Mapping(rules)

    @staticmethod
    def stacked_experts(target: str, *sources: str, dim: int = 0) -> "Mapping":
        r"""``target`` (a regular expression, e.g. ``r"(.*)\.experts\.down_proj"``) is an
        ``[E, ...]`` tensor whose row ``e`` is the stored tensors ``sources`` with ``{e}``
        replaced by ``e`` (e.g. ``r"\1.experts.{e}.w2.weight"``), side by side along the
        row's dimension ``dim`` when there are several (gate and up: one ``gate_up_proj``)."""
        if not sources or not all(isinstance(s, str) and "{e}" in s for s in sources):
            raise MappingError(f"Mapping.stacked_experts needs source names with {{e}} (the expert index), got "
                               f"{list(sources)!r}")
        if type(dim) is not int or dim < 0:
            raise MappingError(f"Mapping.stacked_experts: dim (where several sources sit side by side inside each "
                               f"expert's row) must be an integer >= 0, got {dim!r}")
        return Mapping([_Stack(_compile(target), tuple(sources), dim)])

    @staticmethod
    def transpose(target: str, source: str = r"\g<0>", perm: Sequence[int] = (1, 0)) -> "Mapping":
        r"""Targets named by ``target`` (a regular expression) are the stored tensor
        ``source`` (its replacement; default: the same name) with dimensions permuted:
        the target's dimension ``d`` is the source's ``perm[d]``. E.g. GPT-2's ``Conv1D``
        weights (``[in, out]``) for an engine that holds ``nn.Linear``'s ``[out, in]``:
        ``Mapping.transpose(r".*\.(c_attn|c_proj|c_fc)\.weight")``. A TP shard of the
        target reads the matching box of the source."""
        p = tuple(perm) if isinstance(perm, (list, tuple)) else None
        if p is None or sorted(p) != list(range(len(p))) or not all(type(x) is int for x in p) or len(p) < 2:
            raise MappingError(f"Mapping.transpose: perm must list the dimensions 0..n-1 (n >= 2) in the target's order, "
                               f"got {perm!r}")
        if not isinstance(source, str):
            raise MappingError(f"Mapping.transpose: source must be a replacement string, got {source!r}")
        return Mapping([_Transpose(_compile(target), source, p)])

    @staticmethod
    def unfused(config: Any = None, *, num_heads: int | None = None, num_kv_heads: int | None = None,
                prefix: str = "model.") -> "Mapping":
        """The inverse of :meth:`fused` at TP 1: Hugging Face's ``q_proj``/``k_proj``/
        ``v_proj`` (and biases) read from the rows of a whole ``qkv_proj``, ``gate_proj``/
        ``up_proj`` from ``gate_up_proj``; everything else as it is named."""
        heads, kv = _heads(config, num_heads, num_kv_heads, "Mapping.unfused")
        layer = rf"({re.escape(prefix)}layers\.\d+)"
        rules: list[Rule] = []
        for kind in ("weight", "bias"):
            for i, x in enumerate("qkv"):
                rules.append(_Slice(re.compile(rf"{layer}\.self_attn\.{x}_proj\.{kind}"),
                                    rf"\1.self_attn.qkv_proj.{kind}", (heads, kv, kv), i))
            for i, x in enumerate(("gate", "up")):
                rules.append(_Slice(re.compile(rf"{layer}\.mlp\.{x}_proj\.{kind}"), rf"\1.mlp.gate_up_proj.{kind}",
                                    (1, 1), i))
        return Mapping(rules)

    @staticmethod
    def hub_from_stacked_experts(prefix: str = "model.") -> "Mapping":
        """The inverse of :meth:`mixtral_experts`: the Hub's per-expert Mixtral keys
        (``block_sparse_moe.experts.{e}.w1/w3`` the halves of each expert's row of
        ``mlp.experts.gate_up_proj``, ``w2`` its row of ``down_proj``) read from
        ``transformers`` 5's stacked experts."""
        layer = rf"({re.escape(prefix)}layers\.\d+)"
        exp = rf"{layer}\.block_sparse_moe\.experts\.(?P<e>\d+)"
        return Mapping([
            _Unstack(re.compile(rf"{exp}\.w1\.weight"), r"\1.mlp.experts.gate_up_proj", (1, 1), 0),
            _Unstack(re.compile(rf"{exp}\.w3\.weight"), r"\1.mlp.experts.gate_up_proj", (1, 1), 1),
            _Unstack(re.compile(rf"{exp}\.w2\.weight"), r"\1.mlp.experts.down_proj", (1,), 0),
            _Rename(re.compile(rf"{layer}\.block_sparse_moe\.gate\.weight"), r"\1.mlp.gate.weight"),
        ])

    @staticmethod
    def mixtral_experts(prefix: str = "model.") -> "Mapping":
        """Mixtral's per-expert keys (the Hugging Face Hub's files: ``block_sparse_moe.
        experts.{e}.w1/w2/w3``, ``block_sparse_moe.gate``) -> the stacked experts of
        ``transformers`` 5 (``mlp.experts.gate_up_proj`` = w1 then w3 per expert,
        ``mlp.experts.down_proj`` = w2, ``mlp.gate``)."""
        layer = rf"({re.escape(prefix)}layers\.\d+)"
        return Mapping([
            _Stack(re.compile(rf"{layer}\.mlp\.experts\.gate_up_proj"),
                   (r"\1.block_sparse_moe.experts.{e}.w1.weight", r"\1.block_sparse_moe.experts.{e}.w3.weight"), 0),
            _Stack(re.compile(rf"{layer}\.mlp\.experts\.down_proj"), (r"\1.block_sparse_moe.experts.{e}.w2.weight",), 0),
            _Rename(re.compile(rf"{layer}\.mlp\.gate\.weight"), r"\1.block_sparse_moe.gate.weight"),
        ])

    @staticmethod
    def hf_from_torchtitan(config: Any = None, *, num_heads: int | None = None, num_kv_heads: int | None = None,
                           head_dim: int | None = None) -> "Mapping":
        """Hugging Face Llama names (targets) read from torchtitan's Llama names (stored),
        ``wq``/``wk`` rows permuted between the rotary layouts as Hugging Face's conversion
        script does: a torchtitan checkpoint loads into a ``transformers`` model. ``head_dim``
        (default: the config's, or its ``hidden_size / num_heads``): checked against the
        rows of ``wq``/``wk``, so wrong head counts are refused, not permuted."""
        heads, kv = _heads(config, num_heads, num_kv_heads, "Mapping.hf_from_torchtitan")
        return Mapping(_titan_rules(heads, kv, True, _head_dim(config, head_dim, heads, "Mapping.hf_from_torchtitan")))

    @staticmethod
    def torchtitan_from_hf(config: Any = None, *, num_heads: int | None = None, num_kv_heads: int | None = None,
                           head_dim: int | None = None) -> "Mapping":
        """torchtitan's Llama names (targets) read from Hugging Face's (stored): the inverse
        of :meth:`hf_from_torchtitan`."""
        heads, kv = _heads(config, num_heads, num_kv_heads, "Mapping.torchtitan_from_hf")
        return Mapping(_titan_rules(heads, kv, False, _head_dim(config, head_dim, heads, "Mapping.torchtitan_from_hf")))

    @staticmethod
    def fused(config: Any = None, *, tp_rank: int = 0, tp_size: int = 1, num_heads: int | None = None,
              num_kv_heads: int | None = None, prefix: str = "model.") -> "Mapping":
        """Hugging Face Llama-family names (Llama, Qwen2, Mistral) -> the fused serving layout
        of vLLM-style engines for TP rank ``tp_rank`` of ``tp_size``: ``qkv_proj`` (q, k, v
        heads of this rank, KV heads replicated when fewer than ranks), ``gate_up_proj``
        (gate then up), column-parallel biases alike; ``o_proj``/``down_proj`` split along
        their input dimension; ``embed_tokens``/``lm_head`` along the vocabulary; everything
        else (norms) whole. ``config``: a ``transformers`` config (heads read from it), or
        give ``num_heads``/``num_kv_heads``."""
        heads, kv = _heads(config, num_heads, num_kv_heads, "Mapping.fused")
        if not (type(tp_size) is int and type(tp_rank) is int and tp_size >= 1 and 0 <= tp_rank < tp_size):
            raise MappingError(f"Mapping.fused: tp_rank {tp_rank!r} of tp_size {tp_size!r} is not a rank of the group")
        if kv > heads or heads % kv:
            raise MappingError(f"Mapping.fused: {kv} key/value heads for {heads} query heads (they must divide them)")
        if heads % tp_size:  # (query heads are never replicated)
            raise MappingError(f"Mapping.fused: tensor parallelism of {tp_size} ranks does not divide its {heads} "
                               "heads (query heads are never replicated)")
        tp = (tp_rank, tp_size)
        _tp_block(heads, heads, tp_rank, tp_size, "query heads")  # refused now, not at the first load
        _tp_block(kv, kv, tp_rank, tp_size, "key/value heads")
        p = re.escape(prefix)
        layer = rf"({p}layers\.\d+)"
        rules: list[Rule] = []
        for kind in ("weight", "bias"):
            rules.append(_Fuse(re.compile(rf"{layer}\.self_attn\.qkv_proj\.{kind}"),
                               tuple(rf"\1.self_attn.{x}_proj.{kind}" for x in "qkv"), 0, tp, (heads, kv, kv)))
            rules.append(_Fuse(re.compile(rf"{layer}\.mlp\.gate_up_proj\.{kind}"),
                               (rf"\1.mlp.gate_proj.{kind}", rf"\1.mlp.up_proj.{kind}"), 0, tp, None))
        rules.append(_Split(re.compile(rf"{layer}\.self_attn\.o_proj\.weight"), r"\1.self_attn.o_proj.weight", 1, tp))
        rules.append(_Split(re.compile(rf"{layer}\.mlp\.down_proj\.weight"), r"\1.mlp.down_proj.weight", 1, tp))
        rules.append(_Split(re.compile(rf"({p}embed_tokens\.weight)"), r"\1", 0, tp))
        rules.append(_Split(re.compile(r"(lm_head\.weight)"), r"\1", 0, tp))
        return Mapping(rules)

    # -- the load plan ---------------------------------------------------------------------------

    def targets(self, stored: TMapping[str, Shape]) -> dict[str, Shape]:
        """The tensors this mapping makes from a checkpoint's tensors ``stored`` (name ->
        shape, tied names included): each rule's targets (checked as a load checks them),
        then every stored tensor no target reads, under its own name. What
        ``load_for_inference``, ``export_hf`` and the DCP reader load. A stored name a rule
        takes as a target whose sources are missing is refused (typed), never dropped."""
        stored = {n: tuple(s) for n, s in stored.items()}
        out: dict[str, Shape] = {}
        used: set[str] = set()
        for rule in self.rules:
            for t, shape in rule.targets(stored).items():
                if t in out or self.rule_for(t) is not rule:  # (an earlier rule takes this name)
                    continue
                out[t] = shape
                used.update(pc.source for pc in self.pieces(t, shape, stored.get) or ())
        shadowed = []
        for s, shape in stored.items():
            if s in used:
                continue
            if s in out:  # a target of that name is made from other tensors: this one is read by none
                shadowed.append(s)
                continue
            if self.rule_for(s) is not None:  # a target this mapping makes from other tensors
                self.pieces(s, shape, stored.get)  # (raises: its sources are not all there)
            out[s] = shape
        if shadowed:
            from ._metrics import log

            log.warning("mapping: %d stored tensor(s) read by no target, their names taken by targets made from "
                        "other tensors: %s", len(shadowed), shadowed[:8])
        return dict(sorted(out.items()))

    def pieces(self, name: str, shape: Shape, source_shape: Callable[[str], Shape | None]) -> list[Piece] | None:
        """The checked pieces of target ``name`` of ``shape``, or None (read as it is named)."""
        rule = self.rule_for(name)
        if rule is None:
            return None
        key = (name, tuple(shape))
        got = self._memo.get(key)
        if got is not None and got[2] is rule and all(source_shape(s) == sh for s, sh in got[1].items()):
            return got[0]  # (a built-in rule's pieces depend on its sources' shapes only: a subscriber's every update)
        out = rule.pieces(name, tuple(shape), source_shape)
        covered = 0
        for pc in out:
            sshape = pc.source_view or source_shape(pc.source)
            if sshape is None:
                raise TensorMissingError(f"mapping: target {name!r} needs {pc.source!r}, which the checkpoint does "
                                         "not hold")
            ss = pc.source_sizes()
            if len(ss) != len(sshape) or any(o < 0 or o + s > n for o, s, n in zip(pc.source_offsets, ss, sshape)):
                raise MappingError(f"mapping: target {name!r} reads {list(ss)} from {pc.source!r} at "
                                   f"{list(pc.source_offsets)}, outside its shape {list(sshape)}")
            if any(o < 0 or o + s > n for o, s, n in zip(pc.offsets, pc.sizes, pc.target_view or shape)):
                raise MappingError(f"mapping: a piece of target {name!r} lies outside its shape {list(shape)}")
            covered += math.prod(pc.sizes)
        if covered != math.prod(shape):
            raise MappingError(f"mapping: the pieces of target {name!r} cover {covered} of its {math.prod(shape)} "
                               "elements")
        _disjoint(name, out)  # (with the count above: they tile the target, no element twice or never)
        if isinstance(rule, _Pattern) and len(self._memo) < 1 << 16:
            self._memo[key] = (out, {pc.source: source_shape(pc.source) for pc in out}, rule)
        return out


_BACKREF = re.compile(r"\\(?:(\d+)|g<(\w+)>)|\{e\}")


def _template(pattern: str, bodies: dict[int, str] | None = None) -> list[str | int] | None:
    """``pattern`` as literal text and its (top-level) groups' numbers, or None when it is
    anything else (classes, repeats or alternatives outside a group): then a target name
    cannot be written from the groups' values. ``bodies``: filled with each group's own
    regular expression."""
    out: list[str | int] = []
    i, group = 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if i + 1 < len(pattern) and not pattern[i + 1].isalnum():
                out.append(pattern[i + 1])
                i += 2
                continue
            return None
        if c == "(":
            if pattern.startswith("(?", i) and not pattern.startswith("(?P<", i):
                return None
            depth, j = 1, i + 1
            while j < len(pattern) and depth:
                if pattern[j] == "\\":
                    j += 2
                    continue
                if pattern[j] == "[":  # a class may hold parentheses
                    k = pattern.find("]", j + 2)
                    if k < 0:
                        return None
                    j = k + 1
                    continue
                if pattern[j] == "(":
                    if not pattern.startswith("(?:", j):
                        return None  # nested groups renumber: not written back
                    depth += 1
                elif pattern[j] == ")":
                    depth -= 1
                j += 1
            if depth:
                return None
            group += 1
            out.append(group)
            if bodies is not None:
                head = pattern.index(">", i) + 1 if pattern.startswith("(?P<", i) else i + 1
                bodies[group] = pattern[head:j - 1]
            i = j
            continue
        if c in ".^$*+?{}[]|)":
            return None
        out.append(c)
        i += 1
    return out


def _repl_regex(pattern: re.Pattern, repl: str) -> tuple[re.Pattern, set[str], list | None] | None:
    """``(regex, groups, template)``: ``regex`` matches the stored names replacement ``repl``
    can give, its group references and ``{e}`` as named groups (``g1``..., ``e``), each
    group as the pattern's own group matches it (no broader, so a near miss costs no
    backtracking); ``template``: :func:`_template` of ``pattern``. None when ``repl`` holds
    escapes or a reference to no group."""
    bodies: dict[int, str] = {}
    template = _template(pattern.pattern, bodies)

    def body(idx: int) -> str:
        b = pattern.pattern if idx == 0 else bodies.get(idx)
        if b is None or re.search(r"\\\d|\(\?P=|\\g<", b):  # (references inside would point elsewhere here)
            return ".*?"
        return f"(?:{b})"

    parts, seen, at = [], set(), 0
    for m in _BACKREF.finditer(repl):
        lit = repl[at:m.start()]
        if "\\" in lit:
            return None
        parts.append(re.escape(lit))
        if m.group(0) == "{e}":
            name, b = "e", r"\d+"
        else:
            ref = m.group(1) or m.group(2)
            idx = int(ref) if ref.isdigit() else pattern.groupindex.get(ref)
            if idx is None:
                return None
            name, b = f"g{idx}", body(idx)
        parts.append(f"(?P={name})" if name in seen else f"(?P<{name}>{b})")
        seen.add(name)
        at = m.end()
    if "\\" in repl[at:]:
        return None
    parts.append(re.escape(repl[at:]))
    try:
        return re.compile("".join(parts)), seen, template
    except re.error:  # (a group's own expression that does not stand alone)
        return None


def _inverse(pattern: re.Pattern, repl: str):
    """``(regex, fill)``: :func:`_repl_regex`'s regex, and ``fill(match)`` the target name
    whose pattern groups those values fill. None when ``pattern`` cannot be written back
    (:func:`_template`; unless ``repl`` holds the whole target, ``\\g<0>``), a group of
    the target has no value in the replacement, or ``repl`` holds escapes."""
    got = _repl_regex(pattern, repl)
    if got is None:
        return None
    regex, seen, template = got
    if "g0" in seen:  # the whole target name is in the stored one
        return regex, lambda m: m.group("g0")
    if template is None or any(isinstance(x, int) and f"g{x}" not in seen for x in template):
        return None

    def fill(m: re.Match) -> str:
        return "".join(x if isinstance(x, str) else m.group(f"g{x}") for x in template)

    return regex, fill


@dataclass(frozen=True)
class MappedTarget:
    """A tensor a mapping makes from a checkpoint (:func:`mapped_targets`): its shape, its
    sources' dtype (stored name), the stored tensors it reads and its pieces (None: read as
    it is named)."""

    shape: Shape
    dtype: str
    sources: tuple[str, ...]
    pieces: list[Piece] | None

    @property
    def whole(self) -> str | None:
        """The stored tensor this target is, whole and unpermuted (a rename or a name no rule
        takes), else None."""
        p = self.pieces[0] if self.pieces else None
        if self.pieces is None or (len(self.pieces) == 1 and p.target_view is None and p.source_view is None
                                   and p.perm is None and not p.squeeze and tuple(p.sizes) == tuple(self.shape)
                                   and not any(p.source_offsets)):
            return self.sources[0]
        return None


def mapped_targets(mapping: "Mapping", stored: TMapping[str, Any], where: str) -> dict[str, MappedTarget]:
    """The targets ``mapping`` makes from ``stored`` (name -> a manifest's tensor entry:
    ``.shape``, ``.dtype``), checked, in name order: what a load that lists its own targets
    reads. A target whose sources differ in dtype is refused (``where``: the checkpoint,
    for the message)."""
    shapes = mapping.targets({n: tuple(st.shape) for n, st in stored.items()})
    out = {}
    for t, shape in shapes.items():
        pieces = mapping.pieces(t, shape, lambda s: tuple(stored[s].shape) if s in stored else None)
        srcs = tuple(dict.fromkeys(p.source for p in pieces)) if pieces is not None else (t,)
        dts = {stored[s].dtype for s in srcs}
        if len(dts) != 1:
            raise MappingError(f"{where}: target {t!r} of the mapping is made of tensors of different dtypes "
                               f"({', '.join(f'{s}: {stored[s].dtype}' for s in srcs)})")
        out[t] = MappedTarget(tuple(shape), dts.pop(), srcs, pieces)
    return out


def _disjoint(name: str, pieces: list[Piece]) -> None:
    """Refuse pieces of one target that overlap (an element written twice means another is
    never written). Boxes compared pairwise, 256 at a time against all (numpy)."""
    import numpy as np

    views = {p.target_view for p in pieces}
    if len(pieces) < 2 or len(views) > 1:
        if len(views) > 1:
            raise MappingError(f"mapping: the pieces of target {name!r} view it in different shapes")
        return
    lo = np.array([p.offsets for p in pieces], dtype=np.int64)
    hi = lo + np.array([p.sizes for p in pieces], dtype=np.int64)
    for a in range(0, len(pieces), 256):
        both = (lo[a:a + 256, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[a:a + 256, None, :])
        over = both.all(axis=2)
        idx = np.arange(a, min(a + 256, len(pieces)))
        over[np.arange(len(idx)), idx] = False  # (a box overlaps itself)
        if over.any():
            i, j = (int(v) for v in np.argwhere(over)[0])
            raise MappingError(f"mapping: pieces of target {name!r} from {pieces[a + i].source!r} and "
                               f"{pieces[j].source!r} overlap")


def _compile(pattern: Any) -> re.Pattern:
    if not isinstance(pattern, str):
        raise MappingError(f"mapping: a target pattern must be a regular expression string, got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise MappingError(f"mapping: target pattern {pattern!r}: {e}") from None


def _heads(config: Any, num_heads: int | None, num_kv_heads: int | None, what: str) -> tuple[int, int]:
    heads = num_heads if num_heads is not None else getattr(config, "num_attention_heads", None)
    kv = num_kv_heads if num_kv_heads is not None else getattr(config, "num_key_value_heads", None) or heads
    if type(heads) is not int or type(kv) is not int or heads <= 0 or kv <= 0:  # (True is no head count)
        raise MappingError(f"{what} needs the attention heads as integers > 0: pass a transformers config or "
                           f"num_heads= and num_kv_heads= (got {heads!r}, {kv!r})")
    return heads, kv


def _head_dim(config: Any, head_dim: int | None, heads: int, what: str) -> int | None:
    """Rows per head: given, the config's ``head_dim``, or its ``hidden_size / heads``; None
    when none is known (then only the rows' divisibility by the heads is checked)."""
    hd = head_dim if head_dim is not None else getattr(config, "head_dim", None)
    if hd is None and type(getattr(config, "hidden_size", None)) is int and config.hidden_size % heads == 0:
        hd = config.hidden_size // heads
    if hd is not None and (type(hd) is not int or hd <= 0 or hd % 2):
        raise MappingError(f"{what}: head_dim must be an even integer > 0, got {hd!r}")
    return hd


#: (torchtitan, Hugging Face) names of a Llama, as regular expressions of the layer index
_TITAN_NAMES = [
    (r"tok_embeddings\.weight", r"model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.wv\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"norm\.weight", r"model.norm.weight"),
    (r"output\.weight", r"lm_head.weight"),
]


def _titan_rules(heads: int, kv: int, to_hf: bool, head_dim: int | None = None) -> list[Rule]:
    """Renames both ways between torchtitan's and Hugging Face's Llama names, and the rotary
    permutation of q (``heads``) and k (``kv`` heads)."""
    def regex(name: str) -> str:  # a replacement string as the pattern of the other direction
        return re.escape(name).replace(r"\\1", r"(\d+)").replace(r"\1", r"(\d+)")

    def repl(pattern: str) -> str:  # a pattern as the replacement of the other direction
        return pattern.replace(r"(\d+)", r"\1").replace("\\.", ".")

    rules: list[Rule] = []
    for titan, hf in _TITAN_NAMES:
        if to_hf:
            rules.append(_Rename(re.compile(regex(hf)), repl(titan)))
        else:
            rules.append(_Rename(re.compile(titan), hf))
    for x, h in (("q", heads), ("k", kv)):
        titan, hf = rf"layers\.(\d+)\.attention\.w{x}\.weight", rf"model.layers.\1.self_attn.{x}_proj.weight"
        if to_hf:
            rules.append(_Rotary(re.compile(regex(hf)), repl(titan), h, True, head_dim))
        else:
            rules.append(_Rotary(re.compile(titan), hf, h, False, head_dim))
    return rules


def expand(entries: list, mapping: Mapping, source_shape: Callable[[str, str], Shape | None]) -> list:
    """The load entries of ``entries`` under ``mapping``: each mapped target replaced by one
    entry per piece it holds (a view of its local tensor, the piece's box of the source).
    ``source_shape(role, name)``: the stored shape, or None."""
    from .state import Entry

    out = []
    for e in entries:
        pieces = mapping.pieces(e.name, e.layout.shape, lambda n, r=e.role: source_shape(r, n))
        if pieces is None:
            out.append(e)
            continue
        lay, rule = e.layout, mapping.rule_for(e.name)
        if lay.flat is not None and len(pieces) == 1 and isinstance(rule, _Rename):
            out.append(Entry(e.role, pieces[0].source, e.local, lay, (), e.per_rank))
            continue
        if e.aliases:
            raise MappingError(f"mapping: target {e.role}/{e.name} is tied to {list(e.aliases)}: map each name on "
                               "its own tensor")
        if lay.flat is not None:
            out += expand(_flat_boxes(e), mapping, source_shape)  # (boxes of the partition, each a view of it)
            continue
        if isinstance(rule, _Rotary):
            out += _rotary_entries(e, rule, source_shape)
            continue
        for pc in pieces:
            lo = [max(a, b) for a, b in zip(lay.offsets, pc.offsets)]
            hi = [min(a + s, b + t) for a, s, b, t in zip(lay.offsets, lay.sizes, pc.offsets, pc.sizes)]
            if any(h <= low for h, low in zip(hi, lo)):
                continue  # this rank holds none of the piece
            view = e.local[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, lay.offsets))]
            if pc.perm is not None:  # the box in the source's order of dimensions (a view, no copy)
                inv = tuple(pc.perm.index(j) for j in range(len(pc.perm)))
                sshape = source_shape(e.role, pc.source)
                out.append(Entry(e.role, pc.source, view.permute(inv), Layout(
                    tuple(sshape), tuple(pc.source_offsets[j] + lo[inv[j]] - pc.offsets[inv[j]] for j in range(len(inv))),
                    tuple(hi[inv[j]] - lo[inv[j]] for j in range(len(inv))), None, lay.replica)))
                continue
            for d in sorted(pc.squeeze, reverse=True):
                view = view.select(d, 0)
            src_off = tuple(so + (a - po) for d, (so, a, po) in enumerate(zip(_full(pc.source_offsets, pc.squeeze,
                                                                                      len(lo)), lo, pc.offsets))
                            if d not in pc.squeeze)
            sizes = tuple(b - a for d, (a, b) in enumerate(zip(lo, hi)) if d not in pc.squeeze)
            sshape = pc.source_view or source_shape(e.role, pc.source)  # (a view: the source reshaped, row-major)
            if sshape is None:
                raise TensorMissingError(f"mapping: target {e.name!r} needs {pc.source!r}, which the checkpoint does "
                                         "not hold")
            out.append(Entry(e.role, pc.source, view, Layout(tuple(sshape), src_off, sizes, None, lay.replica),
                             reshaped=pc.source_view is not None))
    return out


def _flat_boxes(e) -> list:
    """A flat (ZeRO) target as the boxes that tile its range of the box's row-major
    flattening (at most two per dimension: a partial row, whole rows, ...), each an entry
    whose local tensor is a view of the partition's own memory."""
    from .state import Entry

    lay = e.layout
    start, stop = lay.flat
    flat = e.local.reshape(-1)
    if flat.numel() != stop - start or (flat.numel() and flat.data_ptr() != e.local.data_ptr()) or (
            flat.numel() > 1 and flat.stride(0) != 1):
        raise NotImplementedError(f"mapping: target {e.role}/{e.name} is a flat partition whose memory is not one "
                                  "contiguous run of its elements")
    sizes = tuple(lay.sizes)
    strides = [math.prod(sizes[k + 1:]) for k in range(len(sizes))]
    out, a = [], start
    while a < stop and sizes:
        idx = [(a // st) % n for st, n in zip(strides, sizes)]
        for k, st in enumerate(strides):  # the outermost dimension at which whole units start here and fit
            if a % st == 0 and a + st <= stop:
                cnt = min((stop - a) // st, sizes[k] - idx[k])
                box = (1,) * k + (cnt,) + sizes[k + 1:]
                view = flat[a - start:a - start + cnt * st].view(box)
                offs = tuple(o + i for o, i in zip(lay.offsets, idx))
                out.append(Entry(e.role, e.name, view, Layout(lay.shape, offs, box, None, lay.replica), (), e.per_rank))
                a += cnt * st
                break
    if not sizes and stop > start:  # (a 0-d tensor: its one element)
        out.append(Entry(e.role, e.name, flat.view(()), Layout(lay.shape, lay.offsets, sizes, None, lay.replica), (),
                         e.per_rank))
    return out


def _rotary_entries(e, rule: _Rotary, source_shape) -> list:
    """Entries of a target whose rows a :class:`_Rotary` rule permutes, whole or any box of
    it (a TP or FSDP row shard, a column block): for each head's half ``a`` and the pair
    index ``b`` range the box holds, the target's rows ``h*hd + 2b + a`` (strided, Meta's
    layout) and the source's ``h*hd + a*hd/2 + b`` (contiguous, Hugging Face's), or the
    other way round. Every view is made without a copy."""
    from .state import Entry

    lay = e.layout  # (a box: flat targets come here as theirs)
    src = rule._sub(rule.repl, e.name)
    rows, cols = lay.shape
    hd = rows // rule.heads
    half = hd // 2
    (r0, c0), (nr, nc) = lay.offsets, lay.sizes
    r1 = r0 + nr
    out = []
    for h in range(rule.heads):
        for a in range(2):
            if rule.to_hf:  # target rows h*hd + a*half + b <- source rows h*hd + 2b + a
                lo = h * hd + a * half
                b0, b1 = max(0, r0 - lo), min(half, r1 - lo)
                if b1 <= b0:
                    continue
                view = e.local[lo + b0 - r0:lo + b1 - r0].view(1, b1 - b0, 1, nc)
                out.append(Entry(e.role, src, view, Layout((rule.heads, half, 2, cols), (h, b0, a, c0),
                                                             (1, b1 - b0, 1, nc), None, lay.replica), reshaped=True))
            else:  # target rows h*hd + 2b + a <- source rows h*hd + a*half + b
                b0 = max(0, -(-(r0 - h * hd - a) // 2))
                b1 = min(half, -(-(r1 - h * hd - a) // 2))
                if b1 <= b0:
                    continue
                start = h * hd + 2 * b0 + a - r0
                view = e.local[start:start + 2 * (b1 - b0) - 1:2]
                out.append(Entry(e.role, src, view, Layout(tuple(source_shape(e.role, src)), (h * hd + a * half + b0, c0),
                                                             (b1 - b0, nc), None, lay.replica)))
    return out


def _full(source_offsets: Shape, squeeze: tuple[int, ...], n: int) -> list[int]:
    """Source offsets spread over the target's ``n`` dimensions (0 at squeezed ones)."""
    it = iter(source_offsets)
    return [0 if d in squeeze else next(it) for d in range(n)]
