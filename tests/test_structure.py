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


DESIGN = os.path.join(os.path.dirname(ROOT), "docs", "design.md")


def layers() -> dict[str, int]:
    """The layer table of docs/design.md: ``name -> layer`` (a name covers its module or
    package; ``unickpt`` is the package's own ``__init__``)."""
    text = open(DESIGN).read()
    block = text.split("<!-- layers:", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    out: dict[str, int] = {}
    for line in block.strip().splitlines():
        n, _, *names = line.split()
        for name in names:
            assert name not in out, f"{name} is listed twice in docs/design.md's layers"
            out[name] = int(n)
    return out


def layer_of(module: str, table: dict[str, int]) -> int | None:
    if module == "unickpt":
        return table.get("unickpt")
    rest = module[len("unickpt."):]
    best = None
    for name, n in table.items():
        if name != "unickpt" and (rest == name or rest.startswith(name + ".")):
            if best is None or len(name) > len(best[0]):
                best = (name, n)
    return best[1] if best else None


def test_design_md_places_every_module_in_a_layer_and_imports_only_go_down():
    """docs/design.md's layers are the code's: every module has one, and none imports a
    module of a higher layer (imports inside functions count; TYPE_CHECKING ones do not)."""
    table = layers()
    graph = import_graph()
    unplaced = sorted(m for m in graph if layer_of(m, table) is None)
    assert not unplaced, f"modules docs/design.md's layers do not place: {unplaced}"
    up = sorted(f"{a} (layer {layer_of(a, table)}) imports {b} (layer {layer_of(b, table)})"
                for a, bs in graph.items() for b in bs if layer_of(b, table) > layer_of(a, table))
    assert not up, "imports that go up a layer:\n" + "\n".join(up)
    stale = sorted(n for n in table if n != "unickpt" and not any(m == f"unickpt.{n}" or m.startswith(f"unickpt.{n}.")
                                                                  for m in graph))
    assert not stale, f"docs/design.md's layers name modules that do not exist: {stale}"


def test_every_relative_import_names_a_module_that_exists():
    """After moving modules, an import inside a function that still names the old place
    would fail only when that function runs: every relative import must resolve."""
    mods = _modules()
    bad = []
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if target not in mods:
                    bad.append(f"{path}:{node.lineno}: {target}")
    assert not bad, bad
