"""The shape of the code (#38): the import graph of ``unickpt`` has no cycles, counting the
imports inside functions too (a cycle hidden in a function is still two modules that need
each other). Measured with ``ast``, as anyone can rerun it."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unickpt")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def import_graph(typing_only: bool = False) -> dict[str, set[str]]:
    """``module -> modules of unickpt it imports`` (at any depth of the file; ``if
    TYPE_CHECKING:`` blocks are left out unless ``typing_only``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        tree = ast.parse(open(path).read())
        skip: set[int] = set()
        if not typing_only:
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    skip |= {id(n) for b in node.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = package.split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in mods else stem for a in node.names]
            graph[mod] |= {t for t in targets if t in mods and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_import_graph_has_no_cycles():
    found = cycles(import_graph())
    assert not found, f"import cycles (imports inside functions count): {found}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_validation_trainer_uses_only_public_names():
    """unickpt.train is a user of the library (#37): it imports ``unickpt``, ``unickpt.errors``
    and its own modules, nothing internal."""
    graph = import_graph(typing_only=True)
    internal = {m for m in graph if m.startswith("unickpt.") and not m.startswith("unickpt.train")} - {"unickpt.errors"}
    used = {m: sorted(graph[m] & internal) for m in graph if m.startswith("unickpt.train")}
    assert not any(used.values()), used
