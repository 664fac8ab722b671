"""The modules a save and a resharded load walk through (issue #38's measure of how far a
reader must follow one call): every ``unickpt`` module whose functions run during the call,
and the hand-offs between modules (a call from one module's function into another's).

    .venv/bin/python bench/walks.py

One process (the collectives of a one-rank group still run), a small state: a row-sharded
matrix, a replicated bias and Adam moments saved with O1 (so the codec path is walked too),
loaded back as column blocks. Prints the modules of each walk by layer (docs/design.md) and
how many times control came back into a module after calling out of it. Counts, not
timings: the figure does not depend on the machine.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import unickpt  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(unickpt.__file__)) + os.sep


def _module(filename: str) -> str | None:
    if not filename.startswith(ROOT):
        return None
    rel = filename[len(ROOT):-3].replace(os.sep, ".")
    return "unickpt" + ("" if rel == "__init__" else "." + rel.removesuffix(".__init__"))


def walk(fn) -> tuple[list[str], int, set]:
    """``fn()``'s unickpt modules in the order first entered, the hand-offs between modules
    (calls whose caller is in another unickpt module), and the re-entries: a module called
    again while one of its own functions is further down the stack with another module's in
    between (a callback into it, ``A -> B -> A``), as ``(A, B)`` pairs."""
    seen: list[str] = []
    handoffs = 0
    reentries: set = set()

    def prof(frame, event, arg):
        nonlocal handoffs
        if event != "call":
            return
        m = _module(frame.f_code.co_filename)
        if m is None:
            return
        if m not in seen:
            seen.append(m)
        caller = frame.f_back
        cm = _module(caller.f_code.co_filename) if caller is not None else None
        if cm is not None and cm != m:
            handoffs += 1
            f = caller.f_back
            while f is not None:  # is m further down, below another module's frames?
                fm = _module(f.f_code.co_filename)
                if fm == m:
                    reentries.add((m.removeprefix("unickpt."), cm.removeprefix("unickpt.")))
                    break
                f = f.f_back

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen, handoffs, reentries


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    state = {"model": {"w": unickpt.shard(w[:128].clone(), (256, 128), offsets=(0, 0)), "b": torch.randn(128)},
             "optimizer": {"w.exp_avg": torch.randn(256, 128) * 1e-3, "w.exp_avg_sq": torch.rand(256, 128) * 1e-6}}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "step-00000001")
        full = {"model": {"w": w, "b": state["model"]["b"]}, "optimizer": state["optimizer"]}
        unickpt.save(full, path, quant="O1", group="local")  # warm: first-call imports are not the walk
        save_mods, save_hand, save_re = walk(lambda: unickpt.save(full, os.path.join(d, "step-00000002"), quant="O1",
                                                         group="local"))
        target = {"model": {"w": unickpt.shard(torch.zeros(256, 64), (256, 128), offsets=(0, 64)),
                            "b": torch.zeros(128)},
                  "optimizer": {"w.exp_avg": torch.zeros(256, 128), "w.exp_avg_sq": torch.zeros(256, 128)}}
        unickpt.load(target, path, group="local")
        load_mods, load_hand, load_re = walk(lambda: unickpt.load(target, path, group="local"))
    for what, mods, hand, back in (("save (O1)", save_mods, save_hand, save_re),
                                   ("load, resharded", load_mods, load_hand, load_re)):
        units = list(dict.fromkeys(".".join(m.split(".")[:2]) for m in mods))  # a package counts once
        print(f"{what}: {len(mods)} modules in {len(units)} top-level modules/packages, {hand} calls across modules")
        print("  " + " ".join(m.removeprefix("unickpt.") or "unickpt" for m in mods))
        print(f"  re-entered (module <- the module that called back into it): {len(back)}: "
              + ", ".join(f"{a} <- {b}" for a, b in sorted(back)))


if __name__ == "__main__":
    main()
